"""The calibrated update run on the trainer alone (`perturbation.std: auto`, `--update step`): the
search of `lora_parity.verdict.calibrate` (its rule, window and recheck) driven by real trainer forwards,
before anything reaches the sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lora_parity.backends.base import SteppingTrainer
from lora_parity.evidence.receipt import Calibration
from lora_parity.verdict import calibrate

if TYPE_CHECKING:
    from lora_parity.backends.base import Trainer
    from lora_parity.models.config import ModelConfig


class _NoStd(Exception):
    """The trainer's update is not B noise: there is no std to calibrate."""


def _search_trainer(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
                    cfg: ModelConfig, only: str | None, start: float,
                    steps: bool = False) -> tuple[Calibration, list[list[float]]] | None:
    """`calibrate.search` (or `search_window`) on the trainer; the calibration and the trainer's scores at
    its last step (the chosen std), with the trainer left there. None for a trainer whose update is not B
    noise. With `steps` (`--update step`) the search varies the optimizer step's learning rate instead, in
    the same window."""
    before = scores["trainer_zero"]
    last: list[list[list[float]]] = []

    def measure(value: float) -> float:
        trainer.zero_b()
        if steps:
            assert isinstance(trainer, SteppingTrainer)
            trainer.step(sequences, value, seed, only=only)
        elif trainer.perturb(value, seed, only=only).kind != "lora_b_noise":
            raise _NoStd
        last[:] = [trainer.score(sequences)]
        return calibrate.mean_change(before, last[0])

    a_mean = calibrate.mean_change(scores["zero"], before)
    rule = cfg.budgets.noise
    try:
        if rule is None:
            found = calibrate.search(measure, a_mean, cfg.perturbation.stimulus_factor, cfg.budgets.min_stimulus, start)
        else:
            lower = calibrate.stimulus_threshold(scores, cfg.budgets)
            found = calibrate.search_window(measure, a_mean, cfg.perturbation.stimulus_factor, lower,
                                            rule.calibration_ceiling, start)
        if found.std != found.steps[-1].std:  # the trainer is left at the chosen value, not the last tried
            measure(found.std)
    except _NoStd:
        return None
    if steps:
        found = found.model_copy(update={"searched": "learning_rate"})
    return found, last[0]


def on_trainer(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
               cfg: ModelConfig, only: str | None = None, start: float | None = None,
               steps: bool = False) -> Calibration | None:
    """`calibrate.search` from `start` with the trainer alone (zero B, perturb(std, seed, only), score), from the
    recorded scores zero and trainer_zero; leaves B zero. Per-target coverage starts from the whole
    update's std: one target alone moves the model less than all of them together. None for a trainer
    whose update is not B noise (an optimizer step: std does not apply). With `steps` the learning
    rate of `--update step` is searched (from `perturbation.start_learning_rate`), in the window."""
    if start is None:
        start = cfg.perturbation.start_learning_rate if steps else calibrate.START_STD
    try:
        found = _search_trainer(trainer, sequences, scores, seed, cfg, only, start, steps)
        return found[0] if found is not None else None
    finally:
        trainer.zero_b()


def on_trainer_kept(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
                    cfg: ModelConfig, only: str, start: float,
                    steps: bool = False) -> tuple[Calibration, list[list[float]]] | None:
    """As `on_trainer` for one target kind `only`, but the trainer is left at the chosen std (B zero,
    then perturb(std, seed, only)) and its scores there are returned with the calibration: the search's
    last forward already is the per-target trainer score, so it is not run twice. B is left zero when
    the search raises or finds no std."""
    found = None
    try:
        found = _search_trainer(trainer, sequences, scores, seed, cfg, only, start, steps)
        return found
    finally:
        if found is None:
            trainer.zero_b()


def search_target(run: Any, kind: str, tag: str) -> list[list[float]] | None:
    """Target `kind`'s std search for `phases.Run` `run` (recorded under `tag` in its target calibrations); the
    trainer's scores at the chosen std, where it is left (None: no search, B zero)."""
    first = run.cfg.perturbation.start_learning_rate if run.steps else calibrate.START_STD
    start = run.calibration.std if run.calibration is not None else first
    found = on_trainer_kept(run.trainer, run.sequences, run.scores, run.seed, run.cfg, kind, start, steps=run.steps)
    if found is None:
        return None
    run.target_calibrations[tag] = found[0]
    if run.perturbation is not None:
        run.perturbation = run.perturbation.model_copy(update={"target_calibrations": dict(run.target_calibrations)})
    return found[1]
