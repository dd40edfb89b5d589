"""How much of A routing flips can be, per synthetic MoE shape, on the CPU (issue 52's shape choice before the GPU).

    python scripts/moe-flips.py CONFIG [EXPERT_STD ...]     (e.g. qwen3-moe-64x8-synth 0.02 0.1 0.3)

A CPU stand-in of the GPU's two sides: the config's model in bf16 (the "trainer") against the same weights in fp32
(the "engine"). Per expert std (`moe.expert_std`; "hf": HF's own init): the router agreement between the two,
A's mean |logprob difference| with each side routing itself (replay off), and with the bf16 side replaying the
fp32 side's routes (`backends.moe.forced_routes`, replay on), over the config's probe lengths (seeded random
tokens). Where replay removes most of A, the flips are what A carries; where it removes little, the two sides'
computation is. The GPU's sides are both bf16 (vLLM's kernels and HF's), so their computation differs less than
bf16 from fp32 here: the share the flips carry there is at least this one."""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch


def logprobs(model, sequences):
    out = []
    with torch.inference_mode():
        for seq in sequences:
            logits = model(input_ids=torch.tensor([seq])).logits.float()[0]
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def mean_abs(a, b):
    diff = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diff) / len(diff)


def main(name: str, stds: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    from lora_parity.backends.moe import forced_routes, hf_router_topk, route_table
    from lora_parity.models import config, synthetic

    cfg = config.load(name)
    spec = cfg.model.synthetic
    assert spec is not None and spec.moe is not None, f"{name}: not a synthetic MoE config"
    rng = random.Random(1001)
    sequences = [[rng.randrange(2, spec.vocab_size) for _ in range(n)] for n in cfg.probes.lengths]
    torch.set_num_threads(2)
    for std in stds or ["hf"]:
        moe = spec.moe.model_copy(update={"expert_std": None if std == "hf" else float(std)})
        shape = spec.model_copy(update={"moe": moe, "generate_on": "cpu"})
        with tempfile.TemporaryDirectory() as folder:
            synthetic.generate(shape, "float32", Path(folder))
            fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        r32, r16 = hf_router_topk(fp32, sequences, "cpu"), hf_router_topk(bf16, sequences, "cpu")
        pairs = [(a, b) for s32, s16 in zip(r32, r16, strict=True) for t32, t16 in zip(s32, s16, strict=True)
                 for a, b in zip(t32, t16, strict=True)]
        agreement = sum(sorted(a) == sorted(b) for a, b in pairs) / len(pairs)
        engine = logprobs(fp32, sequences)
        off = mean_abs(logprobs(bf16, sequences), engine)
        with forced_routes(bf16, route_table(sequences, r32)):
            on = mean_abs(logprobs(bf16, sequences), engine)
        print(f"{name} expert_std {std}: router agreement {agreement:.4f}; A mean replay off {off:.4g}, on {on:.4g} "
              f"(replay removes {1 - on / off:.0%})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
