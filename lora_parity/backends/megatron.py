"""The `megatron` trainer: a megatron-core `GPTModel` (local layer spec, no Transformer Engine) built
from an HF checkpoint, with the project's own tensor-parallel LoRA, exported in PEFT format.

Token alignment: `score` returns, for a sequence of n tokens, n - 1 values; entry t is
log p(tokens[t+1] | tokens[:t+1]), from the fp32 log-softmax of the logits at position t (the
logits gathered over the vocabulary shards). One sequence per forward.

LoRA: on `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, out = base(x) + alpha/r · B(A(x)),
with A = `adapter.linear_in` and B = `adapter.linear_out` (Megatron-Bridge's names and math). A is
drawn uniformly in ±1/sqrt(fan_in) (PEFT's bound), seeded by sha256 of the full A's name and the
run seed; B starts at zero. Column-parallel layers (qkv, fc1) hold A whole and shard B on its
output rows; row-parallel layers (proj, fc2) shard A on its input columns and hold B whole.
Every seeded tensor is drawn whole and then sharded, so TP=1 and TP=N hold the same adapter.

The perturbation is defined on the PEFT tensors the export writes: B's noise for q_proj, k_proj,
v_proj (gate_proj, up_proj) is drawn with the seed and shape the `hf` trainer uses for that name,
then interleaved into the fused B exactly as the base weights are. `perturb(only=kind)` changes
only that kind's rows. The export splits the fused B back (q/k/v by KV group; gate/up by halves of
each shard), repeats the shared A for each part, and gathers the shards, so the PEFT adapter is
mathematically the fused one.

Processes: at TP=1 the model lives in the calling process. At TP=N it lives in N rank processes
(gloo on the CPU, nccl on CUDA) that this process drives over a pipe to rank 0, which broadcasts
each command; under torchrun (`python -m lora_parity.backends.megatron` as the entry point), the
other ranks are torchrun's processes. The calling process never joins the trainer's process
group: the vLLM sampler beside it owns that process's default group. See the README.

Shape suffixes: _R rank r, _I input features, _O output features.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lora_parity import adapter_files as af
from lora_parity import errors
from lora_parity.backends import megatron_cpu
from lora_parity.backends.base import BackendOptions, BackendTraits, Scores, Sequences, TrainerBackend
from lora_parity.config import ModelConfig
from lora_parity.errors import ConfigError, PhaseError
from lora_parity.perturb import noise_seed
from lora_parity.receipt import BackendInfo, Perturbation

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    raise ModuleNotFoundError("No module named 'megatron.core'", name="megatron-core")

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
_PIPE_ENV = "LORA_PARITY_MEGATRON_PIPE"
_SPAWNED_ENV = "LORA_PARITY_MEGATRON_SPAWNED"
# Rank processes wait for rank 0's next command while the sampler works; a long wait is not an error.
_CONTROL_TIMEOUT = dt.timedelta(hours=6)


# --- The model's shape, from the HF config (pure) ---------------------------------------------


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
        arch = (hf.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"the megatron trainer supports {', '.join(SUPPORTED_ARCHITECTURES)}, not {arch}")
        for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                             ("use_sliding_window", False)):
            if hf.get(key, allowed) != allowed:
                raise ConfigError(f"the megatron trainer does not support {key}={hf[key]!r} (needs {allowed!r})")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"the megatron trainer supports default RoPE only, not {rope_type!r}")
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
            qk_norm=arch == "Qwen3ForCausalLM",
            max_positions=int(hf.get("max_position_embeddings", 4096)),
        )
        if shape.num_heads % shape.num_groups:
            raise ConfigError(f"{shape.num_heads} attention heads are not a multiple of {shape.num_groups} KV heads")
        for what, n in (("KV heads", shape.num_groups), ("intermediate_size", shape.ffn_hidden_size),
                        ("vocab_size", shape.vocab_size)):
            if n % tp:
                raise ConfigError(f"--tp {tp} does not divide {what} ({n})")
        return shape


def read_shape(model_dir: Path, tp: int) -> Shape:
    """The Shape of a checkpoint folder."""
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{model_dir}/config.json: unreadable: {e}") from None
    return Shape.from_hf(hf, tp)


# --- Module names and tensor-parallel layouts (pure tensor code) -------------------------------


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


def peft_name(layer: int, kind: str, part: str) -> str:
    """The PEFT tensor name vLLM loads, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.model.layers.{layer}.{MODULE_OF_KIND[kind].hf_block}.{kind}.{part}.weight"


def shard_fused(module: str, parts: dict[str, torch.Tensor], rank: int, tp: int, shape: Shape) -> torch.Tensor:
    """This rank's rows of a fused column-parallel tensor, from its whole HF parts (rows = outputs).

    linear_qkv interleaves by KV group: for each group its query heads, then its key head, then its
    value head; a rank holds a contiguous run of groups. linear_fc1 is gate then up on each rank:
    a rank holds its slice of gate, then the same slice of up."""
    if module == "linear_qkv":
        groups, d, p = shape.num_groups, shape.head_dim, shape.heads_per_group
        q, k, v = (parts[n].reshape(groups, -1, parts[n].shape[-1]) for n in ("q_proj", "k_proj", "v_proj"))
        assert q.shape[1] == p * d and k.shape[1] == d == v.shape[1]
        local = slice(rank * groups // tp, (rank + 1) * groups // tp)
        return torch.cat([q[local], k[local], v[local]], dim=1).reshape(-1, q.shape[-1])
    if module == "linear_fc1":
        return torch.cat([parts["gate_proj"].chunk(tp)[rank], parts["up_proj"].chunk(tp)[rank]])
    raise ValueError(f"{module} is not a fused column-parallel module")


def unshard_fused(module: str, shards: list[torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """The whole HF parts of a fused column-parallel tensor, from every rank's rows (inverse of `shard_fused`)."""
    tp = len(shards)
    if module == "linear_qkv":
        d, p = shape.head_dim, shape.heads_per_group
        grouped = [s.reshape(shape.num_groups // tp, (p + 2) * d, -1) for s in shards]
        cols = grouped[0].shape[-1]
        return {
            "q_proj": torch.cat([g[:, : p * d] for g in grouped]).reshape(-1, cols),
            "k_proj": torch.cat([g[:, p * d : (p + 1) * d] for g in grouped]).reshape(-1, cols),
            "v_proj": torch.cat([g[:, (p + 1) * d :] for g in grouped]).reshape(-1, cols),
        }
    if module == "linear_fc1":
        halves = [s.chunk(2) for s in shards]
        return {"gate_proj": torch.cat([h[0] for h in halves]), "up_proj": torch.cat([h[1] for h in halves])}
    raise ValueError(f"{module} is not a fused column-parallel module")


def hf_weight_plan(shape: Shape) -> list[tuple[str, str, tuple[str, ...]]]:
    """(megatron-core name, layout, HF names) for every base weight; layout is one of replicated,
    vocab (rows split), row (input columns split), linear_qkv or linear_fc1 (fused, `shard_fused`)."""
    plan: list[tuple[str, str, tuple[str, ...]]] = [
        ("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",))]
    for i in range(shape.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        plan += [
            (mc + "input_layernorm.weight", "replicated", (hf + "input_layernorm.weight",)),
            (mc + "self_attention.linear_qkv.weight", "linear_qkv",
             tuple(hf + f"self_attn.{k}.weight" for k in ("q_proj", "k_proj", "v_proj"))),
            (mc + "self_attention.linear_proj.weight", "row", (hf + "self_attn.o_proj.weight",)),
            (mc + "pre_mlp_layernorm.weight", "replicated", (hf + "post_attention_layernorm.weight",)),
            (mc + "mlp.linear_fc1.weight", "linear_fc1",
             tuple(hf + f"mlp.{k}.weight" for k in ("gate_proj", "up_proj"))),
            (mc + "mlp.linear_fc2.weight", "row", (hf + "mlp.down_proj.weight",)),
        ]
        if shape.qk_norm:
            plan += [(mc + "self_attention.q_layernorm.weight", "replicated", (hf + "self_attn.q_norm.weight",)),
                     (mc + "self_attention.k_layernorm.weight", "replicated", (hf + "self_attn.k_norm.weight",))]
    plan.append(("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)))
    if not shape.tied_embeddings:
        plan.append(("output_layer.weight", "vocab", ("lm_head.weight",)))
    return plan


def shard_weight(layout: str, hf_tensors: list[torch.Tensor], rank: int, tp: int, shape: Shape) -> torch.Tensor:
    """This rank's part of one base weight (see `hf_weight_plan`)."""
    if layout == "replicated":
        return hf_tensors[0]
    if layout == "vocab":
        return hf_tensors[0].chunk(tp, dim=0)[rank]
    if layout == "row":
        return hf_tensors[0].chunk(tp, dim=1)[rank]
    names = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}[layout]
    return shard_fused(layout, dict(zip(names, hf_tensors, strict=True)), rank, tp, shape)


# --- LoRA layers -------------------------------------------------------------------------------


class Adapter(torch.nn.Module):
    """A (`linear_in`, r x in) and B (`linear_out`, out x r) of one LoRA, as this rank holds them."""

    def __init__(self, in_features: int, out_features: int, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.linear_in = torch.nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.linear_out = torch.nn.Linear(rank, out_features, bias=False, dtype=dtype, device=device)


class LoRALinear(torch.nn.Module):
    """base(x) + alpha/r · B(A(x)) around a megatron-core Column/RowParallelLinear (`to_wrap`).

    Row-parallel: x is sharded on its features like A's columns, so A(x) is a partial sum, reduced
    over the tensor-parallel group before B (held whole) is applied. Column-parallel: x is whole,
    A is whole, B holds this rank's output rows, like the base layer's output."""

    def __init__(self, base: torch.nn.Module, column_parallel: bool, rank: int, alpha: float,
                 tp_group: Any, reduce: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.to_wrap = base
        weight: torch.Tensor = base.weight  # type: ignore[assignment]
        out_local, in_local = weight.shape
        self.adapter = Adapter(in_local, out_local, rank, weight.dtype, weight.device)
        self.column_parallel = column_parallel
        self.scaling = alpha / rank
        self._tp_group = tp_group
        self._reduce = reduce

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, bias = self.to_wrap(x, *args, **kwargs)
        h = self.adapter.linear_in(x)
        if not self.column_parallel:
            h = self._reduce(h, group=self._tp_group)
        # As PEFT: result + lora_B(lora_A(x)) * scaling.
        return out + self.adapter.linear_out(h) * self.scaling, bias


# --- One rank's model --------------------------------------------------------------------------


def _load_hf_tensors(model_dir: Path, names: set[str]) -> Callable[[str], torch.Tensor]:
    """A getter over the checkpoint's safetensors files (safetensors only; never pickles)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                where[k] = f
    missing = sorted(names - where.keys())
    if missing:
        raise ConfigError(f"{model_dir}: checkpoint lacks {missing[0]}" + (f" (+{len(missing) - 1} more)"
                                                                          if len(missing) > 1 else ""))
    extra = sorted(k for k in where if k not in names and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(f"{model_dir}: the megatron trainer would ignore {extra[0]}"
                          + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))

    def get(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name)

    return get


class Shard:
    """One tensor-parallel rank's GPTModel with LoRA. Every method is collective: all ranks call it
    with the same arguments (rank 0's answer is the one returned to the driver)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, tp: int = 1, control_group: Any = None) -> None:
        mcore = megatron_cpu.import_megatron()
        from megatron.core import parallel_state

        self._parallel_state = parallel_state
        self.owns_default_group = self.owns_parallel_state = False
        try:
            with megatron_cpu.quiet():
                self._build(cfg, model_dir, seed, tp, control_group)
        except BaseException:
            self._teardown()
            raise
        self.megatron_version = mcore.__version__

    def _build(self, cfg: ModelConfig, model_dir: Path, seed: int, tp: int, control_group: Any) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.cfg, self.seed = cfg, seed
        self.control_group = control_group
        if parallel_state.model_parallel_is_initialized():
            raise PhaseError("megatron-core's parallel state is already set up in this process: "
                             "one megatron trainer per process (close the other first)")
        if not dist.is_initialized():
            # In-process TP=1 without a sampler holding the default group (the hf sampler, tests).
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_default_group = True
        self.tp, self.rank = dist.get_world_size(), dist.get_rank()
        if self.tp != tp:
            raise PhaseError(f"this process's default process group has {self.tp} ranks, not the --tp {tp} "
                             "the trainer needs")
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() \
            else torch.device("cpu")
        self.shape = read_shape(model_dir, self.tp)
        self.dtype: torch.dtype = getattr(torch, cfg.model.dtype)
        self.targets = list(cfg.adapter.targets)
        unknown = [t for t in self.targets if t not in MODULE_OF_KIND]
        if unknown:
            raise ConfigError(f"the megatron trainer has no LoRA target {unknown[0]!r}; "
                              f"targets: {', '.join(MODULE_OF_KIND)}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        self.owns_parallel_state = True
        megatron_cpu.install_rng_tracker()
        s = self.shape
        config = TransformerConfig(
            num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
            num_attention_heads=s.num_heads, num_query_groups=s.num_groups, kv_channels=s.head_dim,
            normalization="RMSNorm", layernorm_epsilon=s.norm_eps, qk_layernorm=s.qk_norm,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, add_qkv_bias=False,
            hidden_dropout=0.0, attention_dropout=0.0,  # defaults are 0.1
            bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            tensor_model_parallel_size=self.tp, params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            use_cpu_initialization=self.device.type == "cpu", perform_initialization=False,
        )
        self.model = GPTModel(
            config, get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm"),
            vocab_size=s.vocab_size, max_sequence_length=s.max_positions, position_embedding_type="rope",
            rotary_base=s.rope_theta,  # type: ignore[arg-type,unused-ignore]  # a float works; hinted int
            share_embeddings_and_output_weights=s.tied_embeddings, parallel_output=True,
        ).to(self.device)
        # The local spec's torch norms are built without a dtype (fp32); Megatron's bf16/fp16
        # training runs the model under Float16Module, which casts every parameter to that dtype.
        for module in self.model.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.to(self.dtype)
        self._load_base(model_dir)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layers: list[dict[str, LoRALinear]] = []
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for i, layer in enumerate(self.model.decoder.layers):
            wrapped = {}
            for m in LORA_MODULES:
                if not any(k in self.targets for k in m.kinds):
                    continue
                parent = getattr(layer, m.block)
                lora = LoRALinear(getattr(parent, m.name), m.column_parallel, cfg.adapter.rank, cfg.adapter.alpha,
                                  tp_group, reduce_from_tensor_model_parallel_region)
                setattr(parent, m.name, lora)
                wrapped[m.name] = lora
                self._init_a(i, m, lora)
            self.layers.append(wrapped)
        self.model.eval()

    # Loading and initialisation.

    def _load_base(self, model_dir: Path) -> None:
        plan = hf_weight_plan(self.shape)
        get = _load_hf_tensors(model_dir, {n for _, _, names in plan for n in names})
        params = dict(self.model.named_parameters())
        expected = {n for n in params if not n.endswith("_extra_state")}
        planned = {name for name, _, _ in plan}
        if expected != planned:
            raise PhaseError(f"megatron-core parameters differ from the HF mapping: "
                             f"{sorted(expected ^ planned)[:3]}")
        with torch.no_grad():
            for name, layout, hf_names in plan:
                local = shard_weight(layout, [get(n) for n in hf_names], self.rank, self.tp, self.shape)
                if tuple(local.shape) != tuple(params[name].shape):
                    raise PhaseError(f"{name}: HF gives {tuple(local.shape)}, megatron-core holds "
                                     f"{tuple(params[name].shape)}")
                params[name].copy_(local.to(params[name].dtype))

    def _full_a_name(self, layer: int, module: LoraModule) -> str:
        return f"decoder.layers.{layer}.{module.block}.{module.name}.adapter.linear_in"

    @torch.no_grad()
    def _init_a(self, layer: int, module: LoraModule, lora: LoRALinear) -> None:
        a = lora.adapter.linear_in.weight
        fan_in = a.shape[1] * (1 if module.column_parallel else self.tp)
        generator = torch.Generator().manual_seed(noise_seed(self._full_a_name(layer, module), self.seed))
        bound = 1.0 / fan_in**0.5
        full_a = (torch.rand((a.shape[0], fan_in), generator=generator, dtype=torch.float32) * 2 - 1) * bound
        local = full_a if module.column_parallel else full_a.chunk(self.tp, dim=1)[self.rank]
        a.copy_(local.to(device=a.device, dtype=a.dtype))
        lora.adapter.linear_out.weight.zero_()

    # Collectives over the control group (CPU tensors, gloo).

    def _sum_over_ranks(self, value: int) -> int:
        if self.control_group is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, group=self.control_group)
        return int(t.item())

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        if self.control_group is None:
            return [local.detach().cpu()]
        import torch.distributed as dist

        local = local.detach().cpu().contiguous()
        out = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(out, local, group=self.control_group)
        return out

    # The Trainer operations.

    @torch.no_grad()
    def score(self, sequences: Sequences) -> Scores:
        """Entry t = log p(s[t+1] | s[:t+1]); one sequence per forward; fp32 log-softmax of the
        vocabulary-gathered logits."""
        out: Scores = []
        for seq in sequences:
            n = len(seq)
            ids = torch.tensor([seq], device=self.device)
            positions = torch.arange(n, device=self.device)[None]
            logits = self.model(ids, positions, megatron_cpu.causal_mask(n, self.device),
                                runtime_gather_output=True)
            logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(logprobs.cpu().tolist())
        return out

    def _noise(self, name: str, rows: int, std: float, seed: int) -> torch.Tensor:
        # Exactly the `hf` trainer's draw for the PEFT tensor `name`.
        generator = torch.Generator().manual_seed(noise_seed(name, seed))
        return torch.randn((rows, self.cfg.adapter.rank), generator=generator, dtype=torch.float32) * std

    @torch.no_grad()
    def perturb(self, std: float, seed: int, only: str | None = None) -> dict[str, Any]:
        """Add the seeded noise of each PEFT B tensor (or those of kind `only`) to this rank's B rows."""
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad and ".adapter." not in n]
        if self._sum_over_ranks(len(trainable)):
            raise PhaseError(f"refusing to perturb: non-adapter parameter {(trainable or ['?'])[0]} is trainable")
        kinds = [k for k in self.targets if only is None or k == only]
        if not kinds:
            raise PhaseError(f"no LoRA B tensors of {only} to perturb")
        updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        names: list[str] = []
        num_elements = 0
        nonzero = 0
        for i, wrapped in enumerate(self.layers):
            for m in LORA_MODULES:
                chosen = [k for k in m.kinds if k in kinds]
                if not chosen:
                    continue
                b = wrapped[m.name].adapter.linear_out.weight
                parts, masks = {}, {}
                for k in m.kinds:
                    rows = self.shape.out_features(k)
                    name = peft_name(i, k, "lora_B")
                    parts[k] = self._noise(name, rows, std, seed) if k in chosen else torch.zeros(rows, b.shape[1])
                    masks[k] = torch.full((rows, b.shape[1]), k in chosen)
                    if k in chosen:
                        names.append(name)
                        num_elements += rows * b.shape[1]
                if m.column_parallel:
                    noise = shard_fused(m.name, parts, self.rank, self.tp, self.shape)
                    mask = shard_fused(m.name, masks, self.rank, self.tp, self.shape)
                else:
                    noise, mask = parts[m.kinds[0]], masks[m.kinds[0]]
                mask = mask.to(b.device)
                nonzero += int(torch.count_nonzero(b[mask]).item())
                updates.append((b, noise, mask))
        if self._sum_over_ranks(nonzero):
            raise PhaseError("refusing to perturb: a LoRA B tensor is non-zero before the update")
        for b, noise, _ in updates:
            b.add_(noise.to(device=b.device, dtype=b.dtype))
        return Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=len(names),
                            num_elements=num_elements, tensors=names).model_dump(mode="json")

    @torch.no_grad()
    def zero_b(self) -> None:
        """Every B to zero, A unchanged."""
        for wrapped in self.layers:
            for lora in wrapped.values():
                lora.adapter.linear_out.weight.zero_()

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The whole PEFT tensors (gathered over ranks; every rank gets them)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, wrapped in enumerate(self.layers):
            for m in LORA_MODULES:
                if m.name not in wrapped:
                    continue
                a = wrapped[m.name].adapter.linear_in.weight
                b = wrapped[m.name].adapter.linear_out.weight
                if m.column_parallel:
                    whole_a = a.detach().cpu()
                    whole_b = unshard_fused(m.name, self._gather(b), self.shape) if len(m.kinds) > 1 \
                        else {m.kinds[0]: torch.cat(self._gather(b))}
                else:
                    whole_a = torch.cat(self._gather(a), dim=1)
                    whole_b = {m.kinds[0]: b.detach().cpu()}
                for k in m.kinds:
                    if k in self.targets:
                        # The fused layer's A is shared by its parts: each PEFT target gets a copy.
                        tensors[peft_name(i, k, "lora_A")] = whole_a.clone()
                        tensors[peft_name(i, k, "lora_B")] = whole_b[k].contiguous()
        return tensors

    def export(self, directory: str) -> str | None:
        """Write the PEFT adapter (rank 0); every rank takes part in the gather."""
        tensors = self.adapter_tensors()
        if self.rank != 0:
            return None
        dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        files = {n: af.Tensor(dtypes[t.dtype], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                 for n, t in tensors.items()}
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
            "r": self.cfg.adapter.rank, "lora_alpha": self.cfg.adapter.alpha, "lora_dropout": 0.0,
            "target_modules": sorted(self.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None,
        }
        af.write_adapter(Path(directory), config, files)
        return directory

    def describe(self) -> dict[str, Any]:
        """Versions and settings for the receipt."""
        settings: dict[str, Any] = {
            "dtype": self.cfg.model.dtype,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "architecture": self.shape.architecture,
            "layer_spec": "megatron-core local (no Transformer Engine)",
            "rank": self.cfg.adapter.rank, "alpha": self.cfg.adapter.alpha, "targets": self.targets,
            "dropout": 0.0,
            "module_map": MODULE_MAP,
            "adapter_params": "adapter.linear_in = lora_A, adapter.linear_out = lora_B",
            "lora_a_init": "uniform ±1/sqrt(fan_in), seeded by sha256(name, seed), drawn whole then sharded",
            "forward": "one sequence per forward, explicit causal mask, logits gathered over the vocabulary, "
                       "log-softmax in fp32",
        }
        if self.device.type == "cpu":
            settings["cpu_workarounds"] = ["inference rng tracker", "current_device -> cpu in trainer calls",
                                           "explicit causal mask", "gloo over loopback, cores / ranks threads"]
        return {"versions": {"torch": torch.__version__, "megatron-core": self.megatron_version},
                "settings": settings}

    def close(self) -> None:
        """Free the model and Megatron's process groups."""
        self.model = None
        self.layers = []
        self._teardown()

    def _teardown(self) -> None:
        import torch.distributed as dist

        if self.owns_parallel_state:
            self._parallel_state.destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_default_group = False


# --- The trainer: this process's side ----------------------------------------------------------


def _torchrun_world() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (or another env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


class MegatronTrainer(TrainerBackend):
    """megatron-core GPTModel with LoRA; TP=1 in this process, TP=N in N rank processes it drives."""

    traits = BackendTraits(supports_tp=True)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> MegatronTrainer:
        """Build the trainer with the run's tensor-parallel size."""
        assert model_dir is not None
        return cls(cfg, model_dir, options.seed, timings, tp=options.tp)

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, timings: dict[str, float], tp: int = 1) -> None:
        self.cfg, self.tp = cfg, tp
        start = time.perf_counter()
        read_shape(model_dir, tp)  # bad input fails here, before any process starts
        torchrun = _torchrun_world()
        if torchrun is not None and os.environ.get("RANK") != "0":
            raise ConfigError("under torchrun, launch `-m lora_parity.backends.megatron`: its rank 0 runs the "
                              "sequence, the other ranks serve the trainer")
        if torchrun is not None and torchrun != tp:
            raise ConfigError(f"--tp {tp}, but torchrun started {torchrun} processes: they must match")
        self.shard: Shard | None = None
        self.ranks: _RankProcesses | None = None
        request = {"config": cfg.model_dump(mode="json"), "model_dir": str(model_dir), "seed": seed}
        if tp == 1:
            self.layout = "in-process"
            with megatron_cpu.cpu_current_device():
                self.shard = Shard(cfg, Path(model_dir), seed)
            described = self.shard.describe()
        else:
            self.layout = "torchrun" if torchrun is not None else "spawned"
            self.ranks = _RankProcesses(tp, torchrun=torchrun is not None)
            try:
                described = self.ranks.call("init", request)
            except BaseException:
                self.ranks.close()
                raise
        self.described = described
        timings["trainer.load"] = time.perf_counter() - start

    def _call(self, method: str, **args: Any) -> Any:
        if self.ranks is not None:
            return self.ranks.call(method, args)
        assert self.shard is not None
        with megatron_cpu.cpu_current_device():
            return getattr(self.shard, method)(**args)

    def score(self, sequences: Sequences) -> Scores:
        """Entry t = log p(s[t+1] | s[:t+1]); len(s) - 1 values per sequence."""
        scores: Scores = self._call("score", sequences=sequences)
        return scores

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        """Seeded noise on every B (or kind `only`'s rows), seeded per PEFT tensor name."""
        return Perturbation.model_validate(self._call("perturb", std=std, seed=seed, only=only))

    def zero_b(self) -> None:
        """Every B to zero."""
        self._call("zero_b")

    def export_adapter(self, directory: Path) -> Path:
        """PEFT folder: fused tensors split, shards gathered, `base_model.model.` names."""
        self._call("export", directory=str(directory))
        return Path(directory)

    def info(self) -> BackendInfo:
        """Versions and settings, with the process layout."""
        settings = {**self.described["settings"], "tensor_parallel": self.tp, "processes": self.layout}
        return BackendInfo(backend="megatron", versions=self.described["versions"], settings=settings)

    def close(self) -> None:
        """Stop the rank processes, or free the in-process model."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.shard is not None:
            self.shard.close()
            self.shard = None


class _RankProcesses:
    """The trainer's N rank processes, driven over a pipe to rank 0, which broadcasts each command.

    Spawned: rank 0 starts first, opens the rendezvous store on a free port and reports it; ranks
    1..N-1 then start with it. Under torchrun, only rank 0 is started here (as a child of torchrun's
    rank 0, which runs the sequence and the sampler); the other ranks are torchrun's processes."""

    def __init__(self, world: int, torchrun: bool) -> None:
        self.logdir = Path(tempfile.mkdtemp(prefix="lora-parity-megatron-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = dict(os.environ)
        if not torchrun:
            env.update(megatron_cpu.rank_environment(world))
            env.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        _SPAWNED_ENV: "1"})
        try:
            self._start(0, {**env, _PIPE_ENV: f"{cmd_read},{reply_write}"}, (cmd_read, reply_write))
        finally:
            os.close(cmd_read)
            os.close(reply_write)
        self._to_rank0: BinaryIO = os.fdopen(cmd_write, "wb")
        self._from_rank0: BinaryIO = os.fdopen(reply_read, "rb")
        if not torchrun:
            port = self._reply()["port"]
            for rank in range(1, world):
                self._start(rank, {**env, "MASTER_PORT": str(port)}, ())

    def _start(self, rank: int, env: dict[str, str], fds: tuple[int, ...]) -> None:
        if _SPAWNED_ENV in env:
            env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(self.logdir / f"rank{rank}.log", "wb") as log:  # the child keeps its own copy
            self.procs.append(subprocess.Popen([sys.executable, "-m", "lora_parity.backends.megatron"], env=env,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               pass_fds=fds))

    def _log_tail(self, index: int) -> str:
        try:
            lines = (self.logdir / f"rank{index}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def _reply(self) -> dict[str, Any]:
        while True:
            ready, _, _ = select.select([self._from_rank0], [], [], 1.0)
            closed = False
            if ready:
                line = self._from_rank0.readline()
                if line:
                    reply: dict[str, Any] = json.loads(line)
                    return reply
                closed = True  # rank 0 closed its end: it is exiting
            for i, p in enumerate(self.procs):
                if p.poll() is not None or (closed and i == 0):
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    message = f"megatron rank {i} exited with code {p.returncode}: {self._log_tail(i)}"
                    self._stop()
                    raise PhaseError(message)

    def call(self, method: str, args: dict[str, Any]) -> Any:
        """Run `method` on every rank; rank 0's result, or its error raised here."""
        if not self.procs:
            raise PhaseError("the megatron rank processes are not running")
        self._to_rank0.write(json.dumps({"method": method, "args": args}).encode() + b"\n")
        self._to_rank0.flush()
        reply = self._reply()
        if "error" in reply:
            cls = getattr(errors, str(reply.get("class")), None)
            if isinstance(cls, type) and issubclass(cls, errors.LoraParityError):
                raise cls(reply["error"])
            raise PhaseError(f"megatron rank 0: {reply['error']}")
        return reply["ok"]

    def _stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        for f in (self._to_rank0, self._from_rank0):
            if f is not None:
                f.close()

    def close(self) -> None:
        """Ask every rank to exit, then make sure they have."""
        if self.procs:
            try:
                self._to_rank0.write(b'{"method": "close", "args": {}}\n')
                self._to_rank0.flush()
                for p in self.procs:
                    p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop()
        shutil.rmtree(self.logdir, ignore_errors=True)


# --- Rank processes ----------------------------------------------------------------------------

_METHODS = ("init", "score", "perturb", "zero_b", "export", "close")


def _broadcast(data: bytes, rank: int, group: Any) -> bytes:
    import torch.distributed as dist

    if group is None:
        return data
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return bytes(buf.numpy()) if rank != 0 else data


def serve() -> None:
    """A rank process: join the trainer's process group, then run rank 0's commands until "close"."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pipe = os.environ.get(_PIPE_ENV)
    to_driver: BinaryIO | None = None
    from_driver: BinaryIO | None = None
    if pipe:
        read_fd, write_fd = (int(x) for x in pipe.split(","))
        from_driver, to_driver = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")

    def reply(message: dict[str, Any]) -> None:
        if to_driver is not None:
            to_driver.write(json.dumps(message).encode() + b"\n")
            to_driver.flush()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    if os.environ.get(_SPAWNED_ENV):
        # Spawned on this host: rank 0 opens the store on a free port and reports it; the driver
        # then starts the other ranks with it (no port race).
        if rank == 0:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, is_master=True, wait_for_workers=False)
            reply({"port": store.port})
        else:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT) if world > 1 else None
    shard: Shard | None = None
    with megatron_cpu.cpu_current_device(), megatron_cpu.quiet():
        while True:
            line = b""
            if rank == 0:
                assert from_driver is not None
                line = from_driver.readline() or b'{"method": "close", "args": {}}'
            request = json.loads(_broadcast(line, rank, control))
            method, args = request.get("method"), request.get("args") or {}
            if method == "close" or method not in _METHODS:
                break
            try:
                if method == "init":
                    cfg = ModelConfig.model_validate(args["config"])
                    shard = Shard(cfg, Path(args["model_dir"]), int(args["seed"]), world, control)
                    result: Any = shard.describe()
                else:
                    assert shard is not None, "init first"
                    result = getattr(shard, method)(**args)
                reply({"ok": result})
            except Exception as e:  # reported to the driver, which raises it; the ranks stay in step
                message = str(e) if isinstance(e, errors.LoraParityError) else f"{type(e).__name__}: {e}"
                reply({"error": message, "class": type(e).__name__})
    if shard is not None:
        shard.close()
    dist.destroy_process_group()


def main() -> None:
    """`python -m lora_parity.backends.megatron`: a rank process, or, as torchrun's rank 0, the CLI."""
    if os.environ.get(_PIPE_ENV) or int(os.environ.get("RANK", "0")) != 0:
        serve()
    else:
        from lora_parity.cli import main as cli_main

        cli_main()


if __name__ == "__main__":
    main()
