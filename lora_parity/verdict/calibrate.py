"""The calibrated update (`perturbation.std: auto`): the B-noise std is searched on the trainer alone,
before anything reaches the sampler, until the trainer's own change is well above the trainer-sampler
noise that A measured, and not far above it.

The window (budgets with a noise rule, `lora_parity.verdict.thresholds`): the change (mean |trainer after −
trainer_start|) must land in [lower, ceiling × lower], lower = max(k · A, B.stimulus's threshold), A =
mean |zero − trainer_zero| (k: `perturbation.stimulus_factor`, ceiling: `NoiseRule.calibration_ceiling`).
From START_STD the std doubles until the change reaches the window (halves while it is above it), then
bisects geometrically between the last std below and the first above, at most WINDOW_STEPS forwards;
the first std inside is used, else the smallest change at or above lower, else the largest change.
Before the noise rule (older receipts): the first std of the ladder START_STD · GROWTH^i meeting
max(k · A, min_stimulus). Deterministic for a given seed: the noise is seeded per tensor.
`check` rechecks the rule from a receipt's recorded numbers and scores (`lora-parity verify`).
The rule only, pure: the search on a trainer (`on_trainer`) is `lora_parity.run.calibrate_trainer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lora_parity.evidence.receipt import Budgets, Calibration, CalibrationStep, Perturbation
from lora_parity.verdict.routes import SEARCH_KEY, TARGET_SEARCH_SUFFIX

START_STD = 2e-3
"""First std of the ladder."""
GROWTH = 2.0
"""Each step's std is the previous one's times this."""
MAX_STEPS = 8
"""Most trainer forwards one search may take (START_STD · GROWTH^7 = 0.256)."""
WINDOW_STEPS = 10
"""Most trainer forwards one window search may take."""
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


def search_window(measure: Callable[[float], float], a_mean: float, factor: float, lower: float, ceiling: float,
                  start: float = START_STD) -> Calibration:
    """Search the std whose `measure(std)` (the trainer change) lands in [goal, ceiling · goal],
    goal = max(factor · a_mean, lower): double (or halve) to bracket the window, then bisect
    geometrically; at most WINDOW_STEPS calls."""
    goal = target(a_mean, factor, lower)
    upper = ceiling * goal
    steps: list[CalibrationStep] = []
    below = above = None
    std = start
    for _ in range(WINDOW_STEPS):
        steps.append(CalibrationStep(std=std, trainer_change=measure(std)))
        change = steps[-1].trainer_change
        if goal <= change <= upper:
            break
        if change < goal:
            below = std
        else:
            above = std
        std = math.sqrt(below * above) if below is not None and above is not None else \
            std * GROWTH if above is None else std / GROWTH
    chosen = _chosen(steps, goal, upper)
    return Calibration(a_mean=a_mean, factor=factor, min_stimulus=lower, target=goal, upper=upper, start_std=start,
                       growth=GROWTH, max_steps=WINDOW_STEPS, steps=steps, std=chosen.std,
                       met=goal <= chosen.trainer_change <= upper)


def _chosen(steps: list[CalibrationStep], goal: float, upper: float) -> CalibrationStep:
    """The first step inside [goal, upper]; else the smallest change at or above goal (detectable first);
    else the largest change."""
    inside = [s for s in steps if goal <= s.trainer_change <= upper]
    if inside:
        return inside[0]
    over = [s for s in steps if s.trainer_change >= goal]
    if over:
        return min(over, key=lambda s: s.trainer_change)
    return max(steps, key=lambda s: s.trainer_change)


def stimulus_threshold(scores: dict[str, list[list[float]]], budgets: Budgets) -> float:
    """B.stimulus's threshold from the start point's scores (`thresholds.stimulus`): the window's floor."""
    from lora_parity.verdict import checks, thresholds

    comparisons = checks.compute_comparisons(scores, budgets)
    noise = thresholds.noise_model(scores, comparisons)
    return thresholds.stimulus(budgets, comparisons.get("A.trainer_vs_sampler"), noise).budget


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


def _window_problem(cal: Calibration, ceiling: float | None) -> str | None:
    """Why a window calibration's steps are not the ones `search_window` takes on its own recorded changes
    (`ceiling`: the budgets' calibration_ceiling)."""
    if cal.upper is None or not 1 <= len(cal.steps) <= WINDOW_STEPS or cal.max_steps != WINDOW_STEPS:
        return f"{len(cal.steps)} steps, outside 1..{WINDOW_STEPS}"
    if ceiling is None:
        return "a window search, but the budgets have no noise rule"
    if not math.isclose(cal.upper, ceiling * cal.target, rel_tol=1e-12):
        return "upper is not calibration_ceiling × target"
    changes = iter(cal.steps)

    def recorded(std: float) -> float:
        step = next(changes, None)
        if step is None or not math.isclose(step.std, std, rel_tol=1e-12):
            raise _Replay
        return step.trainer_change

    try:
        replay = search_window(recorded, cal.a_mean, cal.factor, cal.min_stimulus, ceiling, cal.start_std)
    except _Replay:
        return "the steps' stds are not the window search's (double to bracket, then bisect)"
    if len(replay.steps) != len(cal.steps):
        return "the search did not stop where the window search stops"
    if replay.std != cal.std or replay.met != cal.met:
        return "the chosen std is not the window search's choice"
    return None


class _Replay(Exception):
    """A recorded step is not the one the window search takes next."""


def check(cal: Calibration, std: float, scores: dict[str, list[list[float]]], changed: str,
          min_stimulus: float | None, ceiling: float | None = None) -> str | None:
    """Why a recorded calibration does not follow its rule, or None: the target from A's scores, a
    monotone bounded ladder, the chosen std (the update's `std`) the first that meets the target, and
    its change reproducing from scores trainer_zero → `changed`."""
    if "zero" in scores and "trainer_zero" in scores:
        a_mean = mean_change(scores["zero"], scores["trainer_zero"])
        if not math.isclose(cal.a_mean, a_mean, rel_tol=1e-9, abs_tol=1e-15):
            return f"a_mean {cal.a_mean:.6g} is not A's mean disagreement {a_mean:.6g}"
    if min_stimulus is not None and not math.isclose(cal.min_stimulus, min_stimulus, rel_tol=1e-12):
        return "min_stimulus is not the budgets' (B.stimulus's threshold, with the noise rule)"
    if not math.isclose(cal.target, target(cal.a_mean, cal.factor, cal.min_stimulus), rel_tol=1e-12):
        return "target is not max(factor · a_mean, min_stimulus)"
    problem = _ladder_problem(cal) if cal.upper is None else _window_problem(cal, ceiling)
    if problem is None and std != cal.std:
        problem = f"the update's std {std:g} is not the chosen std {cal.std:g}"
    if problem is None and "trainer_zero" in scores and changed in scores:
        change = mean_change(scores["trainer_zero"], scores[changed])
        chosen = next(s for s in cal.steps if s.std == cal.std)
        if not math.isclose(change, chosen.trainer_change, rel_tol=REL_TOL, abs_tol=1e-12):
            problem = f"the chosen std's trainer change {chosen.trainer_change:.6g} does not reproduce " \
                      f"from the scores ({change:.6g})"
        elif cal.met and change < cal.target * (1 - REL_TOL):
            problem = f"the trainer change {change:.6g} does not meet the target {cal.target:.6g}"
    return problem


def check_perturbation(p: Perturbation, scores: dict[str, list[list[float]]], budgets: Budgets) -> str | None:
    """Why the calibrations a perturbation record holds (the main one, each target's) do not follow
    their rule (the noise rule's window where the budgets have one, else the ladder), or None."""
    rule = budgets.noise
    if rule is None:
        floor, ceiling = budgets.min_stimulus, None
    else:
        start = {k: v for k, v in scores.items() if k in ("zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat",
                                                           "adapter_base", "base")}
        floor, ceiling = stimulus_threshold(start, budgets), rule.calibration_ceiling
    # With route replay the search replayed the zero pass's routes: its chosen change is in the scores so scored.
    updated = SEARCH_KEY if SEARCH_KEY in scores else "trainer_updated"
    if p.calibration is not None:
        chosen = p.learning_rate if p.calibration.searched == "learning_rate" else p.std
        problem = check(p.calibration, chosen if chosen is not None else math.nan, scores, updated, floor, ceiling)
        if problem:
            return f"perturbation.calibration: {problem}"
    for kind, cal in (p.target_calibrations or {}).items():
        searched = f"target.{kind}{TARGET_SEARCH_SUFFIX}"
        problem = check(cal, cal.std, scores, searched if searched in scores else f"target.{kind}.trainer", floor,
                        ceiling)
        if problem:
            return f"perturbation.target_calibrations.{kind}: {problem}"
    return None
