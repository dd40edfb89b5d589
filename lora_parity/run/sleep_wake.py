"""Sleep and wake after the sync (issue 44; docs/deployment.md, "Sleep and wake"): for each sleep level the run asks
for (`sampler.sleep_levels`, `--sleep-levels`) at which the sampler's engine sleeps (`backends.sleep.SleepingSampler`),
the sampler goes through what a colocated RL loop does around a sync (TRL's `sync_weights` in sleep mode, verl's
rollout wake-up), in two phases:

- `sleep_wake.levelN`: sleep(N) -> wake_up(["weights"]) -> at level 2, the base weights the sleep discarded reloaded
  from the checkpoint (`reset_base`) -> the sync: the trainer's current adapter published as the run's sync mode
  publishes it, a new version -> wake_up(["kv_cache"]) -> score. Where the user's loop wakes everything at once
  (`--loop wake=all`, `models.loop`): sleep(N) -> wake_up() -> the base reload -> the sync -> score.
- `wake_again.levelN`: sleep(N) -> wake_up() -> at level 2, the loop's restore: the base reloaded, then the current
  version put back, with no new weights (`SyncMode.restore`: its folder under a new name and id where the mode keeps a
  name per version, in place under its own in `inplace`, the merged weights reloaded) -> score.

The trainer has not moved since `updated` was scored (per-target coverage comes after), so both phases must give
`updated`'s scores within the sampler's repeat noise (`verdict.sleep_wake`, checks W.*). The sleep faults
(`sleep_faults`) act at the seams marked here."""

from __future__ import annotations

import functools
from typing import Any

from lora_parity.backends.base import BaseResettingSampler
from lora_parity.backends.sleep import KV_CACHE, WEIGHTS, SleepingSampler
from lora_parity.util.errors import ConfigError
from lora_parity.verdict.lifecycle import SLEEP_PHASES


def parse_levels(text: str | None) -> tuple[int, ...] | None:
    """`--sleep-levels`: comma-separated levels among 1 and 2, or `none`; None (not given): the config's."""
    if text is None:
        return None
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        levels = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        levels = ()
    if not levels or not set(levels) <= set(SLEEP_PHASES):
        raise ConfigError(f"--sleep-levels {text!r}: expected levels among 1 and 2, comma-separated (e.g. 1,2), "
                          "or none")
    return levels


def levels(run: Any) -> tuple[int, ...]:
    """The sleep levels this run exercises: those asked that the sampler's engine sleeps at; level 2 also needs a
    sampler that loads its base weights again (`BaseResettingSampler`), as the loop does after the wake."""
    sampler = run.sampler
    if sampler.traits.sleep_unavailable is not None or not isinstance(sampler, SleepingSampler):
        return ()
    can = set(sampler.sleep_levels)
    return tuple(level for level in sorted(set(run.cfg.sampler.sleep_levels)) if level in can
                 and (level == 1 or isinstance(sampler, BaseResettingSampler)))


def after_sync(run: Any) -> None:
    """Both phases of every level this run exercises (`levels`), level 1 first."""
    for level in levels(run):
        first, again = SLEEP_PHASES[level]
        run.step(first, functools.partial(sleep_sync_wake, run, level))
        run.step(again, functools.partial(wake_again, run, level))


def _engine(run: Any) -> SleepingSampler:
    sampler = run.sampler
    assert isinstance(sampler, SleepingSampler)
    return sampler


def sleep_sync_wake(run: Any, level: int) -> None:
    """sleep -> wake the weights -> (level 2: reload the base) -> sync a new version -> wake the KV cache -> score;
    where the user's loop wakes everything at once (`sampler.loop.wake` "all"), the wake comes whole before the base
    reload and the sync."""
    engine = _engine(run)
    engine.sleep(level)
    asleep = [WEIGHTS, KV_CACHE]
    try:
        if run.cfg.sampler.loop.wake == "all":
            engine.wake_up()
            asleep.clear()
        else:
            engine.wake_up([asleep.pop(0)])
        _reload_base(run, level)
        run.mode.publish(run, version=len(run.adapters), label=f"-sleep{level}")
        if asleep:
            engine.wake_up([asleep.pop(0)])
    finally:  # a failed sync never leaves the engine asleep: the run's retire, and a next run on it, need it awake
        if asleep:
            engine.wake_up(asleep)
    _score(run, SLEEP_PHASES[level][0], level)


def wake_again(run: Any, level: int) -> None:
    """sleep -> wake everything -> (level 2: reload the base, put the current weights back) -> score."""
    engine = _engine(run)
    engine.sleep(level)
    engine.wake_up()
    if level == 2:
        _reload_base(run, level)
        run.mode.restore(run)
    _score(run, SLEEP_PHASES[level][1], level)


def retire(run: Any) -> None:
    """Where the injected fault skipped the base reload after a level-2 sleep (level2-base-lost), reload it now, as
    the merged modes' retire gives the checkpoint's weights back: a next run on this engine (the selftest's) must meet
    them, not the weights the sleep discarded."""
    if run.faults.skips_base_reload(2) and any(p.name == SLEEP_PHASES[2][0] for p in run.phases):
        _resetting(run.sampler).reset_base()


def _reload_base(run: Any, level: int) -> None:
    """After a level-2 wake the loop reloads the base weights the sleep discarded, from the checkpoint (not where the
    injected fault skips it: level2-base-lost)."""
    if level == 2 and not run.faults.skips_base_reload(level):
        _resetting(run.sampler).reset_base()


def _score(run: Any, key: str, level: int) -> None:
    """The engine, awake, scores the probes under the current version (where a fault is planted: after the wake)."""
    run.faults.after_wake(run.sampler)
    run.sampler_score(key, run.faults.woken_handle(run.handle, level))


def _resetting(sampler: object) -> BaseResettingSampler:
    """`sampler` as a `BaseResettingSampler` (`levels` ran level 2 only for one)."""
    assert isinstance(sampler, BaseResettingSampler), type(sampler).__name__
    return sampler
