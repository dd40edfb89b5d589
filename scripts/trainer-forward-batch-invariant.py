"""Issue 47 on the GPU: an HF trainer forward with and without vLLM's batch-invariant mode in the process.

With the in-process `vllm` sampler, vLLM's batch-invariant mode (0.26: Triton kernels for aten softmax, _softmax,
_log_softmax, mean.dim and bmm at the CUDA key; cuBLAS without split-K through CUBLAS_WORKSPACE_CONFIG) applies to
every forward in the process, the trainer's too. This times one SmolLM2-shaped Llama forward (random weights, bf16,
PEFT LoRA r8 on the seven projections, B nonzero, the default probes' shapes 65 and 129), medians of 9: before the
mode is on, with it on, with its Library destroyed (the overrides lifted; the cuBLAS settings stay), then with the
matmul flags the mode turned off put back one by one (reduced-precision reductions, the preferred BLAS library), and
on again; and whether each state's scores equal the first. Run on the GPU machine after `gpu-evidence.sh install`:

    PYTHONPATH=/tmp/site:$PWD python3 scripts/trainer-forward-batch-invariant.py
"""

from __future__ import annotations

import importlib
import os
import statistics
import time

import peft
import torch
import transformers

DEVICE = "cuda"
LENGTHS = (65, 129)


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).to(DEVICE).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


@torch.inference_mode()
def score(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long, device=DEVICE)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, device=DEVICE)
        mask[i, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    rows = [torch.log_softmax(logits[i, :len(s) - 1].float(), -1).gather(1, ids[i, 1:len(s), None])[:, 0]
            for i, s in enumerate(seqs)]
    return torch.cat(rows).cpu()


def timed_ms(model: torch.nn.Module, seqs: list[list[int]], rounds: int = 9) -> float:
    score(model, seqs)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        score(model, seqs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    model = build()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    try:
        bi = importlib.import_module("vllm.model_executor.layers.batch_invariant")
    except ImportError:
        bi = importlib.import_module("vllm.model_executor.determinism.batch_invariant")
    matmul = torch.backends.cuda.matmul
    flags = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    blas = torch.backends.cuda.preferred_blas_library()
    plain, t_plain = score(model, seqs), timed_ms(model, seqs)
    bi.enable_batch_invariant_mode()
    invariant, t_invariant = score(model, seqs), timed_ms(model, seqs)
    lib = bi._batch_invariant_LIB
    print("overridden:", sorted(getattr(lib, "_op_impls", [])) if lib is not None else None)
    if lib is not None:
        lib._destroy()
        bi._batch_invariant_LIB = None
    bi._batch_invariant_MODE = False
    lifted, t_lifted = score(model, seqs), timed_ms(model, seqs)
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = flags
    reduced, t_reduced = score(model, seqs), timed_ms(model, seqs)
    torch.backends.cuda.preferred_blas_library(blas)
    library, t_library = score(model, seqs), timed_ms(model, seqs)
    print(f"then reduced-precision reductions allowed again {t_reduced:.1f} ms (== plain "
          f"{torch.equal(plain, reduced)}), then the preferred BLAS {blas} again {t_library:.1f} ms (== plain "
          f"{torch.equal(plain, library)})")
    bi.enable_batch_invariant_mode()
    again, t_again = score(model, seqs), timed_ms(model, seqs)
    print(f"forward plain {t_plain:.1f} ms, batch-invariant {t_invariant:.1f} ms, plain again {t_lifted:.1f} ms, "
          f"invariant again {t_again:.1f} ms")
    print(f"plain == plain again {torch.equal(plain, lifted)}; invariant == invariant again "
          f"{torch.equal(invariant, again)}; max |plain - invariant| {(plain - invariant).abs().max().item():.4g}, "
          f"mean {(plain - invariant).abs().mean().item():.4g}")
    print(torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name(0),
          os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


if __name__ == "__main__":
    main()
