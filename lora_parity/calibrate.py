"""The calibrated update (`perturbation.std: auto`): the B-noise std is searched on the trainer alone,
before anything reaches the sampler, until the trainer's own change is well above the trainer-sampler
noise that A measured.

The target is max(k · A, min_stimulus), A = mean |zero − trainer_zero| (k: `perturbation.stimulus_factor`).
The ladder is START_STD · GROWTH^i for i < MAX_STEPS; the first std whose trainer change (mean |trainer
after − trainer_zero|) meets the target is used; if none does, the last one is, and B's stimulus check
says whether that is enough. Deterministic for a given seed: the noise is seeded per tensor.
`check` rechecks the rule from a receipt's recorded numbers and scores (`lora-parity verify`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lora_parity.receipt import Calibration, CalibrationStep, Perturbation

if TYPE_CHECKING:
    from lora_parity.backends.base import Trainer
    from lora_parity.config import ModelConfig

START_STD = 2e-3
"""First std of the ladder."""
GROWTH = 2.0
"""Each step's std is the previous one's times this."""
MAX_STEPS = 8
"""Most trainer forwards one search may take (START_STD · GROWTH^7 = 0.256)."""
REL_TOL = 1e-3
"""Tolerance between a change measured during the search and the same change recomputed from the
recorded scores (the same forward, run again; absorbs kernel non-determinism of the trainer)."""

ScoreArray = Sequence[Sequence[float]]


def mean_change(before: ScoreArray, after: ScoreArray) -> float:
    """Mean |after − before| over every scored position."""
    diffs = [abs(b - a) for row_a, row_b in zip(before, after, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    return math.fsum(diffs) / len(diffs) if diffs else 0.0


def target(a_mean: float, factor: float, min_stimulus: float) -> float:
    """The trainer change the search aims for: k times A's mean disagreement, and at least min_stimulus."""
    return max(factor * a_mean, min_stimulus)


def search(measure: Callable[[float], float], a_mean: float, factor: float, min_stimulus: float,
           start: float = START_STD) -> Calibration:
    """Walk the std ladder from `start`, `measure(std)` giving the trainer change at each std, until
    one meets the target; at most MAX_STEPS calls."""
    goal = target(a_mean, factor, min_stimulus)
    steps: list[CalibrationStep] = []
    for i in range(MAX_STEPS):
        std = start * GROWTH**i
        steps.append(CalibrationStep(std=std, trainer_change=measure(std)))
        if steps[-1].trainer_change >= goal:
            break
    return Calibration(a_mean=a_mean, factor=factor, min_stimulus=min_stimulus, target=goal, start_std=start,
                       growth=GROWTH, max_steps=MAX_STEPS, steps=steps, std=steps[-1].std,
                       met=steps[-1].trainer_change >= goal)


class _NoStd(Exception):
    """The trainer's update is not B noise: there is no std to calibrate."""


def _search_trainer(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
                    cfg: ModelConfig, only: str | None, start: float) -> tuple[Calibration, list[list[float]]] | None:
    """`search` on the trainer; the calibration and the trainer's scores at its last step (the chosen
    std), with the trainer left there. None for a trainer whose update is not B noise."""
    before = scores["trainer_zero"]
    last: list[list[list[float]]] = []

    def measure(std: float) -> float:
        trainer.zero_b()
        if trainer.perturb(std, seed, only=only).kind != "lora_b_noise":
            raise _NoStd
        last[:] = [trainer.score(sequences)]
        return mean_change(before, last[0])

    try:
        found = search(measure, mean_change(scores["zero"], before), cfg.perturbation.stimulus_factor,
                       cfg.budgets.min_stimulus, start)
    except _NoStd:
        return None
    return found, last[0]


def on_trainer(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
               cfg: ModelConfig, only: str | None = None, start: float = START_STD) -> Calibration | None:
    """`search` from `start` with the trainer alone (zero B, perturb(std, seed, only), score), from the
    recorded scores zero and trainer_zero; leaves B zero. Per-target coverage starts from the whole
    update's std: one target alone moves the model less than all of them together. None for a trainer
    whose update is not B noise (an optimizer step: std does not apply)."""
    try:
        found = _search_trainer(trainer, sequences, scores, seed, cfg, only, start)
        return found[0] if found is not None else None
    finally:
        trainer.zero_b()


def on_trainer_kept(trainer: Trainer, sequences: list[list[int]], scores: dict[str, list[list[float]]], seed: int,
                    cfg: ModelConfig, only: str, start: float) -> tuple[Calibration, list[list[float]]] | None:
    """As `on_trainer` for one target kind `only`, but the trainer is left at the chosen std (B zero,
    then perturb(std, seed, only)) and its scores there are returned with the calibration: the search's
    last forward already is the per-target trainer score, so it is not run twice. B is left zero when
    the search raises or finds no std."""
    found = None
    try:
        found = _search_trainer(trainer, sequences, scores, seed, cfg, only, start)
        return found
    finally:
        if found is None:
            trainer.zero_b()


def _ladder_problem(cal: Calibration) -> str | None:
    if not 1 <= len(cal.steps) <= cal.max_steps or cal.max_steps > MAX_STEPS:
        return f"{len(cal.steps)} steps, outside 1..{min(cal.max_steps, MAX_STEPS)}"
    if cal.growth <= 1 or cal.start_std <= 0:
        return "the ladder does not grow"
    expected = [cal.start_std * cal.growth**i for i in range(len(cal.steps))]
    if not all(math.isclose(s.std, e, rel_tol=1e-12) for s, e in zip(cal.steps, expected, strict=True)):
        return "the steps' stds are not the ladder start_std · growth^i"
    if any(s.trainer_change >= cal.target for s in cal.steps[:-1]):
        return "a step before the chosen one already met the target"
    if cal.std != cal.steps[-1].std or cal.met != (cal.steps[-1].trainer_change >= cal.target):
        return "the chosen std is not the first that meets the target (or the last step)"
    if not cal.met and len(cal.steps) != cal.max_steps:
        return "the search stopped before meeting the target or reaching max_steps"
    return None


def check(cal: Calibration, std: float, scores: dict[str, list[list[float]]], changed: str,
          min_stimulus: float | None) -> str | None:
    """Why a recorded calibration does not follow its rule, or None: the target from A's scores, a
    monotone bounded ladder, the chosen std (the update's `std`) the first that meets the target, and
    its change reproducing from scores trainer_zero → `changed`."""
    if "zero" in scores and "trainer_zero" in scores:
        a_mean = mean_change(scores["zero"], scores["trainer_zero"])
        if not math.isclose(cal.a_mean, a_mean, rel_tol=1e-9, abs_tol=1e-15):
            return f"a_mean {cal.a_mean:.6g} is not A's mean disagreement {a_mean:.6g}"
    if min_stimulus is not None and cal.min_stimulus != min_stimulus:
        return "min_stimulus is not the budgets'"
    if not math.isclose(cal.target, target(cal.a_mean, cal.factor, cal.min_stimulus), rel_tol=1e-12):
        return "target is not max(factor · a_mean, min_stimulus)"
    problem = _ladder_problem(cal)
    if problem is None and std != cal.std:
        problem = f"the update's std {std:g} is not the chosen std {cal.std:g}"
    if problem is None and "trainer_zero" in scores and changed in scores:
        change = mean_change(scores["trainer_zero"], scores[changed])
        if not math.isclose(change, cal.steps[-1].trainer_change, rel_tol=REL_TOL, abs_tol=1e-12):
            problem = f"the chosen std's trainer change {cal.steps[-1].trainer_change:.6g} does not reproduce " \
                      f"from the scores ({change:.6g})"
        elif cal.met and change < cal.target * (1 - REL_TOL):
            problem = f"the trainer change {change:.6g} does not meet the target {cal.target:.6g}"
    return problem


def check_perturbation(p: Perturbation, scores: dict[str, list[list[float]]], min_stimulus: float | None) -> str | None:
    """Why the calibrations a perturbation record holds (the main one, each target's) do not follow
    their rule, or None."""
    if p.calibration is not None:
        problem = check(p.calibration, p.std, scores, "trainer_updated", min_stimulus)
        if problem:
            return f"perturbation.calibration: {problem}"
    for kind, cal in (p.target_calibrations or {}).items():
        problem = check(cal, cal.std, scores, f"target.{kind}.trainer", min_stimulus)
        if problem:
            return f"perturbation.target_calibrations.{kind}: {problem}"
    return None
