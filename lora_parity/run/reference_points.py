"""The fp32 reference where each judgement after a change is made: the trainer's tensors are kept at the updated
point and at each per-target point (`snapshot`) and scored in fp32 in one load at the end of the run (`score`):
`reference_fp32_updated` and `target.K.reference` (`deltas.reference_at`). The scorers: `reference_scorers`."""

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

    def _timed(self, key: str, fn: Callable[[], T]) -> T: ...

    def _record(self, key: str, scores: Any) -> None: ...

UPDATED = "reference_fp32_updated"


def applies(run: Run) -> bool:
    """The start point's reference is scored, a scorer with tensors was given, and the trainer's tensors
    can be read."""
    return run.reference is not None and run.reference_points is not None and isinstance(
        run.trainer, TensorReadingTrainer)


def snapshot(run: Run, key: str) -> None:
    """Keep the trainer's current LoRA tensors for the reference scored under `key`."""
    if applies(run):
        assert isinstance(run.trainer, TensorReadingTrainer)
        run.reference_states[key] = run.trainer.lora_tensors()


def score(run: Run) -> None:
    """Score every kept point in fp32 (one load) and record each under its key."""
    assert run.reference_points is not None
    keys = list(run.reference_states)
    scorer = run.reference_points
    scored = run._timed(UPDATED, lambda: scorer(run.sequences, [run.reference_states[k] for k in keys]))
    for key, scores in zip(keys, scored, strict=True):
        run._record(key, scores)
    run.reference_states.clear()
