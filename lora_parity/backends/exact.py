"""The `exact` trainer (issue 29): HF + PEFT holds, loads and updates the adapter as the `hf` trainer
does, but scores through vLLM's own operations, so that on the GPU its logprobs equal the `vllm`
sampler's bit for bit (docs/verdicts.md, "The exact trainer").

`exact_forward` runs the trainer's weights through vLLM's functions in vLLM's order, as the engine runs
one step of prompts in eager, batch-invariant mode (vLLM 0.26 on CUDA): its batch-invariant RMSNorm
(first norm, Qwen3's q/k norms) and fused add-RMSNorm, its batch-invariant GEMM, its LoRA shrink and
expand kernels with the adapter as vLLM holds it (cast to the model's dtype, B times alpha/r rounded
there, padded to max_lora_rank, the merged q/k/v and gate/up slices side by side), its rotary kernel with
the cos/sin cache built as vLLM builds it, FlashAttention 3 on a paged KV cache with one split, its
SiLU-and-mul and its prompt-logprob kernel. The sampler's groups (`vllm_options.packing`) are each packed into one
forward, as the sampler's one generate call packs them into one step (the shrink kernel's tiling depends
on the step's token count).

Measured (scripts/exact-ops.py, H200): 100 % of tokens bitwise equal to the engine's, where HF+PEFT's own
forward matches 1.6 %. There is no backward through these kernels: the update (noise, or a step through
PEFT's autograd) is the `hf` trainer's, and only the scoring is exact. Llama and Qwen3 (dense, SiLU,
default rotary) in bf16 or fp16 on CUDA; anything else is refused at start, in one line (another sampler and
the merged sync modes before any import: `backends.MIRRORS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_parity.backends.base import BackendOptions, Scores, Sequences, groups
from lora_parity.backends.hf import HFTrainer, versions
from lora_parity.backends.vllm_options import max_lora_rank, packing
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models.config import ModelConfig
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
"""The model definitions `exact_forward` follows (vLLM's llama.py and qwen3.py, dense, no bias)."""
FORWARD = ("vLLM's ops (batch-invariant GEMM and RMSNorm, LoRA shrink/expand kernels, rotary, FA3 paged with "
           "one split, compute_token_logprobs), {grouping}")


def unsupported(cfg: ModelConfig, model_dir: Path, cuda: bool, batch_invariant: bool) -> str | None:
    """Why the exact trainer cannot mirror the `vllm` sampler for this run, or None."""
    if not cuda:
        return "it needs CUDA (vLLM's batch-invariant and LoRA kernels are Triton GPU kernels)"
    if not batch_invariant or not cfg.sampler.batch_invariant:
        return "it mirrors vLLM's batch-invariant kernels, which --no-batch-invariant turns off"
    if not cfg.sampler.enforce_eager:
        return "it mirrors vLLM's eager forward; the config's sampler.enforce_eager is false"
    if cfg.model.dtype not in ("bfloat16", "float16"):
        return f"FlashAttention takes bfloat16 or float16, not {cfg.model.dtype}"
    if cfg.sampler.attention_backend not in (None, "FLASH_ATTN"):
        return f"it mirrors FLASH_ATTN, not the config's attention backend {cfg.sampler.attention_backend}"
    try:
        hf_cfg = safe_read.read_json(Path(model_dir) / "config.json")
    except ConfigError as exc:
        return str(exc)
    if not isinstance(hf_cfg, dict):
        return "config.json is not a JSON object"
    archs = hf_cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else "?"
    if arch not in ARCHITECTURES:
        return f"it follows {' and '.join(ARCHITECTURES)}, not {arch}"
    ropes = [hf_cfg.get("rope_scaling") or {}, hf_cfg.get("rope_parameters") or {}]  # transformers 4 and 5
    rope_types = {r.get("rope_type", r.get("type", "default")) if isinstance(r, dict) else "?" for r in ropes}
    if not rope_types <= {"default", None} or hf_cfg.get("hidden_act", "silu") != "silu" \
            or hf_cfg.get("attention_bias") or hf_cfg.get("mlp_bias"):
        return "it follows default rotary, SiLU and no bias; this checkpoint differs"
    return None


@dataclass(frozen=True)
class _Group:
    """One of vLLM's LoRA linear layers: a projection, or q/k/v or gate/up merged as vLLM merges them.
    `weight`: the base weights concatenated; `a`, `b`: per slice, as vLLM stacks them ([1, 1, r, in] and
    [1, 1, out, r] at max_lora_rank, B pre-scaled in the model's dtype), None where no slice has LoRA."""

    weight: torch.Tensor
    a: tuple[torch.Tensor, ...] | None
    b: tuple[torch.Tensor, ...] | None
    rank: int


def lora_group(modules: list[Any], rank: int, zero: frozenset[int] = frozenset()) -> _Group:
    """The vLLM layout of PEFT linears `modules` (a module without LoRA is a zero slice, as vLLM resets
    a slice the adapter does not carry), padded to `rank` (vLLM's max_lora_rank). A module in `zero` (ids of
    `zero_lora.zero_layers`: every B exactly zero) is taken as one without LoRA: it adds exactly zero either way."""
    parts = [lora_parts(m) if id(m) not in zero else (m.base_layer.weight, None, None, 1.0) for m in modules]
    weight = torch.cat([w for w, *_ in parts]).contiguous()
    a, b = _slices([(w.shape[0], w.shape[1], a, b, scale) for w, a, b, scale in parts], rank, weight.dtype,
                   weight.device)
    return _Group(weight, a, b, rank)


Slice = tuple[int, int, "torch.Tensor | None", "torch.Tensor | None", float]
"""(out features, in features, A, B, alpha/r) of one linear of a group; A and B None where it has no LoRA."""


def _slices(parts: list[Slice], rank: int, dtype: torch.dtype,
            device: Any) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """A and B of each slice as vLLM stacks them ([1, 1, r, in], [1, 1, out, r] at `rank`, B pre-scaled in `dtype`);
    (None, None) where no slice has LoRA."""
    if all(a is None for _, _, a, _, _ in parts):
        return None, None
    a_out, b_out = [], []
    for rows, cols, a, b, scale in parts:
        if a is None or b is None:
            a_out.append(torch.zeros(1, 1, rank, cols, dtype=dtype, device=device))
            b_out.append(torch.zeros(1, 1, rows, rank, dtype=dtype, device=device))
            continue
        r = a.shape[0]
        if r > rank:
            raise ConfigError(f"adapter rank {r} above max_lora_rank {rank}")
        b_half = b.to(dtype)  # vLLM loads the adapter in the model's dtype, then folds alpha/r into B there
        a_half, b_scaled = a.to(dtype), b_half if scale == 1 else b_half * scale
        if r < rank:
            a_half = torch.cat([a_half, a_half.new_zeros(rank - r, cols)])
            b_scaled = torch.cat([b_scaled, b_scaled.new_zeros(rows, rank - r)], dim=1)
        a_out.append(a_half[None, None].contiguous())
        b_out.append(b_scaled[None, None].contiguous())
    return tuple(a_out), tuple(b_out)


def lora_parts(module: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
    """(base weight, A, B, alpha/r) of a PEFT LoRA linear, or (weight, None, None, 1) of a plain one."""
    if hasattr(module, "base_layer") and "default" in getattr(module, "lora_A", {}):
        return (module.base_layer.weight, module.lora_A["default"].weight, module.lora_B["default"].weight,
                float(module.scaling["default"]))
    return module.weight, None, None, 1.0


def batch_invariant_ops() -> Any:
    """vLLM's batch-invariant ops module (`model_executor.layers` in 0.26, `model_executor.determinism` later)."""
    import importlib

    try:
        return importlib.import_module("vllm.model_executor.layers.batch_invariant")
    except ModuleNotFoundError:
        return importlib.import_module("vllm.model_executor.determinism.batch_invariant")


def apply_group(x: torch.Tensor, group: _Group, meta: Any) -> torch.Tensor:
    """vLLM's batch-invariant GEMM, then (where the group has LoRA) its shrink and expand kernels."""
    y = batch_invariant_ops().linear_batch_invariant(x, group.weight)
    if group.a is None or group.b is None:
        return y
    from vllm.lora.ops.triton_ops import lora_expand, lora_shrink

    m = x.shape[0]
    buffer = torch.empty((len(group.a), m, group.rank), dtype=torch.float32, device=x.device)
    args = meta.meta_args(m, False)
    lora_shrink(x, list(group.a), buffer, *args, 1.0)
    lora_expand(buffer, list(group.b), y, *args, offset_start=0, add_inputs=True)
    return y


def rope_cache(cfg: Any, head_dim: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's cos/sin cache: inv_freq, an fp32 outer product, cos and sin on the device, then the model's dtype."""
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    with torch.device(device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


class Pages:
    """The paged KV layout of packed sequences (`lens`) as vLLM's FLASH_ATTN backend reads a prefill: blocks of 16,
    each sequence's in order, its block table, slots, cumulative starts and lengths. Every layer's is the same, so
    a forward makes it once, on the host, and sends it in one copy per tensor (a copy from pageable host memory
    waits for the device: made per layer, it held the host back twice a layer)."""

    def __init__(self, lens: list[int], device: Any, block: int = 16) -> None:
        per_seq = [(length + block - 1) // block for length in lens]
        table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
        slots, first = [], 0
        for row, (length, count) in enumerate(zip(lens, per_seq, strict=True)):
            table[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
            slots.append(first * block + torch.arange(length, dtype=torch.int64))
            first += count
        self.lens, self.block, self.blocks = lens, block, first
        self.table, self.slots = table.to(device), torch.cat(slots).to(device)
        self.starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)
        self.used = torch.tensor(lens, dtype=torch.int32).to(device)
        self.one = torch.ones((), dtype=torch.float32, device=device)


def paged_attention(q: Any, k: Any, v: Any, hq: int, hkv: int, head_dim: int, lens: list[int] | None = None,
                    pages: Pages | None = None) -> Any:
    """Causal attention of packed sequences (`lens`, default one; or `pages`, their layout made once) as vLLM's
    FLASH_ATTN backend runs a prefill: K and V written to a paged cache (blocks of 16, K and V side by side in the
    last dimension, zeros before) by `reshape_and_cache_flash`, then FlashAttention 3 over each sequence's block
    table with one split."""
    from vllm import _custom_ops as ops
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    n = q.shape[0]
    pages = pages or Pages(lens or [n], q.device)
    kv = torch.zeros(pages.blocks, pages.block, hkv, 2 * head_dim, dtype=q.dtype, device=q.device)
    key_cache, value_cache = kv[..., :head_dim], kv[..., head_dim:]
    ops.reshape_and_cache_flash(k.reshape(n, hkv, head_dim), v.reshape(n, hkv, head_dim), key_cache, value_cache,
                                pages.slots, "auto", pages.one, pages.one)
    out = torch.empty(n, hq * head_dim, dtype=q.dtype, device=q.device)
    flash_attn_varlen_func(q=q.reshape(n, hq, head_dim), k=key_cache, v=value_cache, out=out.view(n, hq, head_dim),
                           cu_seqlens_q=pages.starts, max_seqlen_q=max(pages.lens),
                           seqused_k=pages.used, max_seqlen_k=max(pages.lens),
                           softmax_scale=head_dim ** -0.5, causal=True, window_size=[-1, -1], block_table=pages.table,
                           softcap=0, fa_version=3, num_splits=1)
    return out


def lora_meta(n: int, device: Any) -> Any:
    """vLLM's LoRA kernel metadata for n tokens, every one on adapter slot 0 (max_loras 1, as the sampler)."""
    from vllm.lora.ops.triton_ops import LoRAKernelMeta

    meta = LoRAKernelMeta.make(max_loras=1, max_num_tokens=n, device=device)
    meta.prepare_tensors(torch.zeros(n, dtype=torch.int32, device=device))
    return meta


GROUPS = (("qkv", "self_attn", ("q_proj", "k_proj", "v_proj")), ("o", "self_attn", ("o_proj",)),
          ("gate_up", "mlp", ("gate_proj", "up_proj")), ("down", "mlp", ("down_proj",)))
"""A decoder layer's four LoRA linear layers as vLLM merges them: (name, parent module, members)."""


def layer_groups(layer: Any, rank: int, zero: frozenset[int] = frozenset()) -> dict[str, _Group]:
    """A decoder layer's four LoRA linear layers as vLLM merges them, from PEFT's modules (`zero`: `lora_group`'s)."""
    return {name: lora_group([getattr(getattr(layer, parent), m) for m in members], rank, zero)
            for name, parent, members in GROUPS}


class StateGroups:
    """A plain base model's layers as vLLM merges them (weights cast to `dtype` and concatenated once, for every
    point) with one point's LoRA tensors (`pairs`: A and B by layer path, `reference_base.lora_pairs`)."""

    def __init__(self, model: Any, rank: int, dtype: torch.dtype) -> None:
        self.rank, self.dtype = rank, dtype
        self.paths = {id(m): n for n, m in model.named_modules()}
        self._weights: dict[tuple[int, str], torch.Tensor] = {}
        self._cast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in the model's dtype (itself where it is; a cast made once)."""
        if t.dtype == self.dtype:
            return t
        if id(t) not in self._cast:
            self._cast[id(t)] = (t, t.to(self.dtype))
        return self._cast[id(t)][1]

    def of(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> Any:
        """`exact_forward`'s `groups_of` for the point whose LoRA tensors are `pairs`. A layer whose B is exactly
        zero (every element: one host sync for the point) is a slice without LoRA, as `zero_lora` skips PEFT's:
        it adds exactly zero either way, and a group none of whose slices carries one runs no LoRA kernel."""
        from lora_parity.backends.reference_base import nonzero_b

        paths = list(pairs)
        live = {path for path, keep in zip(paths, nonzero_b([pairs], paths)[0], strict=True) if keep}

        def groups(index: int, layer: Any) -> dict[str, _Group]:
            out = {}
            for name, parent, members in GROUPS:
                modules = [getattr(getattr(layer, parent), m) for m in members]
                if (index, name) not in self._weights:
                    self._weights[index, name] = torch.cat([self.cast(m.weight) for m in modules]).contiguous()
                weight = self._weights[index, name]
                loras = [pairs[path] if (path := self.paths[id(m)]) in live else (None, None) for m in modules]
                parts: list[Slice] = [(m.out_features, m.in_features, a, b, scale)
                                      for m, (a, b) in zip(modules, loras, strict=True)]
                out[name] = _Group(weight, *_slices(parts, self.rank, self.dtype, weight.device), self.rank)
            return out

        return groups


@torch.inference_mode()
def exact_forward(model: Any, seqs: list[list[int]], rank: int, state: StateGroups | None = None,
                  groups_of: Any = None) -> list[torch.Tensor]:
    """The prompt logprobs (fp32, on the host) of each of `seqs`, packed into one forward of the PEFT
    `model`'s weights through vLLM's operations (module docstring); `rank`: the sampler's max_lora_rank. With
    `state` and `groups_of` (`StateGroups.of`), a plain model's weights cast by `state` and a point's LoRA tensors."""
    import torch.nn.functional as F
    from vllm import _custom_ops as ops
    bi = batch_invariant_ops()
    linear_batch_invariant, rms_norm_batch_invariant = bi.linear_batch_invariant, bi.rms_norm_batch_invariant
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    causal = model.get_base_model() if state is None else model
    inner, cfg = causal.model, causal.config
    cast = state.cast if state is not None else (lambda t: t)
    if groups_of is None:
        from lora_parity.backends.zero_lora import zero_layers

        zero = frozenset(map(id, zero_layers(model)))

        def groups_of(index: int, layer: Any) -> dict[str, _Group]:
            return layer_groups(layer, rank, zero)
    device = inner.embed_tokens.weight.device
    lens = [len(s) for s in seqs]
    n = sum(lens)
    tokens = torch.tensor([t for s in seqs for t in s], device=device)
    positions = torch.cat([torch.arange(length, device=device, dtype=torch.int64) for length in lens])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    cos_sin = rope_cache(cfg, head_dim, device, cast(inner.embed_tokens.weight).dtype)
    meta, pages = lora_meta(n, device), Pages(lens, device)
    eps = cfg.rms_norm_eps

    h = F.embedding(tokens, cast(inner.embed_tokens.weight))
    residual = h  # the first layer normalizes the embeddings; each later one adds its input to the residual first
    for index, layer in enumerate(inner.layers):
        groups = groups_of(index, layer)
        if index == 0:
            h = rms_norm_batch_invariant(h, cast(layer.input_layernorm.weight), eps)
        else:
            ops.fused_add_rms_norm(h, residual, cast(layer.input_layernorm.weight), eps)
        q, k, v = apply_group(h, groups["qkv"], meta).split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        attn = layer.self_attn
        if getattr(attn, "q_norm", None) is not None:
            q = rms_norm_batch_invariant(q.reshape(n, hq, head_dim), cast(attn.q_norm.weight), eps).view(n, -1)
            k = rms_norm_batch_invariant(k.reshape(n, hkv, head_dim), cast(attn.k_norm.weight), eps).view(n, -1)
        else:
            q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, head_dim, cos_sin, True)
        h = apply_group(paged_attention(q, k, v, hq, hkv, head_dim, pages=pages), groups["o"], meta)
        ops.fused_add_rms_norm(h, residual, cast(layer.post_attention_layernorm.weight), eps)
        gate_up = apply_group(h, groups["gate_up"], meta)
        act = torch.empty(n, gate_up.shape[-1] // 2, dtype=h.dtype, device=device)
        torch.ops._C.silu_and_mul(act, gate_up)
        h = apply_group(act, groups["down"], meta)
    ops.fused_add_rms_norm(h, residual, cast(inner.norm.weight), eps)
    head = cast(causal.get_output_embeddings().weight)
    out, start = [], 0
    for length in lens:  # row-wise kernels: each sequence's rows but its last, against the next tokens
        logits = linear_batch_invariant(h[start:start + length - 1], head)
        out.append(compute_token_logprobs(logits, tokens[start + 1:start + length, None])[:, 0].float().cpu())
        start += length
    return out


class ExactTrainer(HFTrainer):
    """The `hf` trainer with scoring through `exact_forward`: its scores equal the `vllm` sampler's bit for
    bit on the GPU, so `--budgets exact` can fail on any non-zero difference."""

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, timings: dict[str, float],
                 batch_invariant: bool = True) -> None:
        why = unsupported(cfg, model_dir, torch.cuda.is_available(), batch_invariant)
        if why is not None:
            raise ConfigError(f"--trainer exact: {why}")
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")  # the sampler's default; a value the user set wins
        try:
            import vllm
        except ImportError:
            raise ConfigError("--trainer exact needs vLLM's GPU build in this environment (pip install "
                              "'lora-parity[gpu]')") from None
        self._vllm_version = vllm.__version__
        self.rank = max_lora_rank(cfg.adapter.rank)
        super().__init__(cfg, model_dir, seed, timings)
        self.pack = packing(cfg, model_dir, invariant=True)  # the vllm sampler's, which it mirrors

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> ExactTrainer:
        assert model_dir is not None
        return cls(cfg, model_dir, options.seed, timings, batch_invariant=options.batch_invariant)

    def score(self, sequences: Sequences) -> Scores:
        """The sampler's groups (`vllm_options.packing`: batch-invariant on CUDA), each packed into one forward as the
        sampler packs one generate call."""
        out: Scores = []
        for part in groups(sequences, self.cfg.scoring.batch_size, self.pack):
            out += [row.tolist() for row in exact_forward(self.model, sequences[part], self.rank)]
        return out

    def info(self) -> BackendInfo:
        n = self.cfg.scoring.batch_size
        grouping = "one sequence per forward" if n == 1 else f"{n} sequences packed per forward"
        if self.pack:
            grouping = f"sequences up to {self.pack} tokens packed per forward"
        base = super().info()
        return BackendInfo(backend="exact", versions=versions() | {"vllm": self._vllm_version},
                           settings=base.settings | {"forward": FORWARD.format(grouping=grouping),
                                                     "max_lora_rank": self.rank,
                                                     "update": "HF+PEFT (the hf trainer's)"})


def exact_points(cfg: ModelConfig, model_dir: Path, batch_invariant: bool, base: Any = None) -> Any:
    """The exact reference (E): a scorer of the model with each given set of LoRA tensors through `exact_forward`,
    packed as the `vllm` sampler packs: the weights of the run's fp32 load cast to the model's dtype where `base` (a
    `reference_base.ReferenceBase`) holds one, else a load of the checkpoint in that dtype, freed afterwards; the
    LoRA tensors as given, without PEFT's modules (`StateGroups`), where the adapter is plain LoRA
    (`fp32_points.with_states` otherwise). A `ConfigError` where the forward cannot mirror the sampler
    (`unsupported`)."""
    from lora_parity.backends.fp32_points import with_states
    from lora_parity.backends.hf import load_base
    from lora_parity.backends.reference_base import lora_pairs, plain_targets, scaling

    why = unsupported(cfg, model_dir, torch.cuda.is_available(), batch_invariant)
    if why is not None:
        raise ConfigError(f"exact reference: {why}")
    rank, pack, device = max_lora_rank(cfg.adapter.rank), packing(cfg, model_dir, invariant=True), torch.device("cuda")

    def forward(model: Any, sequences: Sequences, device: Any, state: StateGroups | None = None,
                groups_of: Any = None) -> Scores:
        out: Scores = []
        for part in groups(sequences, cfg.scoring.batch_size, pack):
            out += [row.tolist() for row in exact_forward(model, sequences[part], rank, state, groups_of)]
        return out

    own = with_states(cfg, model_dir, cfg.model.dtype, forward, "exact reference", device)

    def score(sequences: Sequences, states: Any, routes: Any = None) -> list[Scores]:
        held = base is not None and base.held
        model = base.model() if held else load_base(cfg, model_dir, device)
        targets = plain_targets(cfg, model)
        if targets is None:
            del model
            return own(sequences, states, routes)
        mirror = StateGroups(model, rank, getattr(torch, cfg.model.dtype))
        try:
            return [forward(model, sequences, device, mirror,
                            mirror.of(lora_pairs(state, targets, "exact reference", device, mirror.dtype),
                                      scaling(cfg)))
                    for state in states]
        finally:
            del mirror, model
            torch.cuda.empty_cache()

    return score
