"""The HF trainer's scoring forward replayed from a CUDA graph (issue 47); `LORA_PARITY_TRAINER_GRAPHS=0` turns it off.

On a GPU a small model's HF + PEFT forward costs its kernel launches, not its arithmetic: SmolLM2-135M with LoRA
on seven projections takes about 45 ms a forward on an H100, nearly all of it Python
(`benchmarks/gpu-trainer-forward-plain-kernels-055b39a-h100.txt`), and a default run makes about 40. A CUDA
graph records one forward's kernels and replays them with the inputs copied into the tensors it recorded: the
same kernels on the same shapes and the same weights' storage, in a fraction of the time.

What keeps it the trainer's forward:
- Recorded with every LoRA layer on (not `zero_lora`'s skip), so the graph runs each adapter's kernels whatever B
  holds; a layer the eager forward skips adds exactly zero there.
- Checked, never assumed: a graph is kept only once its replay equals the eager forward (`zero_lora`'s skip on)
  bit for bit, and that shape's forwards run eager and are compared again until each LoRA layer has been checked
  while its B is non-zero (then its adapter's kernels carry values: at zero-init they add zeros whatever they
  compute). A difference, or a forward that cannot be recorded, leaves that shape eager for good (transformers
  5.17 builds an explicit causal mask while a graph records a one-sequence forward, which the eager forward leaves
  to the kernel); the eager logits are the ones returned, and the trainer's receipt says how its forwards ran
  (`describe`).
- Recorded at a shape's second forward (a shape scored once, as `trainer_updated_alt`'s one sequence a forward,
  costs no recording), again when a parameter's or buffer's storage moved or a LoRA layer was switched (merged,
  disabled, another adapter active); at most `MAX_GRAPHS` shapes (a new one past them runs eager).
- Only where there is room: a shape is recorded only while the device's free memory (the driver's, and the cache's
  unused part) is at least `ROOM` times its logits plus `RESERVE`; else it stays eager, and the receipt says why.
- Only where it can hold: a CUDA device, a dense model (an MoE's routing reads values on the host), the plain
  scoring forward (not the tempered one); and not with `LORA_PARITY_TRAINER_GRAPHS=0` (`ENV`).

On by default: on an H100 the run's score lists and every selftest fault's equal those of the eager forwards bit for
bit, the engine's passes are no slower after a recording in its process, and a default run is 2-3 % shorter
(BENCHMARKS.md, thirty-fifth session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lora_parity.backends import zero_lora

MAX_GRAPHS = 4
"""Input shapes recorded per model (a run's probes are packed into one or two; each graph holds its activations)."""

ENV = "LORA_PARITY_TRAINER_GRAPHS"
"""Set to 0 to run the trainer's forwards eager (the graphs are on by default where they can hold)."""

ROOM = 4
"""A shape is recorded only while the device has free at least ROOM times its eager forward's logits, plus
`RESERVE`: the graph's own memory (its output and the forward's transient tensors, about one to two times the logits)
is held for the run, beside the eager forwards that still compare it and the trainer's other work."""
RESERVE = 1 << 30

Key = tuple[tuple[int, ...], bool, tuple[int, ...]]
"""A recorded forward's inputs: the ids' shape, whether it has no mask (one sequence), and each sequence's length
(the mask's pattern: an eager forward may take another path where no sequence is padded)."""

Forward = Callable[[torch.Tensor, "torch.Tensor | None", tuple[int, ...]], torch.Tensor]
"""A scoring call's forward: (ids, mask or None, the sequences' lengths) on the device → logits."""

Recorded = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""What a graph records: (ids, mask or None) → logits."""


def call(model: Any) -> Forward:
    """The model's plain forward: mask given only where a group has more than one sequence (as `score_sequences`)."""

    def forward(ids: torch.Tensor, mask: torch.Tensor | None, lengths: tuple[int, ...] = ()) -> torch.Tensor:
        return model(input_ids=ids, **({"attention_mask": mask} if mask is not None else {})).logits

    return forward


@dataclasses.dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor
    mask: torch.Tensor | None
    logits: torch.Tensor
    state: tuple[Any, ...]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@contextlib.contextmanager
def forwards(model: Any, graphs: Graphs | None = None) -> Iterator[Forward]:
    """One scoring call's forward: `graphs.forward` where graphs are on, else eager with `zero_lora`'s skip (the
    zero layers found once for the call)."""
    if graphs is not None and graphs.on:
        yield graphs.forward
        return
    with zero_lora.skipped(model):
        yield call(model) if graphs is None else graphs.eager


class Graphs:
    """One model's recorded forwards, one per input shape and padding (`Key`; `forwards(model, graphs)` gives a
    scoring call its forward)."""

    def __init__(self, model: Any, device: torch.device, dense: bool,
                 capture: Callable[[Recorded, torch.Tensor, torch.Tensor | None], _Graph] | None = None,
                 free_memory: Callable[[torch.device], int] | None = None) -> None:
        self.model = model
        self.on = dense and device.type == "cuda" and os.environ.get(ENV) != "0"
        self.why_off = ("" if self.on else "not a CUDA device" if device.type != "cuda" else
                        "an MoE (its routing reads values)" if not dense else f"turned off: {ENV}=0")
        self.counts = {"eager": 0, "replayed": 0, "recorded": 0}
        self._capture = capture or self._cuda_capture
        self._free_memory = free_memory or _cuda_free
        self._graphs: dict[Key, _Graph] = {}
        self._checked: dict[Key, set[int]] = {}
        """Per graph, the LoRA layers (by index in `zero_lora.lora_linears`) compared while their B was non-zero."""
        self._seen: set[Key] = set()
        self.eager_only: dict[Key, str] = {}
        """Shapes whose replay differed from the eager forward or that could not be recorded: why."""
        self._stream: Any = None
        self._tensors: list[torch.Tensor] | None = None

    def describe(self) -> str:
        """For the trainer's receipt: how its scoring forwards ran."""
        c = self.counts
        if not self.on:
            return f"eager ({self.why_off})"
        how = (f"since the trainer loaded, {c['replayed']} replayed from {c['recorded']} CUDA graph(s), {c['eager']} "
               "eager (a graph serves once its replays equal the eager forward bit for bit with every LoRA layer's B "
               "non-zero at some check)")
        refused = "; ".join(f"shape {list(shape)}, lengths {list(lengths)}: {why}"
                            for (shape, _, lengths), why in self.eager_only.items())
        return how + (f"; eager only: {refused}" if refused else "")

    def eager(self, ids: torch.Tensor, mask: torch.Tensor | None, lengths: tuple[int, ...] = ()) -> torch.Tensor:
        self.counts["eager"] += 1
        return call(self.model)(ids, mask, lengths)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None, lengths: tuple[int, ...]) -> torch.Tensor:
        """Replayed where a checked graph serves, else eager with `zero_lora`'s skip (and a graph recorded or
        compared where one may be)."""
        layers = zero_lora.lora_linears(self.model)
        key = (tuple(ids.shape), mask is None, lengths)
        graph = self._graphs.get(key)
        if graph is not None and graph.state != self._state(layers):
            del self._graphs[key]  # a parameter moved or a layer was switched: record again
            graph = None
        checked = self._checked.get(key, set()) if graph is not None else set()
        zero, live = None, None
        if len(checked) < len(layers):
            zero = zero_lora.zero_layers(self.model)
            skipped = {id(layer) for layer in zero}
            live = {i for i, layer in enumerate(layers) if id(layer) not in skipped}
        if graph is not None and (live is None or live <= checked):
            self.counts["replayed"] += 1
            return self._replay(graph, ids, mask)
        with zero_lora.skipped(self.model, zero):
            logits = self.eager(ids, mask)
        if graph is None and (key not in self._seen or key in self.eager_only
                              or len(self._graphs) + len(self.eager_only) >= MAX_GRAPHS):
            self._seen.add(key)  # a shape is recorded at its second forward: one scored once costs no recording
            return logits
        try:
            if graph is None:
                if not self._room(logits):
                    self._refuse(key, f"too little free device memory to record ({ROOM} x its logits + "
                                      f"{RESERVE >> 30} GiB)")
                    return logits
                graph = self._capture(lambda i, m: call(self.model)(i, m, lengths), ids, mask)
                graph.state = self._state(layers)
                self.counts["recorded"] += 1
            same = torch.equal(_bits(self._replay(graph, ids, mask)), _bits(logits))
        except Exception as e:  # a forward that cannot be recorded (a host sync inside, no memory): eager
            self._refuse(key, f"recording failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            return logits
        if not same:
            self._refuse(key, "a replay differed from the eager forward")
            return logits
        self._graphs[key] = graph
        self._checked[key] = checked | (live or set())
        return logits

    def _room(self, logits: torch.Tensor) -> bool:
        return self._free_memory(logits.device) >= ROOM * logits.numel() * logits.element_size() + RESERVE

    def _refuse(self, key: Key, why: str) -> None:
        self._graphs.pop(key, None)
        self._checked.pop(key, None)
        self.eager_only[key] = why

    def _state(self, layers: list[Any]) -> tuple[Any, ...]:
        """What a recorded graph depends on beyond its inputs: each parameter's and buffer's storage (the tensors
        listed once: fixed after the load, as `HFTrainer._named`; a `.data` swapped in moves the address), each LoRA
        layer's switches."""
        if self._tensors is None:
            self._tensors = [*self.model.parameters(), *self.model.buffers()]
        return (tuple(t.data_ptr() for t in self._tensors), self.model.training,
                tuple((layer.disable_adapters, layer.merged, tuple(layer.active_adapters)) for layer in layers))

    @staticmethod
    def _replay(graph: _Graph, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        graph.ids.copy_(ids)
        if mask is not None and graph.mask is not None:
            graph.mask.copy_(mask)
        graph.graph.replay()
        return graph.logits

    def _cuda_capture(self, forward: Recorded, ids: torch.Tensor, mask: torch.Tensor | None) -> _Graph:
        """Record `forward` on a side stream (warmed once: its cuBLAS handle and workspace are made outside any
        graph); no device-wide sync and no cache flush (`torch.cuda.graph` does both)."""
        ids, mask = ids.clone(), mask.clone() if mask is not None else None
        current = torch.cuda.current_stream(ids.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(ids.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                forward(ids, mask)
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                logits = forward(ids, mask)
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        return _Graph(graph, ids, mask, logits, ())


def _cuda_free(device: torch.device) -> int:
    """Bytes the device can still give this process: the driver's free memory and what torch's cache holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
