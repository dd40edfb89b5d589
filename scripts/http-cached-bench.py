"""Cached scoring against uncached scoring over HTTP, on one `vllm serve` the vllm-server sampler starts (issue 44's
"cached scoring within 2x"): per round, in alternating order, `score` (prompt_logprobs, the cache not read), then
`score_cached` as the sampler reads the cache, and the same preceded by one request that fills the cache first (the
method's first form, for the comparison). One untimed round first (the engine's first decode-path request).

    python scripts/http-cached-bench.py MODEL [--rounds N] [--lengths 97,97]

MODEL is a project config or a checkpoint folder. Prints each figure's median and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from lora_parity.backends.base import BackendOptions
from lora_parity.backends.vllm_server import VLLMServerSampler
from lora_parity.models import config, synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--lengths", default="97,97", help="token counts of the scored sequences")
    args = parser.parse_args()
    cfg = config.load(args.model)
    model_dir = synthetic.materialize(cfg)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    sequences = [[rng.randrange(1, min(vocab, 1000)) for _ in range(int(n))] for n in args.lengths.split(",")]
    timings: dict[str, float] = {}
    sampler = VLLMServerSampler.create(cfg, model_dir, timings, BackendOptions())
    try:
        def uncached() -> None:
            sampler.score(sequences, None)

        def cached() -> None:
            sampler.score_cached(sequences, None)

        def warm_then_cached() -> None:
            sampler._completion(sequences, sampler.base_model, "completions_warm")
            sampler.score_cached(sequences, None)

        ways = {"uncached": uncached, "cached": cached, "warm + cached": warm_then_cached}
        for way in ways.values():  # untimed: the first requests of each kind
            uncached()
            way()
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
            for name, way in order:
                uncached()  # each cached form reads what the uncached pass before it left, as in a run
                start = time.perf_counter()
                way()
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(v) for name, v in seconds.items()}
        for name, v in seconds.items():
            print(f"{name:14s} median {medians[name] * 1000:8.1f} ms   runs: "
                  + ", ".join(f"{x * 1000:.1f}" for x in v))
        for name in ("cached", "warm + cached"):
            print(f"{name} / uncached: {medians[name] / medians['uncached']:.2f}x (medians, one sitting)")
        print("cached_scoring:", sampler.cached_scoring())
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
