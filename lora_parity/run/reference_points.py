"""The fp32 reference: at the start point (`start_scorer`, the base model with the start adapter), and where
each judgement after a change is made: the trainer's tensors are kept at the updated point and at each
per-target point (`snapshot`) and scored in fp32 in one load at the end of the run (`score`):
`reference_fp32_updated` and `target.K.reference` (`checks.reference_at`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity.backends.base import TensorReadingTrainer
from lora_parity.evidence.receipt import sha256_json
from lora_parity.run import preflight, start_adapter

if TYPE_CHECKING:
    from lora_parity.run.phases import Run
    from lora_parity.run.runner import Backends, Plan

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


def start_scorer(plan: Plan, loaded: Backends, warm_folder: Path | None) -> Callable[[list[list[int]]], Any] | None:
    """The start point's fp32 scorer where `reference_decision` says to score it (kept in `loaded.reference`);
    it carries the start adapter: the user's, or the warm start the sequence writes (`warm_folder`)."""
    model_dir = loaded.model_dir

    def measure() -> tuple[int, int]:
        from lora_parity.backends.hf import fp32_reference_memory

        assert model_dir is not None
        return fp32_reference_memory(model_dir)

    loaded.reference = preflight.reference_decision(plan.opts.reference, model_dir is not None,
                                                    plan.cfg.model.dtype, measure)
    if loaded.reference.status != "scored" or model_dir is None:
        return None
    from lora_parity.backends.hf import fp32_reference

    adapter = plan.opts.adapter or warm_folder
    score = fp32_reference(plan.cfg, model_dir, adapter)

    def once_per_probe_set(sequences: list[list[int]]) -> Any:
        # The reference depends on the checkpoint, the start adapter and the tokens only: every run of a
        # selftest on one load scores each probe set from each start point once (it loads the fp32 model).
        key = sha256_json([sequences, start_adapter.digest(adapter) if adapter is not None else None])
        if key not in loaded.reference_scores:
            loaded.reference_scores[key] = score(sequences)
        return loaded.reference_scores[key]

    return once_per_probe_set


def points_scorer(plan: Plan, loaded: Backends) -> Callable[..., Any] | None:
    """The fp32 scorer of the trainer's tensors (`fp32_points`) wherever the start point's reference is scored."""
    if loaded.reference is None or loaded.reference.status != "scored" or loaded.model_dir is None:
        return None
    from lora_parity.backends.fp32_points import fp32_points

    return fp32_points(plan.cfg, loaded.model_dir)
