"""The references where each judgement after a change is made: the trainer's tensors are kept at the updated
point and at each per-target point (`snapshot`) and scored in one load at the end of the run. The fp32 reference
(`score`): `reference_fp32_updated` and `target.K.reference` (`deltas.reference_at`). The exact reference
(`score_exact`, where the sampler can be mirrored bit for bit), at the start point too: `exact.zero`,
`exact.updated`, `exact.target.K` (`verdict.exact_reference`). The scorers: `reference_scorers`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from lora_parity.backends.base import TensorReadingTrainer, Trainer
from lora_parity.models.fresh_adapter import RawTensor

T = TypeVar("T")


class Run(Protocol):
    """What these steps read and record of `phases.Run`."""

    trainer: Trainer
    sequences: list[list[int]]
    reference: Callable[[list[list[int]]], Any] | None
    reference_points: Callable[..., Any] | None
    reference_states: dict[str, dict[str, RawTensor]]
    exact_points: Callable[..., Any] | None
    exact_states: dict[str, dict[str, RawTensor]]
    replay: Any

    def _timed(self, key: str, fn: Callable[[], T]) -> T: ...

    def _record(self, key: str, scores: Any) -> None: ...

UPDATED = "reference_fp32_updated"
EXACT = "exact."
"""The exact reference's score keys: this, then the point (`zero`, `updated`, `target.K`)."""


def applies(run: Run) -> bool:
    """The start point's reference is scored, a scorer with tensors was given, and the trainer's tensors
    can be read."""
    return run.reference is not None and run.reference_points is not None and isinstance(
        run.trainer, TensorReadingTrainer)


def snapshot(run: Run, point: str) -> None:
    """Keep the trainer's current LoRA tensors for the references at `point`: `zero` (the start point: the exact
    reference only), `updated`, or `target.K`."""
    if not isinstance(run.trainer, TensorReadingTrainer):
        return
    fp32 = applies(run) and point != "zero"
    exact = run.exact_points is not None
    if not (fp32 or exact):
        return
    tensors = run.trainer.lora_tensors()
    if fp32:
        run.reference_states[UPDATED if point == "updated" else f"{point}.reference"] = tensors
    if exact:
        run.exact_states[f"{EXACT}{point}"] = tensors


def score(run: Run) -> None:
    """Score every kept point in fp32 (one load) and record each under its key; with route replay, each point
    replays the routes of the engine's pass there (`route_replay.source_of`)."""
    assert run.reference_points is not None
    _score_kept(run, run.reference_points, run.reference_states, UPDATED, replays=run.replay.on)


def score_exact(run: Run, which: str = "") -> None:
    """Score every point kept so far with the exact reference (one load) and record each under its key (`which`
    names a later batch's timing: the per-layer points, scored after the rest)."""
    assert run.exact_points is not None
    _score_kept(run, run.exact_points, run.exact_states, f"exact_reference{'_' + which if which else ''}")


def _score_kept(run: Run, scorer: Callable[..., Any], states: dict[str, dict[str, RawTensor]], timing: str,
                replays: bool = False) -> None:
    keys = list(states)
    routes = [run.replay.table(k, run.sequences, trainer=False) for k in keys] if replays else None
    scored = run._timed(timing, lambda: scorer(run.sequences, [states[k] for k in keys], *([routes] if routes else [])))
    for key, scores in zip(keys, scored, strict=True):
        run._record(key, scores)
    states.clear()
