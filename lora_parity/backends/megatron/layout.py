"""HF ↔ megatron-core names and tensor-parallel layouts: pure, importable without torch or megatron-core.

The layout math is row (or column) slices of whole HF tensors; `shard_fused`, `unshard_fused` and
`shard_weight` apply those slices to torch tensors (torch is imported only there), so the same
plans are unit-tested on plain lists.

linear_qkv interleaves by KV group: for each group its query heads, then its key head, then its
value head; a rank holds a contiguous run of groups. linear_fc1 is gate then up on each rank: a
rank holds its slice of gate, then the same slice of up. Row-parallel layers (proj, fc2) split
their input columns, and the vocabulary-parallel ones (embedding, output layer) their rows, in
rank order. An MoE model (Qwen3-MoE, TP=1 only) maps its router and each expert's gate/up/down whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
"""Routed experts in every layer (megatron-core's MoE layer: SequentialMLP experts, `experts`)."""
MLP_KINDS = ("gate_proj", "up_proj", "down_proj")
"""LoRA target kinds of the MLP: a dense model's, refused on an MoE model (its MLP is the experts)."""
_REQUIRED_SETTINGS = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("use_sliding_window", False))

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

RowSlice = tuple[str, int, int]
"""(HF part, first row, end row) of a whole HF tensor."""


# --- The model's shape, from the HF config --------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the megatron-core model needs from an HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    qk_norm: bool
    max_positions: int
    num_experts: int = 0
    """Routed experts per layer (0: a dense model)."""
    top_k: int = 0
    """Experts per token."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate size."""
    norm_topk_prob: bool = False
    """The top-k weights renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob)."""

    @property
    def moe(self) -> bool:
        """Whether every layer's MLP is routed experts."""
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_groups

    def out_features(self, kind: str) -> int:
        """Output rows of an HF projection."""
        return {
            "q_proj": self.num_heads * self.head_dim,
            "k_proj": self.num_groups * self.head_dim,
            "v_proj": self.num_groups * self.head_dim,
            "o_proj": self.hidden_size,
            "gate_proj": self.ffn_hidden_size,
            "up_proj": self.ffn_hidden_size,
            "down_proj": self.hidden_size,
        }[kind]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], tp: int) -> Shape:
        """Validate an HF config for this trainer at tensor-parallel size `tp`."""
        arch = _check_supported(hf)
        missing = [k for k in _REQUIRED_KEYS if not isinstance(hf.get(k), int) or hf[k] < 1]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)} (positive integers the megatron trainer needs)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        heads = int(hf["num_attention_heads"])
        shape = cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            max_positions=int(hf.get("max_position_embeddings", 4096)),
            **(_moe_fields(hf, tp) if arch in MOE_ARCHITECTURES else {}),
        )
        if shape.num_heads % shape.num_groups:
            raise ConfigError(f"{shape.num_heads} attention heads are not a multiple of {shape.num_groups} KV heads")
        for what, n in (("KV heads", shape.num_groups), ("intermediate_size", shape.ffn_hidden_size),
                        ("vocab_size", shape.vocab_size)):
            if n % tp:
                raise ConfigError(f"--tp {tp} does not divide {what} ({n}); pick a --tp that divides "
                                  f"{shape.num_heads} attention heads, {shape.num_groups} KV heads, "
                                  f"intermediate_size {shape.ffn_hidden_size} and vocab_size {shape.vocab_size}")
        return shape


def _moe_fields(hf: dict[str, Any], tp: int) -> dict[str, Any]:
    """The experts of a Qwen3-MoE config, after refusing what megatron-core's MoE layer here does not build:
    --tp above 1, a dense layer among the MoE ones (mlp_only_layers, decoder_sparse_step), shared experts."""
    if tp != 1:
        raise ConfigError(f"the megatron trainer runs MoE models at --tp 1 only, not --tp {tp}")
    given = {"num_experts": hf.get("num_experts", hf.get("num_local_experts")),
             "num_experts_per_tok": hf.get("num_experts_per_tok"),
             "moe_intermediate_size": hf.get("moe_intermediate_size")}
    missing = [k for k, v in given.items() if not isinstance(v, int) or v < 1]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)} (positive integers the megatron trainer needs)")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1 or hf.get("shared_expert_intermediate_size"):
        raise ConfigError("the megatron trainer supports MoE models with routed experts in every layer only "
                          "(mlp_only_layers empty, decoder_sparse_step 1, no shared expert)")
    return {"num_experts": given["num_experts"], "top_k": given["num_experts_per_tok"],
            "moe_ffn_hidden_size": given["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def check_targets(shape: Shape, targets: Sequence[str]) -> None:
    """On an MoE model LoRA goes on the attention projections only: its MLP is the routed experts."""
    mlp = [t for t in targets if t in MLP_KINDS]
    if shape.moe and mlp:
        raise ConfigError(f"the megatron trainer puts LoRA on an MoE model's attention only (q/k/v/o_proj), "
                          f"not on {mlp[0]} (its MLP is the routed experts)")


def _check_supported(hf: dict[str, Any]) -> str:
    """The architecture, after refusing any setting the local layer spec would compute differently."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"the megatron trainer supports {', '.join(SUPPORTED_ARCHITECTURES)}, not {arch}")
    for key, allowed in _REQUIRED_SETTINGS:
        if hf.get(key, allowed) != allowed:
            raise ConfigError(f"the megatron trainer does not support {key}={hf[key]!r} (needs {allowed!r})")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"the megatron trainer supports default RoPE only, not {rope_type!r}")
    return str(arch)


def read_shape(model_dir: Path, tp: int) -> Shape:
    """The Shape of a checkpoint folder."""
    hf = safe_read.read_json(Path(model_dir) / "config.json")
    if not isinstance(hf, dict):
        raise ConfigError(f"{model_dir}/config.json: not a JSON object")
    return Shape.from_hf(hf, tp)


# --- Module names ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraModule:
    """A megatron-core linear layer that carries LoRA, and the PEFT target kinds it stands for."""

    name: str
    block: str
    """Its parent in a megatron layer: self_attention or mlp."""
    hf_block: str
    """The HF parent: self_attn or mlp."""
    column_parallel: bool
    """Column-parallel (output sharded) or row-parallel (input sharded)."""
    kinds: tuple[str, ...]


LORA_MODULES = (
    LoraModule("linear_qkv", "self_attention", "self_attn", True, ("q_proj", "k_proj", "v_proj")),
    LoraModule("linear_proj", "self_attention", "self_attn", False, ("o_proj",)),
    LoraModule("linear_fc1", "mlp", "mlp", True, ("gate_proj", "up_proj")),
    LoraModule("linear_fc2", "mlp", "mlp", False, ("down_proj",)),
)
MODULE_OF_KIND = {kind: m for m in LORA_MODULES for kind in m.kinds}
MODULE_MAP = [f"{m.name} -> {','.join(m.kinds)}" for m in LORA_MODULES]
FUSED_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}


def peft_name(layer: int, kind: str, part: str) -> str:
    """The PEFT tensor name vLLM loads, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.model.layers.{layer}.{MODULE_OF_KIND[kind].hf_block}.{kind}.{part}.weight"


def full_a_name(layer: int, module: LoraModule) -> str:
    """The megatron-core name of a whole LoRA A, whose sha256 seeds its draw."""
    return f"decoder.layers.{layer}.{module.block}.{module.name}.adapter.linear_in"


def hf_weight_plan(shape: Shape) -> list[tuple[str, str, tuple[str, ...]]]:
    """(megatron-core name, layout, HF names) for every base weight; layout is one of replicated,
    vocab (rows split), row (input columns split), linear_qkv or linear_fc1 (fused, `fused_rows`), or
    expert_fc1 (an MoE expert's gate and up, whole)."""
    plan: list[tuple[str, str, tuple[str, ...]]] = [
        ("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",))]
    for i in range(shape.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        plan += [
            (mc + "input_layernorm.weight", "replicated", (hf + "input_layernorm.weight",)),
            (mc + "self_attention.linear_qkv.weight", "linear_qkv",
             tuple(hf + f"self_attn.{k}.weight" for k in FUSED_PARTS["linear_qkv"])),
            (mc + "self_attention.linear_proj.weight", "row", (hf + "self_attn.o_proj.weight",)),
            (mc + "pre_mlp_layernorm.weight", "replicated", (hf + "post_attention_layernorm.weight",)),
        ]
        plan += _expert_plan(shape, hf, mc) if shape.moe else [
            (mc + "mlp.linear_fc1.weight", "linear_fc1",
             tuple(hf + f"mlp.{k}.weight" for k in FUSED_PARTS["linear_fc1"])),
            (mc + "mlp.linear_fc2.weight", "row", (hf + "mlp.down_proj.weight",)),
        ]
        if shape.qk_norm:
            plan += [(mc + "self_attention.q_layernorm.weight", "replicated", (hf + "self_attn.q_norm.weight",)),
                     (mc + "self_attention.k_layernorm.weight", "replicated", (hf + "self_attn.k_norm.weight",))]
    plan.append(("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)))
    if not shape.tied_embeddings:
        plan.append(("output_layer.weight", "vocab", ("lm_head.weight",)))
    return plan


def _expert_plan(shape: Shape, hf: str, mc: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """One MoE layer: the router (HF `mlp.gate`), then each expert's fc1 (gate rows, then up rows: layout
    `expert_fc1`, whole at --tp 1) and fc2, from the per-expert names Qwen3-MoE checkpoints hold on disk."""
    plan: list[tuple[str, str, tuple[str, ...]]] = [(mc + "mlp.router.weight", "replicated", (hf + "mlp.gate.weight",))]
    for e in range(shape.num_experts):
        theirs, ours = f"{hf}mlp.experts.{e}.", f"{mc}mlp.experts.local_experts.{e}."
        plan += [(ours + "linear_fc1.weight", "expert_fc1", (theirs + "gate_proj.weight", theirs + "up_proj.weight")),
                 (ours + "linear_fc2.weight", "replicated", (theirs + "down_proj.weight",))]
    return plan


# --- Tensor-parallel slices (pure) ----------------------------------------------------------------


def tp_slice(size: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s part of `size` rows or columns split over `tp` ranks, as
    `torch.chunk` splits them (B rows of column-parallel layers, A columns of row-parallel ones,
    vocabulary rows)."""
    step = -(-size // tp)
    start = min(rank * step, size)
    return start, min(start + step, size)


def fused_rows(module: str, rank: int, tp: int, shape: Shape) -> list[RowSlice]:
    """The HF row slices that make up this rank's rows of a fused column-parallel tensor, in order."""
    if module == "linear_qkv":
        d, p = shape.head_dim, shape.heads_per_group
        first, last = tp_slice(shape.num_groups, rank, tp)
        rows: list[RowSlice] = []
        for g in range(first, last):
            rows += [("q_proj", g * p * d, (g + 1) * p * d), ("k_proj", g * d, (g + 1) * d),
                     ("v_proj", g * d, (g + 1) * d)]
        return rows
    if module == "linear_fc1":
        start, stop = tp_slice(shape.ffn_hidden_size, rank, tp)
        return [("gate_proj", start, stop), ("up_proj", start, stop)]
    raise ValueError(f"{module} is not a fused column-parallel module")


def unfused_rows(module: str, tp: int, shape: Shape) -> dict[str, list[tuple[int, int, int]]]:
    """For each HF part of a fused tensor, the (rank, first local row, end local row) slices of the
    ranks' shards that make it up, in HF row order (inverse of `fused_rows`)."""
    placed: dict[str, list[tuple[int, int, int, int]]] = {k: [] for k in FUSED_PARTS[module]}
    for rank in range(tp):
        offset = 0
        for kind, start, stop in fused_rows(module, rank, tp, shape):
            placed[kind].append((start, rank, offset, offset + stop - start))
            offset += stop - start
    return {kind: [(rank, a, b) for _, rank, a, b in sorted(slices)] for kind, slices in placed.items()}


def take_rows(parts: Mapping[str, Sequence[Any]], rows: list[RowSlice]) -> list[Any]:
    """The rows of `parts` named by `rows`, concatenated (plain sequences; for tests and checks)."""
    return [row for kind, start, stop in rows for row in parts[kind][start:stop]]


# --- The slices applied to torch tensors ----------------------------------------------------------


def shard_fused(module: str, parts: dict[str, torch.Tensor], rank: int, tp: int, shape: Shape) -> torch.Tensor:
    """This rank's rows of a fused column-parallel tensor, from its whole HF parts (rows = outputs)."""
    import torch

    return torch.cat([parts[kind][start:stop] for kind, start, stop in fused_rows(module, rank, tp, shape)])


def unshard_fused(module: str, shards: list[torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """The whole HF parts of a fused column-parallel tensor, from every rank's rows (inverse of `shard_fused`)."""
    import torch

    return {kind: torch.cat([shards[rank][a:b] for rank, a, b in slices])
            for kind, slices in unfused_rows(module, len(shards), shape).items()}


def shard_weight(layout: str, hf_tensors: list[torch.Tensor], rank: int, tp: int, shape: Shape) -> torch.Tensor:
    """This rank's part of one base weight (see `hf_weight_plan`)."""
    if layout == "replicated":
        return hf_tensors[0]
    if layout == "expert_fc1":  # MoE models run at --tp 1: gate rows, then up rows
        import torch

        return torch.cat(hf_tensors)
    if layout == "vocab":
        start, stop = tp_slice(hf_tensors[0].shape[0], rank, tp)
        return hf_tensors[0][start:stop]
    if layout == "row":
        start, stop = tp_slice(hf_tensors[0].shape[1], rank, tp)
        return hf_tensors[0][:, start:stop]
    return shard_fused(layout, dict(zip(FUSED_PARTS[layout], hf_tensors, strict=True)), rank, tp, shape)
