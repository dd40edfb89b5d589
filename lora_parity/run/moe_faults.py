"""The route faults: the engine's expert routes reach the trainer's routers wrong (route replay, docs/moe.md).
Their specs are registered in `lora_parity.run.faults.FAULTS`; `corrupt_routes` is the hook the sequence calls
on every hand-over (`route_replay.Replay.table`).

Both hand the trainer routes of other tokens than its own, so the trainer computes another forward than the
engine at the same point: A fails, on its mean (on its fp32 side where the reference is scored: the reference
replays the routes as the engine returned them). Not here: one expert's LoRA update dropped on the engine side,
which needs expert LoRA on the engine (vLLM's MoE-LoRA kernel is Triton, absent from the CPU build; the GPU
session adds it).
"""

from __future__ import annotations

from lora_parity.backends.base import Routes, Sequences
from lora_parity.run.fault_spec import FaultSpec

CAUGHT_BY = ("A.parity.mean|A.fp32.trainer.mean",)
"""A's mean: every token routed otherwise moves by tenths of a nat (tiny-qwen3-moe, the fake); with an fp32
reference A's threshold follows the trainer's own distance from it, which the fp32 check then names."""

ROUTE_FAULTS = (
    FaultSpec("routes-other-sequence", "the trainer replays each sequence's routes from the next probe sequence "
              "(cut or repeated to its length): routes handed over out of order", CAUGHT_BY, "fail",
              needs_replay=True),
    FaultSpec("routes-shifted", "the trainer replays each token's routes one position late (token t gets token "
              "t-1's, the first keeps its own): an off-by-one between the engine's routes and the tokens", CAUGHT_BY,
              "fail", needs_replay=True),
)
ROUTE_FAULT_NAMES = tuple(spec.name for spec in ROUTE_FAULTS)


def corrupt_routes(name: str | None, sequences: Sequences, routes: Routes) -> Routes:
    """The routes as fault `name` hands them to the trainer (unchanged for any other fault)."""
    if name == "routes-other-sequence":
        others = [routes[(i + 1) % len(routes)] if len(routes) > 1 else routes[i][::-1] for i in range(len(routes))]
        return [[other[t % len(other)] for t in range(len(seq))] for seq, other in zip(sequences, others, strict=True)]
    if name == "routes-shifted":
        return [seq_routes[:1] + seq_routes[:-1] for seq_routes in routes]
    return routes
