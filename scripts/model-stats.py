"""How far from uniform a (synthetic) checkpoint's next-token distributions are.

usage: python scripts/model-stats.py CONFIG...   (prints one line per config)

For each config: the mean entropy of the next-token distribution over the default probes, the
mean logprob of the probe tokens, and log(vocab) (the entropy of a uniform distribution).
"""

from __future__ import annotations

import math
import sys

import torch

from lora_parity.backends.hf import load_base, pick_device
from lora_parity.models import config, synthetic
from lora_parity.run.probes import random_probes


@torch.inference_mode()
def main() -> None:
    for name in sys.argv[1:]:
        cfg = config.load(name)
        folder = synthetic.materialize(cfg)
        device = pick_device()
        model = load_base(cfg, folder, device)
        vocab = model.config.vocab_size
        probes = random_probes(cfg.probes, "default", vocab)
        entropies, logprobs = [], []
        for seq in probes.sequences:
            ids = torch.tensor([seq], device=device)
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            entropies += (-(lp.exp() * lp).sum(-1)).tolist()
            logprobs += lp.gather(1, ids[0, 1:, None])[:, 0].tolist()
        print(f"{name}: mean next-token entropy {sum(entropies) / len(entropies):.3f} nats, "
              f"mean probe-token logprob {sum(logprobs) / len(logprobs):.3f}, log(vocab) {math.log(vocab):.3f}")
        del model


if __name__ == "__main__":
    main()
