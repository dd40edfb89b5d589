"""The MoE faults (docs/moe.md); their specs are registered in `lora_parity.run.faults.FAULTS`.

The route faults: the engine's expert routes reach the trainer's routers wrong (route replay). `corrupt_routes`
is the hook the sequence calls on every hand-over (`route_replay.Replay.table`). Both hand the trainer routes of
other tokens than its own, so the trainer computes another forward than the engine at the same point: A fails, on
its mean (on its fp32 side where the reference is scored: the reference replays the routes as the engine returned
them).

The expert fault (`expert-dropped`, an adapter with `target_parameters`): one routed expert's LoRA update dropped
on the engine's side, planted in the exported adapter file between the export and the engine's load
(`drop_expert`, from `Faults.after_export`). The expert is one the probe tokens visit: the one the engine's zero
pass routed the most tokens to in that layer (its routes reach the fault on their first hand-over to the trainer,
so the fault needs route replay).
"""

from __future__ import annotations

from lora_parity.backends.base import Routes, Sequences
from lora_parity.backends.layer_subset import layer_of
from lora_parity.models import adapter_files as af
from lora_parity.models.adapter_spec import EXPERT_KINDS
from lora_parity.models.perturb import is_lora_b, target_kind
from lora_parity.run.fault_spec import ADAPTER_MODES, FaultSpec
from lora_parity.util.errors import PhaseError

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

EXPERT_DROPPED = "expert-dropped"
EXPERT_FAULTS = (
    # X is the check that must catch it: the synced file is not the trainer's, bit for bit, and its finding names the
    # layer, the modules and the expert (`export_check`). C sees it only where the one expert's share of the change
    # stands above C's noise: on tiny-qwen3-moe-experts (HF trainer and sampler, fp32, seeds 0-2) C's mean was
    # 0.030-0.052 against 1e-4 (X 0.30-0.38 nats against 0); on qwen3-moe-64x8-experts-lora-synth (vLLM 0.26 on an
    # H100, bf16, seeds 0-4) C's mean was 0.031-0.038 with the fault and 0.032-0.039 without it, against 0.086-0.105:
    # one expert of 64 in one layer of 16 is inside bf16's noise there, while X differed by 0.40-0.79 nats.
    FaultSpec(EXPERT_DROPPED, "the exported adapter drops one routed expert's update in one MoE layer (the middle "
              "one; the expert the engine's zero pass routed the most probe tokens to there): its columns e::E of "
              "both fused lora_B tensors zeroed, as an engine that loses one expert's slice of an MoE LoRA",
              ("X.sync.identical",), "fail", modes=ADAPTER_MODES, rewrites_files=True,
              needs_targets=EXPERT_KINDS, needs_replay=True),
)
REPLAY_FAULTS = {**{name: "changes the routes the trainer replays" for name in ROUTE_FAULT_NAMES},
                 EXPERT_DROPPED: "picks the expert it drops from the engine's routes"}
"""The faults that need route replay, and why."""


def drop_expert(tensors: dict[str, af.Tensor], rank: int, routes: Routes | None) -> dict[str, af.Tensor]:
    """`expert-dropped`: in the middle MoE layer L of the adapter's expert tensors, the expert e the engine's zero
    pass (`routes`, [sequence][token][MoE layer] -> experts) routed the most tokens to in L (ties: the lowest
    index) loses its update: the columns `e::E` of both fused B tensors ([out, E*r]; PEFT's `ParamWrapper` keeps
    expert e's B at `B.reshape(out, r, E)[:, :, e]`) are zeroed. The k-th MoE layer of the routes is the k-th
    layer that holds expert tensors."""
    layers = sorted({i for n in tensors if target_kind(n) in EXPERT_KINDS and (i := layer_of(n)) is not None})
    if not layers:
        raise PhaseError(f"{EXPERT_DROPPED}: the exported adapter has no routed-expert tensors")
    if not routes:
        raise PhaseError(f"{EXPERT_DROPPED}: no engine routes were handed over before the export to pick an expert")
    moe_index = len(layers) // 2
    counts: dict[int, int] = {}
    for token in (t for seq in routes for t in seq):
        for expert in token[moe_index]:
            counts[expert] = counts.get(expert, 0) + 1
    expert = min(counts, key=lambda e: (-counts[e], e))
    return {n: _zero_columns(t, expert, t.shape[1] // rank)
            if layer_of(n) == layers[moe_index] and target_kind(n) in EXPERT_KINDS and is_lora_b(n) else t
            for n, t in tensors.items()}


def _zero_columns(t: af.Tensor, expert: int, experts: int) -> af.Tensor:
    """`t` ([rows, cols], row-major) with the columns `expert::experts` zeroed (zero is all-zero bytes in every
    float dtype)."""
    rows, cols = t.shape
    size = len(t.data) // (rows * cols)
    data = bytearray(t.data)
    for row in range(rows):
        for col in range(expert, cols, experts):
            at = (row * cols + col) * size
            data[at:at + size] = bytes(size)
    return af.Tensor(t.dtype, list(t.shape), bytes(data))


def corrupt_routes(name: str | None, sequences: Sequences, routes: Routes) -> Routes:
    """The routes as fault `name` hands them to the trainer (unchanged for any other fault)."""
    if name == "routes-other-sequence":
        others = [routes[(i + 1) % len(routes)] if len(routes) > 1 else routes[i][::-1] for i in range(len(routes))]
        return [[other[t % len(other)] for t in range(len(seq))] for seq, other in zip(sequences, others, strict=True)]
    if name == "routes-shifted":
        return [seq_routes[:1] + seq_routes[:-1] for seq_routes in routes]
    return routes
