"""Checks of sleep and wake (`run.sleep_wake`; docs/deployment.md, "Sleep and wake"): after a sleep at level N, a sync
and a wake (`W.sleep_wake.levelN`), and after a second sleep and wake without a sync (`W.wake_again.levelN`), the
engine must score the synced adapter as it did before the sleep (`updated`: the trainer has not moved since), within
the sampler's repeat noise (the bound of `D.base_kept`). Where a check fails, its reason says what the scores match
instead, from the same raw scores: the base model's (the adapter no longer applies, or the checkpoint's weights were
reloaded over the merged ones), the stale adapter's, or nothing the run scored (weights a level-2 sleep discarded and
nothing restored). Sync group. Pure: `verify` recomputes everything here; receipts made before have no sleep phases
and so no W checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import ComparisonStats
from lora_parity.verdict.lifecycle import SLEEP_PHASES

PHASES = [(level, name) for level, names in sorted(SLEEP_PHASES.items()) for name in names]
"""(level, phase) of every sleep phase; each phase's scores are recorded under its name."""
EXPLAINS = ("base", "adapter_base", "stale")
"""The scores a failing phase's may match instead (the base route's first scores, or the stale adapter's)."""
COMPARISONS: dict[str, tuple[str, str]] = {
    **{f"W.{name}_vs_updated": ("updated", name) for _, name in PHASES},
    **{f"W.{name}_vs_{other}": (other, name) for _, name in PHASES for other in EXPLAINS},
}
WHAT = {"sleep_wake": "the synced adapter after a level-{level} sleep, a sync and a wake",
        "wake_again": "the synced adapter after a second level-{level} sleep and wake, without a sync"}


def check_ids(comparisons: Mapping[str, ComparisonStats]) -> list[str]:
    """The checks this run makes: the sleep phases it scored."""
    return [f"W.{name}" for _, name in PHASES if f"W.{name}_vs_updated" in comparisons]


def add_checks(c: Any, comparisons: Mapping[str, ComparisonStats], thresholds: Mapping[str, Any]) -> None:
    """W.sleep_wake.levelN, W.wake_again.levelN: the synced adapter's scores before the sleep, within the bound."""
    levels = {name: level for level, name in PHASES}
    for check_id in check_ids(comparisons):
        name = check_id.removeprefix("W.")
        cmp, t = comparisons[f"W.{name}_vs_updated"], thresholds[check_id]
        what = WHAT[name.partition(".")[0]].format(level=levels[name])
        c.add(check_id, f"{what} scores as before the sleep", cmp.max_abs, "<=", t.budget,
              reason(name, levels[name], comparisons, t.budget), note=t.note, n=cmp.n)


def reason(name: str, level: int, comparisons: Mapping[str, ComparisonStats], budget: float) -> str:
    """Why phase `name` (at sleep `level`) scores otherwise than before the sleep, from what its scores match."""
    def matches(other: str) -> bool:
        cross = comparisons.get(f"W.{name}_vs_{other}")
        return cross is not None and cross.max_abs <= budget

    if matches("base") or matches("adapter_base"):  # at zero-init the stale adapter scores as the base model too
        return ("after the wake the adapter no longer applies: the engine gives its base model's scores (vllm #53888; "
                "in a merged sync, the checkpoint's weights reloaded over the synced ones: TRL #5312)")
    if matches("stale"):
        return "after the wake the engine gives the stale scores: the version before the sync serves again"
    if level == 2:
        return ("after the level-2 wake the engine's weights are not those it had before the sleep, which discarded "
                "them: the base or the adapter was not restored (verl #7289, #7304; vllm #39934)")
    return ("after the level-1 wake the engine scores otherwise than before the sleep, which kept its weights "
            "(vllm #53888)")
