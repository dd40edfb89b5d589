"""Issue 47 on the GPU: are the in-process engine's passes slower once the HF trainer has recorded a CUDA graph?

On one H100 of two (BENCHMARKS.md, thirty-fourth session) every engine pass after the trainer's first recording
(`LORA_PARITY_TRAINER_GRAPHS=1`) was 35-90 ms slower than in a run without graphs. This opens the vllm sampler and
the hf trainer as a run does (the sampler first), then times, in rounds of alternating order, one engine scoring
pass, one publish (the trainer's export and the engine's load of a new version) and one trainer forward: first with
no graph in the process, then after the trainer recorded one (its forwards replayed), then after the graphs were
dropped again. Medians per stage; the scores of each stage compared with the first's.

On the thirty-fifth session's H100 the engine was not slower after a recording (45.4, 45.9 and 45.7 ms a pass;
benchmarks/gpu-engine-after-graph-0d78f4c-h100.txt): the graphs went on by default.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/engine-after-graph.py CHECKPOINT [--rounds 9]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lora_parity.backends import hf_graphs
from lora_parity.backends.base import BackendOptions
from lora_parity.backends.hf import HFTrainer
from lora_parity.backends.vllm import VLLMSampler
from lora_parity.models import config, synthetic


def timed(steps: dict[str, Callable[[], object]], rounds: int, first: dict[str, object], name: str) -> str:
    """Each step's median over `rounds` rounds of alternating order (after one untimed call each); a step's output
    must equal its first stage's."""
    for step in steps.values():
        step()
    seconds: dict[str, list[float]] = {step: [] for step in steps}
    for r in range(rounds):
        for step, call in (list(steps.items()) if r % 2 == 0 else list(reversed(steps.items()))):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = call()
            seconds[step].append(time.perf_counter() - start)
            if out is not None and first.setdefault(step, out) != out:
                raise SystemExit(f"{name}: {step} scores moved")
    return ", ".join(f"{step} {statistics.median(v) * 1000:.1f} ms" for step, v in seconds.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a project config or a checkpoint (default: embedded)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    cfg = config.load(args.model)
    model_dir = synthetic.materialize(cfg)
    rng = random.Random(0)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    sequences = [[rng.randrange(1, min(vocab, 1000)) for _ in range(n)] for n in (65, 129)]
    timings: dict[str, float] = {}
    os.environ[hf_graphs.ENV] = "0"  # the first stage: no graph in the process
    sampler = VLLMSampler.create(cfg, model_dir, timings, BackendOptions())
    trainer = HFTrainer(cfg, model_dir, 0, timings)
    work = Path(tempfile.mkdtemp(prefix="engine-after-graph-"))
    version = [0]
    trainer.perturb(0.02, 1)
    handle = [sampler.publish(trainer.export_adapter(work / "v0"), "v0", 1)]

    def engine() -> object:
        return sampler.score(sequences, handle[0])

    def publish() -> object:
        version[0] += 1
        new = sampler.publish(trainer.export_adapter(work / f"v{version[0]}"), f"v{version[0]}", version[0] + 1)
        sampler.retire(handle[0])
        handle[0] = new
        return None

    def forward() -> object:
        return trainer.score(sequences)

    steps = {"engine pass": engine, "publish": publish, "trainer forward": forward}
    first: dict[str, object] = {}

    def stage(name: str) -> None:
        print(f"{name}: {timed(steps, args.rounds, first, name)} | trainer forwards: {trainer.graphs.describe()}",
              flush=True)

    stage("no graph")
    os.environ[hf_graphs.ENV] = "1"
    trainer.graphs = hf_graphs.Graphs(trainer.model, trainer.device, dense=True)
    for _ in range(3):  # recorded at the second forward, compared at the third
        forward()
    stage("a graph recorded")
    os.environ[hf_graphs.ENV] = "0"
    trainer.graphs = hf_graphs.Graphs(trainer.model, trainer.device, dense=True)  # off: eager, the graph freed
    gc.collect()
    torch.cuda.empty_cache()
    stage("graphs dropped")
    sampler.close()


if __name__ == "__main__":
    main()
