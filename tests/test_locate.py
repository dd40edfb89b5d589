"""`lora-parity locate` without an engine: the rule on synthetic hidden-state distances, the sequence pick, the
result's strictness, the markdown section, and the CLI's refusals of bad input (one line, exit 2)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from lora_parity.evidence.locate_models import LocateResult, LocateRule
from lora_parity.verdict import locate_rule as lr

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit

RULE = LocateRule()
LAYERS = 12
NAMES = ["embed", *[f"layers.{i}" for i in range(LAYERS)], "norm"]


def _tokens(rng: random.Random, level: float, n: int) -> list[float]:
    """Per-token distances around `level`, spread as rounding is (log-normal, about a factor 1.5)."""
    return [level * rng.lognormvariate(0.0, 0.4) for _ in range(n)]


def _bf16_like(seed: int, leave_at: int | None = None, jump: float = 30.0) -> list[lr.PointData]:
    """Two half-precision sides whose distance from fp32 grows layer by layer as bf16 noise does (each side its
    own draw, the engine's kernels up to 1.3x less accurate); with `leave_at`, the engine jumps there and stays."""
    rng = random.Random(seed)
    points = []
    for i, name in enumerate(NAMES):
        level = 0.0 if name == "embed" else 4e-3 * (1.25 ** i)
        engine_level = level * 1.3 * (jump if leave_at is not None and i >= leave_at else 1.0)
        trainer = [_tokens(rng, level, n) for n in (64, 128)]
        engine = [_tokens(rng, engine_level, n) for n in (64, 128)]
        points.append(lr.PointData(name, i - 1 if 0 < i <= LAYERS else None, name, trainer, engine))
    return points


def test_pure_bf16_noise_growth_names_no_layer_over_seeds() -> None:
    for seed in range(20):
        points, found = lr.judge(_bf16_like(seed), RULE)
        assert found == [], (seed, found)
        assert all(p.engine.witness in ("other side", "none") for p in points)


def test_a_side_that_leaves_at_layer_k_is_named_there_and_not_earlier() -> None:
    for k in (1, 5, 12):
        _, found = lr.judge(_bf16_like(k, leave_at=k), RULE)
        assert [(d.side, d.point) for d in found] == [("engine", NAMES[k])]
        assert found[0].statistic == "median" and found[0].observed > found[0].threshold


def test_a_small_jump_within_the_balance_is_not_named() -> None:
    # 1.4x the other side's distance (1.3 x 1.4 = 1.8 < balance 2): what two kernels of one precision may differ by.
    _, found = lr.judge(_bf16_like(3, leave_at=4, jump=1.4), RULE)
    assert found == []


def test_the_trainer_is_named_when_it_is_the_side_that_leaves() -> None:
    points = [lr.PointData(p.name, p.layer, p.module, p.engine, p.trainer) for p in _bf16_like(7, leave_at=6)]
    _, found = lr.judge(points, RULE)
    assert [(d.side, d.point) for d in found] == [("trainer", NAMES[6])]


def _fp32_like(seed: int, offset_at: int | None = None) -> list[lr.PointData]:
    """An fp32 checkpoint: the trainer is the fp32 reference bit for bit (0), the engine and the fp32 reference
    against fp64 about equally far (1e-7 growing); with `offset_at`, a 1e-3 change in the engine there."""
    rng = random.Random(seed)
    points = []
    for i, name in enumerate(NAMES):
        level = 0.0 if name == "embed" else 2e-7 * (1.1 ** i)
        fault = 1e-3 if offset_at is not None and i >= offset_at else 0.0
        engine = [[x + fault for x in _tokens(rng, level, n)] for n in (65, 129)]
        fp64 = [_tokens(rng, level, n) for n in (65, 129)]
        points.append(lr.PointData(name, None, name, [[0.0] * 65, [0.0] * 129], engine, fp64))
    return points


def test_fp32_engine_noise_against_the_fp64_witness_names_nothing_and_a_planted_change_is_named() -> None:
    for seed in range(10):
        points, found = lr.judge(_fp32_like(seed), RULE, floor=lr.rounding_floor(1.19e-7, 128))
        assert found == [], seed
        assert {p.engine.witness for p in points[1:]} == {"fp32 vs fp64"}
    _, found = lr.judge(_fp32_like(0, offset_at=3), RULE, floor=lr.rounding_floor(1.19e-7, 128))
    assert [(d.side, d.point) for d in found] == [("engine", NAMES[3])]


def test_where_nothing_measured_the_precision_the_dtype_rounding_is_the_witness() -> None:
    floor = lr.rounding_floor(1.19e-7, 128)  # √128 × 2^-24: 6.7e-7
    assert floor == pytest.approx(128 ** 0.5 * 1.19e-7 / 2)
    zeros = [[0.0] * 10, [0.0] * 10]
    within = lr.PointData("layers.0.input_layernorm", 0, "input_layernorm", zeros, [[floor] * 10, [floor] * 10],
                          zeros)
    beyond = lr.PointData("layers.0.input_layernorm", 0, "input_layernorm", zeros, [[3 * floor] * 10] * 2, zeros)
    points, found = lr.judge([within], RULE, floor)
    assert found == [] and points[0].engine.witness == "dtype rounding"
    assert points[0].engine.median_threshold == pytest.approx(RULE.balance * floor)
    assert [d.point for d in lr.judge([beyond], RULE, floor)[1]] == ["layers.0.input_layernorm"]
    # Without a floor (none given), an exact witness makes any difference a departure.
    assert lr.judge([within], RULE)[1][0].side == "engine"


def test_a_few_tokens_far_off_are_named_by_the_max() -> None:
    points = _bf16_like(11)
    bad = points[4]
    engine = [list(s) for s in bad.engine]
    engine[1][17] *= 400  # one token: the median stays, the max leaves
    points[4] = lr.PointData(bad.name, bad.layer, bad.module, bad.trainer, engine)
    _, found = lr.judge(points, RULE)
    assert [(d.point, d.statistic) for d in found] == [(NAMES[4], "max")]
    assert "(a few tokens)" in lr.summary_line(found)


def test_jackknife_over_sequences_and_over_blocks_of_one_sequence() -> None:
    # Two groups: delete-one medians 5 and 2; se = sqrt(1/2 · ((5 - 3.5)² + (2 - 3.5)²)) = 1.5.
    spread = lr.jackknife([[1, 2, 3], [4, 5, 6]], lr.statistics.median)
    assert spread.value == 3.5 and spread.se == pytest.approx(1.5)
    one = lr.jackknife([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], max)
    assert one.value == 1.0 and one.se == 0.0  # four blocks, all alike
    with pytest.raises(ValueError):
        lr.jackknife([[], []], max)


def test_the_worst_sequences_by_a_are_picked_worst_first() -> None:
    scores = {"zero": [[-1.0, -2.0], [-1.0, -2.0], [-3.0]], "trainer_zero": [[-1.0, -2.1], [-1.5, -2.0], [-3.0]]}
    picked = lr.pick_sequences(scores, 2)
    assert [p.index for p in picked] == [1, 0]
    assert picked[0].max_abs == 0.5 and picked[0].num_tokens == 3
    with pytest.raises(ValueError):
        lr.pick_sequences({"zero": []}, 2)


def test_a_failing_a_points_to_locate() -> None:
    checks = [SimpleNamespace(id="A.parity.max", status="fail"), SimpleNamespace(id="A.noise.sampler_repeat",
                                                                                 status="fail"),
              SimpleNamespace(id="C.parity.mean", status="fail")]
    assert lr.failing_a(checks) == ["A.parity.max"]
    assert (lr.locate_hint(checks, "r.json") or "").startswith("next: lora-parity locate r.json")
    assert lr.locate_hint([SimpleNamespace(id="A.parity.max", status="pass")], "r.json") is None


def _result(**extra: object) -> dict[str, object]:
    points, found = lr.judge(_bf16_like(2, leave_at=3), RULE)
    data = LocateResult(tool_version="0", created_at="2026-01-01T00:00:00Z", receipt_digest="0" * 64, model="m",
                        dtype="bfloat16", trainer="hf", sampler="vllm", a_failed=["A.parity.mean"],
                        sequences=[], rule=RULE, rounding_floor=0.0, points=points, divergences=found,
                        timings={"total": 1.0}).model_dump(mode="json")
    return {**data, **extra}


def test_the_result_is_strict_and_renders_escaped_markdown() -> None:
    from lora_parity.report.locate import markdown

    result = LocateResult.model_validate(_result())
    with pytest.raises(ValidationError):
        LocateResult.model_validate(_result(extra_field=1))
    with pytest.raises(ValidationError):
        LocateResult.model_validate(_result(schema_version=2))
    text = markdown(result, "run|<b>.json")
    assert "| layers.2 |" in text.replace("\\_", "_") and "the engine leaves at layers.2" in text
    assert "<b>" not in text and "run\\|" in text


RECEIPT = ROOT / "receipts" / "tiny-qwen3__hf__vllm__20261130T134155Z.json"


def _one_line_exit_2(result: object, *words: str) -> None:
    assert result.returncode == 2, result.stderr  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr  # type: ignore[attr-defined]
    assert all(w in lines[0] for w in words), lines[0]


def test_bad_receipts_are_one_line_and_exit_2(tmp_path: Path) -> None:
    _one_line_exit_2(cli("locate", str(tmp_path / "missing.json")), "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema_version": 1, "scores": ')
    _one_line_exit_2(cli("locate", str(broken)), "not valid JSON")
    tampered = tmp_path / "tampered.json"
    data = json.loads(RECEIPT.read_text())
    data["scores"]["zero"][0][0] += 0.5
    tampered.write_text(json.dumps(data))
    _one_line_exit_2(cli("locate", str(tampered)))
    assert not (tmp_path / "tampered.locate.json").exists()


def test_an_existing_result_and_a_bad_fault_are_refused_before_anything_runs(tmp_path: Path) -> None:
    receipt = tmp_path / "r.json"
    shutil.copy(RECEIPT, receipt)
    (tmp_path / "r.locate.json").write_text("keep")
    _one_line_exit_2(cli("locate", str(receipt)), "exists", "--force")
    assert (tmp_path / "r.locate.json").read_text() == "keep"
    for bad in ("engine-norm@x", "engine-norm@1x3", "engine-norm@1x0.9"):
        _one_line_exit_2(cli("locate", str(receipt), "--out", str(tmp_path / "x.json"), "--inject", bad),
                         "engine-norm@K")


def test_a_receipt_that_names_no_shipped_config_or_another_digest_cannot_be_located_here(tmp_path: Path) -> None:
    # The committed receipt's config has changed since it was made: refused, never run on another model.
    _one_line_exit_2(cli("locate", str(RECEIPT), "--out", str(tmp_path / "x.json")), "digest")
    assert not (tmp_path / "x.json").exists()


def test_a_run_whose_a_fails_points_to_locate(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = cli("run", "--trainer", "fake", "--sampler", "fake", "--inject", "misalign", "--out", str(out))
    assert result.returncode == 1, result.stderr
    assert f"next: lora-parity locate {out}" in result.stdout
    clean = cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "c.json"))
    assert clean.returncode == 0 and "lora-parity locate" not in clean.stdout


def test_a_receipt_of_other_backends_is_refused_in_one_line(tmp_path: Path) -> None:
    receipt = tmp_path / "fake.json"
    made = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--out", str(receipt))
    assert made.returncode == 0, made.stderr
    _one_line_exit_2(cli("locate", str(receipt)), "--trainer hf and --sampler vllm")
    assert not (tmp_path / "fake.locate.json").exists()


def test_tokens_routed_apart_at_a_near_tie_are_left_out_from_their_moe_layer_on() -> None:
    # tiny-glm-dsa on the GPU, clean: the engine took other experts at near ties in layer 1 and its MLP output there
    # left fp32 at those tokens by the max; precision explains a near-tie flip, so they are left out from that
    # layer's output on (a flip across a wide gap is not in `near_ties` and still names the layer).
    points = _bf16_like(11)
    flipped = {(1, 17): 3, (0, 5): 3}
    for i, p in enumerate(points):
        if p.layer is not None and p.layer >= 3:
            engine = [list(s) for s in p.engine]
            engine[1][17] *= 400
            engine[0][5] *= 400
            points[i] = lr.PointData(p.name, p.layer, p.module, p.trainer, engine)
    _, named = lr.judge(points, RULE)
    assert [(d.point, d.statistic) for d in named] == [("layers.3", "max")]
    judged, found = lr.judge(points, RULE, near_ties=flipped)
    assert found == []
    assert [p.left_out for p in judged] == [0] * 4 + [2] * (len(NAMES) - 4)  # from layers.3 (its output) on
    line = lr.summary_line(found, judged)
    assert line.startswith("no layer named") and "2 token(s) that a side routed apart from fp32 at a near tie left " \
        "out from layers.3 on: precision" in line
    # A departure at those tokens before the flip's layer is still seen: the flip at layer 3 leaves layer 2 whole.
    judged, found = lr.judge(points, RULE, near_ties={(1, 17): 4, (0, 5): 4})
    assert [d.point for d in found] == ["layers.3"]
