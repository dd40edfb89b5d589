"""Delivery and computation as the verdict's structure, the noise measured where each judgement is made, and
the power of C.slope (docs/verdicts.md, "Delivery and computation"). Scores are built by hand: a base model,
both sides' bf16-like errors, the fp32 reference at the start and at each end point, and a sampler that makes
some fraction of the trainer's change."""

import math
import random

import pytest

from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models.config import profile_budgets
from lora_parity.verdict import checks, findings, stats

BF16 = profile_budgets("bf16")
LENGTHS = (96, 96)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _split(flat: list[float], lengths: tuple[int, ...] = LENGTHS) -> list[list[float]]:
    out, i = [], 0
    for n in lengths:
        out.append(flat[i:i + n])
        i += n
    return out


def scenario(seed: int = 0, scale: float = 1.0, noise: float = 0.03, swap: tuple[str, str] | None = None,
             engine_off: int = 0, synced: bool = True, lengths: tuple[int, ...] = LENGTHS,
             size: float = 0.4, layer_groups: dict[str, float] | None = None,
             trainer_off: float = 0.0) -> dict[str, list[list[float]]]:
    """Scores of one run: `scale` of the trainer's change reaches the sampler in every phase, each side adds
    its own error of std `noise` at every point, `swap` exchanges two targets' changes on the sampler,
    `engine_off` tokens of the synced sampler are 2.5 nats off, `synced` False keeps the stale sampler,
    `layer_groups` adds per-layer runs, each made at its given share by the sampler, `trainer_off` adds an
    error of that std to the trainer at every end point (a trainer less precise than the engine there)."""
    layer_groups = layer_groups or {}  # per-layer runs (`kind@first-last`) and the share of each the engine makes
    rng = random.Random(seed)
    n = sum(lengths)
    base = [-rng.uniform(0.2, 6.0) for _ in range(n)]

    def err(extra: float = 0.0) -> list[float]:
        return [rng.gauss(0.0, noise) + (rng.gauss(0.0, extra) if extra else 0.0) for _ in range(n)]

    def change() -> list[float]:
        return [rng.gauss(0.0, size) for _ in range(n)]

    def at(d: list[float], e: list[float], k: float = 1.0) -> list[list[float]]:
        return _split([b + k * x + y for b, x, y in zip(base, d, e, strict=True)], lengths)

    zero_t, zero_s = err(), err()
    scores = {"base": at([0.0] * n, zero_s), "reference_fp32": _split(base, lengths)}
    scores["zero"] = scores["zero_repeat"] = at([0.0] * n, zero_s)
    scores["trainer_zero"] = scores["trainer_zero_repeat"] = at([0.0] * n, zero_t)
    d = change()
    scores["trainer_updated"] = at(d, [a + b for a, b in zip(zero_t, err(trainer_off), strict=True)])
    scores["reference_fp32_updated"] = at(d, [0.0] * n)
    scores["stale"] = scores["zero"]
    updated = [a + b for a, b in zip(zero_s, err(), strict=True)]
    for i in range(engine_off):
        updated[10 + 7 * i] += 2.5
    scores["updated"] = scores["updated_repeat"] = scores["fresh"] = at(d, updated, scale) if synced else scores["zero"]
    if not synced:
        scores["fresh"] = at(d, updated, scale)
    changes = {kind: change() for kind in (*TARGETS, *layer_groups)}
    for kind in (*TARGETS, *layer_groups):
        served = changes[swap[1] if swap and kind == swap[0] else swap[0] if swap and kind == swap[1] else kind]
        scores[f"target.{kind}.trainer"] = at(changes[kind], [a + b for a, b in zip(zero_t, err(trainer_off),
                                                                                 strict=True)])
        share = scale * layer_groups.get(kind, 1.0)
        scores[f"target.{kind}.sampler"] = at(served, [a + b for a, b in zip(zero_s, err(), strict=True)], share)
        scores[f"target.{kind}.reference"] = at(changes[kind], [0.0] * n)
    return scores


def judged(scores: dict[str, list[list[float]]], budgets=BF16) -> tuple[checks.Evaluation, dict[str, CheckStatus]]:
    ev = checks.evaluate(scores, budgets, errored=False)
    return ev, {c.id: c.status for c in ev.checks}


def sequences(lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    return [list(range(n + 1)) for n in lengths]


@pytest.mark.unit
def test_slope_and_its_jackknife_error() -> None:
    """A sampler that makes 0.9 of every change gives a ratio of 0.9 against the fp32 reference's change, and
    the error comes from leaving out blocks of positions (no two sequences share a block)."""
    ids, blocks = stats.block_ids([10, 9])
    assert blocks == 4 and ids[:10] == [0] * 8 + [1] * 2 and ids[10:] == [2] * 8 + [3]
    dr = [float(i % 5 - 2) for i in range(19)]
    exact = stats.update_slope([([0.9 * x for x in dr], dr, dr)], ids, blocks)
    assert exact is not None and exact[0] == pytest.approx(0.9) and exact[1] == pytest.approx(0.0, abs=1e-12)
    assert stats.update_slope([([0.0] * 19, [0.0] * 19, [0.0] * 19)], ids, blocks) is None  # no change: no slope
    assert stats.update_slope([(dr[:8], dr[:8], dr[:8])], [0] * 8, 1) is None  # one block: no uncertainty


@pytest.mark.unit
def test_a_ten_percent_scale_fails_a_three_percent_one_within_its_noise_passes() -> None:
    short = (24, 24)
    clean = judged(scenario(scale=1.0, noise=0.08, lengths=short, size=0.6))
    scaled_scores = scenario(scale=0.9, noise=0.08, lengths=short, size=0.6)
    scaled = judged(scaled_scores)
    assert clean[0].verdict == Verdict.PASS
    slope, _, against_reference = checks.update_slopes(scaled_scores)
    assert against_reference and slope is not None and 0.005 < slope[1] < 0.02  # 0.90 ± 0.008
    assert slope[0] == pytest.approx(0.9, abs=0.03)
    assert scaled[1]["C.slope"] == CheckStatus.FAIL
    # Delivered (X passed, the sampler moved only after the sync): the scale is a computation finding.
    assert scaled[0].verdicts.sync.verdict == Verdict.PASS and scaled[0].verdicts.numerics.verdict == Verdict.FAIL
    found = findings.findings(scaled_scores, scaled[0].checks, sequences(short), True)
    assert any(line.startswith("a scale: the engine applies the update at 0.89") for line in found), found
    # The side, from the fp32 reference's change: the engine makes 0.9 of it, the trainer all of it.
    scale = next(line for line in found if line.startswith("a scale"))
    assert "against the fp32 reference's change the trainer makes" in scale and "(the engine is off" in scale, scale
    # 0.97 ± 0.05: its uncertainty covers it.
    loose = scenario(scale=0.97, noise=0.4, lengths=short, size=0.5)
    slope, _, _ = checks.update_slopes(loose)
    assert slope is not None and 0.03 < slope[1] < 0.07
    assert judged(loose)[1]["C.slope"] == CheckStatus.PASS


@pytest.mark.unit
def test_slope_without_the_rule_is_not_a_check() -> None:
    """Receipts made before C.slope (no slope_k) get no such check: they verify as recorded."""
    old = BF16.model_copy(update={"noise": BF16.noise.model_copy(update={"slope_k": None})})
    assert "C.slope" not in judged(scenario(scale=0.9), old)[1]


@pytest.mark.unit
def test_a_swap_is_named() -> None:
    ev, status = judged(scenario(swap=("k_proj", "v_proj")))
    failing = {i for i, s in status.items() if s == CheckStatus.FAIL}
    assert {"T.k_proj.cosine", "T.v_proj.cosine"} <= failing
    assert not any(i.startswith(("T.q_proj", "T.o_proj")) for i in failing)
    found = findings.findings(scenario(swap=("k_proj", "v_proj")), ev.checks, sequences(), True)
    assert any(line.startswith("a swap: only k_proj and v_proj fail") for line in found), found


@pytest.mark.unit
def test_x_passed_and_c_failing_is_computation_with_the_side_named() -> None:
    scores = scenario(engine_off=4)
    ev, status = judged(scores)
    assert status["X.sync.identical"] == CheckStatus.PASS
    computation = [i for i, s in status.items() if s == CheckStatus.FAIL]
    assert computation and all(i.startswith(("C.parity", "C.delta", "C.slope")) for i in computation), computation
    assert ev.verdicts.sync.verdict == Verdict.PASS and ev.verdicts.numerics.verdict == Verdict.FAIL
    found = findings.findings(scores, ev.checks, sequences(), True)[0]
    assert found.startswith("delivered, computes differently") and "the engine is off" in found, found
    # The same receipt made before the rule: a sync failure, as then.
    old = BF16.model_copy(update={"noise": BF16.noise.model_copy(update={"x_proves_delivery": False})})
    assert judged(scores, old)[0].verdicts.sync.verdict == Verdict.FAIL


@pytest.mark.unit
def test_delivery_failures_stay_delivery_failures() -> None:
    """skip-sync: the sampler never moves, X sees the trainer's tensors score differently: sync fails."""
    ev, status = judged(scenario(synced=False))
    assert status["X.sync.identical"] == CheckStatus.FAIL and status["C.moved.sampler"] == CheckStatus.FAIL
    assert ev.verdicts.sync.verdict == Verdict.FAIL
    # No finding claims delivery, and a sampler that never moved is not called a scale (C's own lines say why).
    assert findings.findings(scenario(synced=False), ev.checks, sequences(), True) == []


@pytest.mark.unit
def test_c_and_t_are_triangulated_the_trainers_precision_is_not_held_against_the_engine() -> None:
    """delta_reference: where the fp32 reference was scored at each end point, C.delta and T.* compare the
    sampler's change with fp32's; a trainer less precise than the engine there no longer fails the engine, and
    what the engine gets wrong still fails, the side named."""
    old = BF16.model_copy(update={"noise": BF16.noise.model_copy(update={"delta_reference": False})})
    scores = scenario(trainer_off=0.12)
    before = judged(scores, old)[1]
    assert any(before[i] == CheckStatus.FAIL for i in ("C.delta.cosine", *(f"T.{k}.cosine" for k in TARGETS)))
    ev, status = judged(scores)
    assert not [i for i, s in status.items() if s == CheckStatus.FAIL], status
    d = ev.deltas["C.delta"]
    assert d.reference_to == "reference_fp32_updated" and d.trainer_rel_l2 > d.rel_l2
    assert "the trainer's own" in ev.thresholds["C.delta.cosine"].rule
    # A swap still fails both targets, and the reason says the engine is off the true change, not the trainer.
    swapped = judged(scenario(trainer_off=0.12, swap=("k_proj", "v_proj")))[0]
    failed = {c.id: c for c in swapped.checks if c.status == CheckStatus.FAIL}
    assert {"T.k_proj.cosine", "T.v_proj.cosine"} <= set(failed)
    assert "the engine is off" in failed["T.k_proj.cosine"].reason
    # A trainer that computes its own change far off the true one (dropout on, another scale) is named, as numerics.
    off = judged(scenario(trainer_off=0.3))[0]
    failed = {c.id: c for c in off.checks if c.status == CheckStatus.FAIL}
    assert "C.delta.trainer" in failed and "the trainer is off" in failed["C.delta.trainer"].reason
    assert off.verdicts.numerics.verdict == Verdict.FAIL and off.verdicts.sync.verdict == Verdict.PASS
    # Without the fp32 reference at the end points the deltas compare the two sides as before.
    bare = {k: v for k, v in scores.items() if not (k.endswith(".reference") or k == "reference_fp32_updated")}
    assert all(d.reference_to is None for d in judged(bare)[0].deltas.values())


@pytest.mark.unit
def test_noise_at_the_updated_point_widens_c_only_by_the_trainers_distance() -> None:
    """C's mean threshold grows with the trainer's distance from fp32 at the updated point, never with the
    sampler's own (a wrong sampler would widen its own bound)."""
    scores = scenario(noise=0.1)
    base = judged(scores)[0].thresholds["C.parity.mean"].budget
    far = dict(scores)
    far["updated"] = [[x - 0.5 for x in row] for row in scores["updated"]]  # the sampler far from fp32
    assert judged(far)[0].thresholds["C.parity.mean"].budget == pytest.approx(base)
    t_u = judged(scores)[0].comparisons["R.trainer_updated_vs_fp32"].mean_abs
    assert base >= 1.5 * t_u and math.isfinite(base)


@pytest.mark.cpu_e2e
def test_the_fp32_reference_at_a_point_carries_the_trainers_own_tensors() -> None:
    """fp32_points scores the fp32 model with the trainer's LoRA tensors taken from memory: on the fp32 tiny
    checkpoint, after an update, it gives the trainer's own scores; a set without a tensor is refused."""
    from lora_parity.backends.fp32_points import fp32_points
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import config, synthetic
    from lora_parity.util.errors import ConfigError

    cfg = config.load(None)
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    seqs = [[1, 5, 9, 17, 33, 2, 8], [4, 4, 7, 100, 3]]
    zero = trainer.score(seqs)
    trainer.perturb(0.05, 3)
    updated, tensors = trainer.score(seqs), trainer.lora_tensors()
    score = fp32_points(cfg, model_dir)
    got_updated, got_zero = score(seqs, [tensors, {**tensors, **{n: (d, s, bytes(len(b))) for n, (d, s, b) in
                                                                  tensors.items() if ".lora_B." in n}}])
    diff = max(abs(a - b) for ra, rb in zip(got_updated, updated, strict=True) for a, b in zip(ra, rb, strict=True))
    moved = max(abs(a - b) for ra, rb in zip(zero, updated, strict=True) for a, b in zip(ra, rb, strict=True))
    assert diff <= 1e-5 < moved  # the updated point itself, not the base model
    assert max(abs(a - b) for ra, rb in zip(got_zero, zero, strict=True) for a, b in zip(ra, rb, strict=True)) <= 1e-5
    missing = dict(tensors)
    missing.pop(next(iter(missing)))
    with pytest.raises(ConfigError, match="fp32 reference: the trainer's tensors have no"):
        score(seqs, [missing])


@pytest.mark.unit
def test_a_layer_group_the_engine_drops_part_of_is_named() -> None:
    """Per-layer runs are judged by their own slope: a group of four layers one of which does not reach the engine
    (0.75 of its change) fails T.K@A-B.slope, and the finding names the target and the layers; its neighbours
    pass, and a per-layer run makes no direction or scale checks of its own."""
    groups = {"down_proj@0-3": 1.0, "down_proj@4-7": 0.75, "down_proj@8-11": 1.0}
    scores = scenario(layer_groups=groups)
    ev, status = judged(scores)
    assert status["T.down_proj@4-7.slope"] == CheckStatus.FAIL
    assert status["T.down_proj@0-3.slope"] == status["T.down_proj@8-11.slope"] == CheckStatus.PASS
    assert "T.down_proj@4-7.cosine" not in status and status["T.down_proj@4-7.moved"] == CheckStatus.PASS
    assert ev.verdicts.sync.verdict == Verdict.PASS  # X passed: the engine reads what the trainer holds
    found = findings.findings(scores, ev.checks, sequences(), True)
    assert any(line.startswith("the update of down_proj in layers 4-7 reaches the engine at 0.7") for line in found)
    clean = judged(scenario(layer_groups=dict.fromkeys(groups, 1.0)))
    assert clean[0].verdict == Verdict.PASS


@pytest.mark.unit
def test_layer_groups_are_contiguous_and_small() -> None:
    from lora_parity.run.layer_coverage import groups, tag

    thirty = groups(list(range(30)))
    assert len(thirty) == 10 and all(len(g) == 3 for g in thirty) and [i for g in thirty for i in g] == list(range(30))
    eight = groups(list(range(28)))
    assert [i for g in eight for i in g] == list(range(28)) and {len(g) for g in eight} == {2, 3}
    assert groups([0, 1]) == [] and groups([0, 1, 2]) == []  # the per-target run covers them at that size
    assert tag("down_proj", [12, 13, 14]) == "down_proj@12-14"


@pytest.mark.cpu_e2e
def test_the_hf_trainer_restricted_to_some_layers_updates_only_them() -> None:
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import config, synthetic

    cfg = config.load(None)
    trainer = HFTrainer(cfg, synthetic.materialize(cfg), 0, {})
    assert trainer.layers() == [0, 1]
    with trainer.restricted_to([1]):
        trainer.perturb(0.05, 3, only="q_proj")
    moved = {n for n, p in trainer.model.named_parameters() if ".lora_B." in n and bool(p.any())}
    assert moved and all(".layers.1.self_attn.q_proj." in n for n in moved)
    trainer.zero_b()  # outside any restriction: every layer back to zero
    assert not any(bool(p.any()) for n, p in trainer.model.named_parameters() if ".lora_B." in n)


@pytest.mark.unit
def test_the_report_states_the_runs_detection_limit() -> None:
    from types import SimpleNamespace

    from lora_parity.report.facts import detection_limit

    ev = checks.evaluate(scenario(), BF16, errored=False)
    slope = next(c for c in ev.checks if c.id == "C.slope")
    line = detection_limit(SimpleNamespace(checks=ev.checks))  # type: ignore[arg-type]
    assert line is not None and f"a scale error of {100 * slope.budget:.1f} % or more" in line
    assert detection_limit(SimpleNamespace(checks=[c for c in ev.checks if c.id != "C.slope"])) is None  # type: ignore[arg-type]


@pytest.mark.unit
def test_every_check_records_how_many_elements_it_compared_and_none_passes_on_nothing() -> None:
    """Check.elements: the positions each check compared (a pooled slope: positions x its runs); a check handed
    an empty set is not run, never passed, and the verdict cannot be a pass."""
    ev, _ = judged(scenario())
    positions = sum(LENGTHS)
    by_id = {c.id: c for c in ev.checks}
    assert by_id["A.parity.max"].elements == by_id["C.parity.mean"].elements == positions
    assert by_id["X.sync.identical"].elements == by_id["T.q_proj.cosine"].elements == positions
    assert by_id["C.slope"].elements == positions * (1 + len(TARGETS))
    assert all(c.elements for c in ev.checks if c.status != CheckStatus.NOT_REACHED), \
        [c.id for c in ev.checks if not c.elements]
    c = checks._Checker()
    c.add("Z.empty", "a comparison over nothing", 0.0, "<=", 1.0, "differs", n=0)
    c.add("Z.some", "a comparison over one", 0.0, "<=", 1.0, "differs", n=1)
    empty, some = c.checks
    assert empty.status == CheckStatus.NOT_REACHED and "compared nothing" in empty.reason and empty.elements == 0
    assert some.status == CheckStatus.PASS and some.elements == 1
    assert checks.verdict_of(c.checks, errored=False) == Verdict.INCONCLUSIVE


@pytest.mark.unit
def test_the_side_is_named_over_all_tokens_too() -> None:
    """An engine that makes 60 % of every change is off the fp32 reference over all tokens, whatever the worst
    token shows: the finding names it there (the Qwen3 shape's `--update step` on the H200 read "both are off:
    precision" at its worst token while the engine was 2.6 times as far from fp32 on average)."""
    scores = scenario(scale=0.6)
    ev, _ = judged(scores)
    line = findings.findings(scores, ev.checks, sequences(), True)[0]
    overall = line.split("over all tokens", 1)[1]
    assert "(the engine is off" in overall, line
    off = scenario(trainer_off=0.3)
    line = findings.findings(off, judged(off)[0].checks, sequences(), True)[0]
    assert line.split("over all tokens", 1)[1].endswith("(the trainer is off)"), line


def _identical_sides(scores: dict[str, list[list[float]]], share: float = 1.0) -> dict[str, list[list[float]]]:
    """The sampler as the trainer's own implementation: the same scores at every point, its change at `share`."""
    out = dict(scores)
    out["zero"] = out["zero_repeat"] = out["base"] = out["stale"] = scores["trainer_zero"]

    def moved(to: str) -> list[list[float]]:
        return [[z + share * (u - z) for z, u in zip(zs, us, strict=True)]
                for zs, us in zip(scores["trainer_zero"], scores[to], strict=True)]

    out["updated"] = out["updated_repeat"] = out["fresh"] = moved("trainer_updated")
    for kind in TARGETS:
        out[f"target.{kind}.sampler"] = moved(f"target.{kind}.trainer")
    return out


def test_a_change_both_sides_compute_alike_passes_where_precision_leaves_fp32_undecided() -> None:
    """--sampler hf against the hf trainer (H200, random probes): both changes equal bit for bit, each further from
    the fp32 reference's than its own size. Against Δfp32 alone no direction can be claimed (inconclusive); against
    Δtrainer too (`delta_direct`) the checks pass. A sampler that makes half the change is never passed that way."""
    scores = _identical_sides(scenario(seed=3, size=0.15, trainer_off=0.25))
    ev, status = judged(scores)
    delta = ev.deltas["C.delta"]
    assert delta.direct_cosine == pytest.approx(1.0) and delta.trainer_rel_l2 > 1.0
    for check in ("C.delta.cosine", "C.delta.scale", "C.delta.rel_l2", "T.q_proj.cosine", "T.k_proj.scale"):
        assert status[check] == CheckStatus.PASS, check
    assert "against Δtrainer" in next(c.reason for c in ev.checks if c.id == "C.delta.cosine")
    assert ev.verdict == Verdict.PASS
    before = BF16.model_copy(update={"noise": BF16.noise.model_copy(update={"delta_direct": False})})
    _, old = judged(scores, before)
    assert old["C.delta.cosine"] == CheckStatus.INCONCLUSIVE and old["T.q_proj.cosine"] == CheckStatus.INCONCLUSIVE
    _, half = judged(_identical_sides(scenario(seed=3, size=0.15, trainer_off=0.25), share=0.5))
    assert half["C.delta.scale"] != CheckStatus.PASS and half["T.q_proj.scale"] != CheckStatus.PASS


@pytest.mark.unit
def test_reference_shares_name_the_side_that_misses_the_fp32_change() -> None:
    from lora_parity.verdict import deltas

    base = [[0.0, -1.0, -2.0, -1.5]]
    change = [[0.0, 0.4, -0.2, 0.3]]

    def moved(k: float) -> list[list[float]]:
        return [[b + k * c for b, c in zip(base[0], change[0], strict=True)]]

    scores = {"zero": base, "updated": moved(0.9), "trainer_zero": base, "trainer_updated": moved(1.0),
              "reference_fp32": base, "reference_fp32_updated": moved(1.0)}
    trainer, engine = deltas.reference_shares(scores) or (None, None)
    assert trainer == pytest.approx(1.0) and engine == pytest.approx(0.9)
    both = scores | {"trainer_updated": moved(0.9)}  # both sides make 0.9 of fp32's change: neither is named apart
    assert deltas.reference_shares(both) == pytest.approx((0.9, 0.9))
    assert deltas.reference_shares({k: v for k, v in scores.items() if k != "reference_fp32_updated"}) is None
    assert deltas.reference_shares(scores | {"reference_fp32_updated": base}) is None  # fp32 did not move
