"""The Megatron backend's pure layout and protocol (no torch, no megatron-core): the fused qkv and
fc1 layouts, the tensor-parallel splits and their gathers, the HF weight plan, config validation,
and the driver ↔ rank 0 reply handling. Rows are labelled ("q", i) so every check is exact."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from lora_parity.backends.megatron import protocol
from lora_parity.backends.megatron.layout import (
    MODULE_MAP,
    Shape,
    fused_rows,
    hf_weight_plan,
    peft_name,
    take_rows,
    tp_slice,
    unfused_rows,
)
from lora_parity.util.errors import ConfigError, PhaseError

pytestmark = pytest.mark.unit

# 4 query heads in 2 KV groups of head_dim 2; intermediate 6.
SHAPE = Shape("Qwen3ForCausalLM", 64, 8, 6, 2, num_heads=4, num_groups=2, head_dim=2, norm_eps=1e-6,
              rope_theta=1e4, tied_embeddings=False, qk_norm=True, max_positions=64)
WIDE = Shape("LlamaForCausalLM", 64, 16, 8, 1, num_heads=8, num_groups=4, head_dim=2, norm_eps=1e-6,
             rope_theta=1e4, tied_embeddings=True, qk_norm=False, max_positions=64)


def _labelled(shape: Shape, kinds: tuple[str, ...]) -> dict[str, list[tuple[str, int]]]:
    return {k: [(k, i) for i in range(shape.out_features(k))] for k in kinds}


QKV = ("q_proj", "k_proj", "v_proj")
FC1 = ("gate_proj", "up_proj")


def _unshard(module: str, shards: list[list[Any]], shape: Shape) -> dict[str, list[Any]]:
    plan = unfused_rows(module, len(shards), shape)
    return {k: [row for rank, a, b in slices for row in shards[rank][a:b]] for k, slices in plan.items()}


def test_qkv_interleaves_each_groups_query_heads_then_its_key_then_its_value() -> None:
    parts = _labelled(SHAPE, QKV)
    fused = take_rows(parts, fused_rows("linear_qkv", 0, 1, SHAPE))
    q, k, v = parts["q_proj"], parts["k_proj"], parts["v_proj"]
    assert fused == q[:4] + k[:2] + v[:2] + q[4:] + k[2:] + v[2:]


@pytest.mark.parametrize("shape", [SHAPE, WIDE], ids=["2-groups", "4-groups"])
@pytest.mark.parametrize(("module", "kinds"), [("linear_qkv", QKV), ("linear_fc1", FC1)])
def test_tp_shards_in_rank_order_and_round_trip(shape: Shape, module: str, kinds: tuple[str, ...]) -> None:
    parts = _labelled(shape, kinds)
    whole = take_rows(parts, fused_rows(module, 0, 1, shape))
    for tp in (1, 2):
        shards = [take_rows(parts, fused_rows(module, r, tp, shape)) for r in range(tp)]
        assert all(len(s) == len(whole) // tp for s in shards)
        assert _unshard(module, shards, shape) == parts
        if module == "linear_qkv":
            # A rank holds whole KV groups, so the shards in rank order are the TP=1 rows.
            assert [row for s in shards for row in s] == whole


def test_fc1_holds_its_slice_of_gate_then_the_same_slice_of_up() -> None:
    parts = _labelled(SHAPE, FC1)
    assert take_rows(parts, fused_rows("linear_fc1", 0, 1, SHAPE)) == parts["gate_proj"] + parts["up_proj"]
    rank1 = take_rows(parts, fused_rows("linear_fc1", 1, 2, SHAPE))
    assert rank1 == parts["gate_proj"][3:] + parts["up_proj"][3:]


def test_qkv_at_tp2_gives_each_rank_one_group() -> None:
    rows = fused_rows("linear_qkv", 1, 2, SHAPE)
    assert rows == [("q_proj", 4, 8), ("k_proj", 2, 4), ("v_proj", 2, 4)]


@pytest.mark.parametrize(("size", "tp"), [(8, 1), (8, 2), (12, 4), (6, 3)])
def test_tp_slices_split_b_rows_and_a_columns_and_gather_back(size: int, tp: int) -> None:
    # B rows of a column-parallel layer, A columns of a row-parallel one: equal, contiguous, in rank order.
    slices = [tp_slice(size, r, tp) for r in range(tp)]
    assert all(stop - start == size // tp for start, stop in slices)
    gathered = [i for start, stop in slices for i in range(size)[start:stop]]
    assert gathered == list(range(size))


def test_tp_slice_matches_torch_chunk_when_uneven() -> None:
    # torch.chunk(5, 2) gives 3 then 2 rows.
    assert [tp_slice(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]


def test_an_unfused_module_is_refused() -> None:
    with pytest.raises(ValueError, match="linear_proj is not a fused"):
        fused_rows("linear_proj", 0, 1, SHAPE)


def test_hf_weight_plan_maps_every_weight_once() -> None:
    plan = hf_weight_plan(SHAPE)
    megatron_names = [name for name, _, _ in plan]
    hf_names = [n for _, _, names in plan for n in names]
    assert len(set(megatron_names)) == len(megatron_names) and len(set(hf_names)) == len(hf_names)
    # Per layer: 2 norms, qkv (3 HF), proj, fc1 (2 HF), fc2, q/k norms; plus embedding, final norm, lm_head.
    assert len(hf_names) == 2 * (2 + 3 + 1 + 2 + 1 + 2) + 3
    layouts = dict((name, layout) for name, layout, _ in plan)
    assert layouts["decoder.layers.1.self_attention.linear_qkv.weight"] == "linear_qkv"
    assert layouts["decoder.layers.0.mlp.linear_fc2.weight"] == "row"
    assert layouts["output_layer.weight"] == "vocab"
    tied = [name for name, _, _ in hf_weight_plan(WIDE)]
    assert "output_layer.weight" not in tied and not any("q_layernorm" in n for n in tied)


def test_peft_names_and_module_map() -> None:
    assert peft_name(3, "k_proj", "lora_B") == "base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"
    assert peft_name(0, "up_proj", "lora_A") == "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    assert MODULE_MAP[0] == "linear_qkv -> q_proj,k_proj,v_proj"


HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 8, "intermediate_size": 6,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
             "max_position_embeddings": 64, "rope_theta": 1e4}


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["MistralForCausalLM"]}, "supports Qwen3ForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "linear"}}, "default RoPE only"),
    ({"num_key_value_heads": 3}, "not a multiple of 3 KV heads"),
    ({"num_key_value_heads": 1}, "does not divide KV heads"),
    ({"intermediate_size": 7}, "does not divide intermediate_size"),
])
def test_config_validation(change: dict[str, Any], message: str) -> None:
    assert Shape.from_hf(HF_CONFIG, 2) == SHAPE
    with pytest.raises(ConfigError, match=message):
        Shape.from_hf({**HF_CONFIG, **change}, 2)


def test_replies_raise_the_projects_errors_as_themselves_and_others_as_phase_errors() -> None:
    assert protocol.result({"ok": [1.5]}) == [1.5]
    with pytest.raises(ConfigError, match=r"^bad target$"):
        protocol.result(protocol.error_reply(ConfigError("bad target")))
    with pytest.raises(PhaseError, match="megatron rank 0: KeyError: 'x'"):
        protocol.result(protocol.error_reply(KeyError("x")))
    with pytest.raises(PhaseError, match="megatron rank 0: boom"):
        protocol.result({"error": "boom", "class": "Exception"})  # not one of the project's classes


def test_rank_processes_are_told_apart_from_torchruns_rank_0() -> None:
    assert not protocol.is_rank_process({})
    assert not protocol.is_rank_process({"RANK": "0", "WORLD_SIZE": "2"})
    assert protocol.is_rank_process({"RANK": "1", "WORLD_SIZE": "2"})
    assert protocol.is_rank_process({"RANK": "0", protocol.PIPE_ENV: "3,4"})


def test_layout_protocol_and_launch_import_without_torch_or_megatron() -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'megatron'): raise ModuleNotFoundError(name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lora_parity.backends.megatron.layout, lora_parity.backends.megatron.protocol, lora_parity.launch\n"
        "assert not any(m.split('.')[0] in ('torch', 'megatron') for m in sys.modules)\n"
        "assert 'lora_parity.cli' not in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_the_megatron_backend_imports_neither_the_cli_nor_the_runner() -> None:
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "lora_parity" / "backends" / "megatron"
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for upward in ("lora_parity.cli", "lora_parity.run.runner", "from lora_parity import cli",
                       "from lora_parity.run import runner"):
            assert upward not in text, f"{path.name} imports {upward}"


def test_the_old_entry_point_names_the_new_one_in_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "lora_parity.backends.megatron", "run"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: torchrun's entry point is now `-m lora_parity.launch` (this backend's rank processes "
        "run `-m lora_parity.backends.megatron.serve`)"]
