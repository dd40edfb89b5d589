"""How far a synthetic Qwen3-shaped model's own bf16 scores drift from its fp32 scores, on the CPU.

The GPU evidence shows bf16 trainer and sampler stacks disagreeing by a model-dependent amount at
zero-init; this measures the drift of one stack (HF transformers) against fp32 for a shape, with
the synthetic checkpoints' recipe (HF init under seed 0, output matrix redrawn so that the logits'
std is `--logit-std`), on the default probes. Use fewer layers than the real shape to keep CPU time
and memory small; the drift only grows with depth.

    python scripts/bf16-drift.py --hidden 4096 --intermediate 12288 --layers 8 --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import math
import random

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--logit-std", type=float, default=2.9)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        generator = torch.Generator().manual_seed(1)
        head.copy_(torch.randn(head.shape, generator=generator) * (args.logit_std / math.sqrt(args.hidden)))
    rng = random.Random(1001)  # the default probes' seed and lengths
    sequences = [[rng.randrange(args.vocab) for _ in range(n)] for n in (65, 129)]

    @torch.inference_mode()
    def score() -> torch.Tensor:
        out = []
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
        return torch.cat(out)

    fp32 = score()
    model.to(torch.bfloat16)
    diff = (score() - fp32).abs()
    print(f"hidden {args.hidden}, {args.layers} layers: bf16 vs fp32 |diff| mean {diff.mean():.4f}, "
          f"p99 {diff.quantile(0.99):.4f}, max {diff.max():.4f} over {diff.numel()} tokens")


if __name__ == "__main__":
    main()
