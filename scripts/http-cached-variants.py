"""Where the vllm-server sampler's cached scoring spends its time over HTTP (issue 44): request variants on one
`vllm serve` the sampler starts, alternating rounds, medians against the uncached pass.

    python scripts/http-cached-variants.py MODEL [--rounds N]

The default probes' lengths (65 and 129 tokens, blocks of 16). Variants: `score` (uncached) and `score_cached` (the
landed form); the same block requests sent raw, with the last block of the final token alone, in blocks of 32 and
64 (fewer requests, fewer positions read through the cache), one at a time, without the forced next token, without
prompt logprobs; trivial 16-token requests, one of them alone; one uncached `/v1/completions` of the longer sequence.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lora_parity.backends import vllm_cached
from lora_parity.backends.base import BackendOptions
from lora_parity.backends.vllm_server import VLLMServerSampler
from lora_parity.backends.vllm_server_cached import GENERATE
from lora_parity.models import config, synthetic

LENGTHS = (65, 129)


def requests(sequences: list[list[int]], size: int = 16, logprobs: bool = True, forced: bool = True,
             empty_last: bool = False, trivial: bool = False) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The block requests of `vllm_cached.Blocks` for `sequences`, varied."""
    prompts: list[list[int]] = []
    params: list[dict[str, Any]] = []
    for seq in sequences:
        for start in range(0, len(seq), size):
            end = min(len(seq), start + size)
            if end - start == 1 and end == len(seq) and not empty_last:
                continue
            if trivial:
                prompts.append(seq[start:end])
                params.append({"max_tokens": 1, "detokenize": False})
                continue
            kw: dict[str, Any] = {"max_tokens": 1, "temperature": 1.0, "detokenize": False, vllm_cached.FIELD: False}
            if logprobs:
                kw["prompt_logprobs"] = 0
            if forced and end < len(seq):
                kw.update(logprobs=0, allowed_token_ids=[seq[end]])
            prompts.append(seq[:end])
            params.append(kw)
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cfg = config.load(args.model)
    model_dir = synthetic.materialize(cfg)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    sequences = [[rng.randrange(1, min(vocab, 1000)) for _ in range(n)] for n in LENGTHS]
    timings: dict[str, float] = {}
    sampler = VLLMServerSampler.create(cfg, model_dir, timings, BackendOptions())
    try:
        sampler.score(sequences, None)
        sampler.score_cached(sequences, None)  # the block-size probe and the first decode-path request, untimed
        model = sampler.base_model

        def send(prompts: list[list[int]], params: list[dict[str, Any]], concurrency: int = 32) -> None:
            def one(i: int) -> Any:
                body = {"model": model, "token_ids": prompts[i], "sampling_params": params[i]}
                return sampler._call(GENERATE, body, "variant")

            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, range(len(prompts))))

        ways: dict[str, Callable[[], Any]] = {
            "uncached": lambda: sampler.score(sequences, None),
            "cached": lambda: sampler.score_cached(sequences, None),
            "raw-blocks": lambda: send(*requests(sequences)),
            "empty-last": lambda: send(*requests(sequences, empty_last=True)),
            "blocks-of-32": lambda: send(*requests(sequences, size=32)),
            "blocks-of-64": lambda: send(*requests(sequences, size=64)),
            "one-at-a-time": lambda: send(*requests(sequences), concurrency=1),
            "not-forced": lambda: send(*requests(sequences, forced=False)),
            "no-logprobs": lambda: send(*requests(sequences, logprobs=False)),
            "trivial": lambda: send(*requests(sequences, trivial=True)),
            "one-trivial": lambda: send([sequences[0][:16]], [{"max_tokens": 1, "detokenize": False}]),
            "uncached-one": lambda: sampler._completion(sequences[1], model, "variant", prompt_logprobs=0),
        }
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds + 1):  # round 0 warms each variant, untimed
            order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
            for name, way in order:
                sampler.score(sequences, None)  # every variant finds the blocks the uncached pass leaves
                start = time.perf_counter()
                way()
                if r:
                    seconds[name].append(time.perf_counter() - start)
        base = statistics.median(seconds["uncached"])
        for name, values in seconds.items():
            m = statistics.median(values)
            print(f"{name:14s} median {m * 1000:7.1f} ms  {m / base:5.2f}x  runs "
                  + ", ".join(f"{x * 1000:.0f}" for x in values))
        counts = {"blocks": requests(sequences), "empty-last": requests(sequences, empty_last=True),
                  "blocks-of-32": requests(sequences, size=32), "blocks-of-64": requests(sequences, size=64)}
        print("requests:", ", ".join(f"{name} {len(prompts)}" for name, (prompts, _) in counts.items()))
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
