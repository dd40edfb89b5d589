"""The megatron trainer on Qwen3-MoE (tiny-qwen3-moe, fp32): megatron-core's MoE layer built from the HF
checkpoint, what it refuses, and route replay through megatron-core's router replay against the HF trainer's.

Cost on a 2-core CPU: the shape checks take nothing (they read the generated config.json); each in-process pair
of trainers about two seconds; the CLI runs (megatron trainer, hf sampler: route replay off and on, and the
route faults) about six seconds each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lora_parity.evidence import receipt as rc
from lora_parity.models import config, synthetic
from lora_parity.run.moe_faults import ROUTE_FAULT_NAMES
from lora_parity.util.errors import ConfigError, PhaseError

from .conftest import cli
from .test_megatron import requires_megatron

pytestmark = pytest.mark.megatron

HF_TOLERANCE = 1e-5
"""Megatron vs HF trainer scores, max |Δ| per token, fp32 (measured about 6e-6 on the logits)."""
SEQUENCES = [[3, 17, 250, 9, 9, 400, 511, 0, 1, 42, 77, 300], list(range(100, 165))]


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def _hf_config() -> dict[str, Any]:
    return json.loads((synthetic.materialize(config.load("tiny-qwen3-moe")) / "config.json").read_text())


# --- The shape and what it refuses (pure) ----------------------------------------------------------


@requires_megatron
def test_qwen3_moe_shape_and_weight_plan() -> None:
    from lora_parity.backends.megatron.layout import Shape, hf_weight_plan

    shape = Shape.from_hf(_hf_config(), 1)
    assert (shape.num_experts, shape.top_k, shape.moe_ffn_hidden_size, shape.norm_topk_prob) == (8, 2, 64, True)
    assert shape.qk_norm and shape.moe
    plan = {name: (layout, hf) for name, layout, hf in hf_weight_plan(shape)}
    assert plan["decoder.layers.1.mlp.router.weight"] == ("replicated", ("model.layers.1.mlp.gate.weight",))
    assert plan["decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"] == (
        "expert_fc1", ("model.layers.0.mlp.experts.7.gate_proj.weight", "model.layers.0.mlp.experts.7.up_proj.weight"))
    assert plan["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"] == (
        "replicated", ("model.layers.0.mlp.experts.3.down_proj.weight",))
    assert not any(".mlp.linear_fc" in name for name in plan)  # no dense MLP
    assert len(plan) == 1 + 2 * (4 + 2 + 1 + 2 * 8) + 2


@requires_megatron
@pytest.mark.parametrize(("change", "tp", "message"), [
    ({}, 2, "runs MoE models at --tp 1 only, not --tp 2"),
    ({"mlp_only_layers": [0]}, 1, "routed experts in every layer only"),
    ({"decoder_sparse_step": 2}, 1, "routed experts in every layer only"),
    ({"num_experts_per_tok": None}, 1, "lacks num_experts_per_tok"),
])
def test_moe_settings_it_cannot_build_are_one_line_config_errors(change: dict[str, Any], tp: int,
                                                                 message: str) -> None:
    from lora_parity.backends.megatron.layout import Shape

    with pytest.raises(ConfigError, match=message) as e:
        Shape.from_hf({**_hf_config(), **change}, tp)
    assert "\n" not in str(e.value)


@requires_megatron
def test_lora_on_the_experts_is_refused_on_moe_only() -> None:
    from lora_parity.backends.megatron.layout import Shape, check_targets

    moe = Shape.from_hf(_hf_config(), 1)
    check_targets(moe, ["q_proj", "k_proj", "v_proj", "o_proj"])
    for target in ("gate_proj", "up_proj", "down_proj"):
        with pytest.raises(ConfigError, match=f"attention only .*not on {target}"):
            check_targets(moe, ["q_proj", target])
    dense = Shape.from_hf(json.loads((synthetic.materialize(config.load(None)) / "config.json").read_text()), 1)
    check_targets(dense, ["q_proj", "gate_proj", "down_proj"])


@requires_megatron
def test_tp2_on_moe_is_refused_at_preflight_in_one_line() -> None:
    res = cli("run", "--model", "tiny-qwen3-moe", "--trainer", "megatron", "--sampler", "hf", "--tp", "2")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "runs MoE models at --tp 1 only" in res.stderr


# --- In-process trainers (fp32) --------------------------------------------------------------------


@pytest.fixture
def trainers() -> Any:
    """Both trainers in this process, closed after each test (one megatron trainer per process: the selftest
    below builds its own)."""
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    cfg = config.load("tiny-qwen3-moe")
    model_dir = synthetic.materialize(cfg)
    hf = HFTrainer(cfg, model_dir, 0, {})
    mg = MegatronTrainer(cfg, model_dir, 0, {})
    yield mg, hf
    mg.close()
    hf.close()


def _other_experts(routes: list[Any], shift: int) -> list[Any]:
    """Every token's experts moved by `shift` (mod 8): a set the routers would not choose."""
    return [[[sorted((e + shift) % 8 for e in layer) for layer in token] for token in seq] for seq in routes]


@requires_megatron
def test_zero_adapter_scores_and_own_routes_match_the_hf_trainer(trainers: Any) -> None:
    mg, hf = trainers
    assert _max_abs_diff(mg.score(SEQUENCES), hf.score(SEQUENCES)) <= HF_TOLERANCE
    own = mg.router_topk(SEQUENCES)
    assert own == hf.router_topk(SEQUENCES)
    assert [len(r) for r in own] == [len(s) for s in SEQUENCES] and len(own[0][0]) == 2 and len(own[0][0][0]) == 2
    assert mg.moe_layers() == hf.moe_layers() == 2
    info = mg.info().settings
    assert info["architecture"] == "Qwen3MoeForCausalLM" and info["moe_experts"] == 8
    assert "norm_topk_prob=True" in mg.replayed_weights()


@requires_megatron
def test_replayed_routes_change_the_scores_as_the_hf_trainers_do(trainers: Any) -> None:
    mg, hf = trainers
    own = mg.router_topk(SEQUENCES)
    before = mg.score(SEQUENCES)
    with mg.replaying(dict(zip(map(tuple, SEQUENCES), own, strict=True))):
        assert mg.score(SEQUENCES) == before  # the routers' own choice, replayed: bit for bit
    for shift in (1, 3):
        table = dict(zip(map(tuple, SEQUENCES), _other_experts(own, shift), strict=True))
        with mg.replaying(table):
            ours = mg.score(SEQUENCES)
            assert mg.router_topk(SEQUENCES) == own  # the routers' own choice is still theirs
        with hf.replaying(table):
            theirs = hf.score(SEQUENCES)
        assert _max_abs_diff(ours, before) > 0.1  # the other experts moved the scores...
        assert _max_abs_diff(ours, theirs) <= HF_TOLERANCE  # ...as they move the HF trainer's
    assert mg.score(SEQUENCES) == before  # replay ends with the block


@requires_megatron
def test_replay_refuses_a_sequence_without_routes_or_routes_of_another_shape(trainers: Any) -> None:
    mg, _ = trainers
    own = mg.router_topk(SEQUENCES)
    with mg.replaying({tuple(SEQUENCES[0]): own[0]}), pytest.raises(PhaseError, match="no routes for this sequence"):
        mg.score(SEQUENCES)
    bad = [[layers[:1] for layers in token] for token in own[0]]
    with mg.replaying({tuple(SEQUENCES[0]): bad}), pytest.raises(PhaseError, match="routes of shape"):
        mg.score(SEQUENCES[:1])
    twice = [[[e[0], e[0]] for e in token] for token in own[0]]
    with mg.replaying({tuple(SEQUENCES[0]): twice}), pytest.raises(PhaseError, match="the same expert twice"):
        mg.score(SEQUENCES[:1])


# --- The CLI -----------------------------------------------------------------------------------------


@requires_megatron
@pytest.mark.parametrize(("mode", "update"), [("off", "noise"), ("on", "noise"), ("on", "step")])
def test_megatron_against_hf_on_tiny_qwen3_moe_passes(tmp_path: Path, mode: str, update: str) -> None:
    out = tmp_path / "r.json"
    res = cli("run", "--model", "tiny-qwen3-moe", "--trainer", "megatron", "--sampler", "hf",
              "--route-replay", mode, "--update", update, "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    receipt = rc.load(out)[0]
    assert receipt.verdict == rc.Verdict.PASS and receipt.route_replay is not None
    assert receipt.route_replay.status == ("replayed" if mode == "on" else "off")
    assert receipt.comparisons["A.trainer_vs_sampler"].max_abs <= receipt.budgets.max
    if update == "step":  # the AdamW step's forwards replayed the start point's routes
        assert receipt.perturbation is not None and receipt.perturbation.kind == "optimizer_step"
        assert receipt.route_replay.sources["perturb"] == "zero"


@requires_megatron
def test_route_faults_are_caught_with_the_megatron_trainer(tmp_path: Path) -> None:
    # A process of its own, as a user runs it (megatron-core keeps one parallel state per process).
    res = cli("selftest", "--model", "tiny-qwen3-moe", "--trainer", "megatron", "--sampler", "hf", "--no-per-target",
              "--faults", ",".join(ROUTE_FAULT_NAMES), "--out-dir", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    result = json.loads(res.stdout)
    assert result["ok"] and [r["fault"] for r in result["rows"]] == ["none", *ROUTE_FAULT_NAMES]
    assert all(r["caught"] for r in result["rows"])
