"""The engine's state after a sync (`run.engine_state`; docs/verdicts.md, "The engine after the sync"): its base
route must give its first base scores again after the sync and after per-target coverage (`D.base_kept`,
`D.base_kept.coverage`), and, in the merged modes, once the run gave the sampler its checkpoint's base weights back
(`D.base_restored`); the version the sync replaced, scored while the new one is live, its stale scores
(`D.old_kept`); each within the sampler's own repeat noise (bit for bit where it repeats itself exactly). And the
routes mixed in one batch after the sync (`mixed_batch`, M.*), and the synced adapter after sleep and wake
(`sleep_wake`, W.*). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import ComparisonStats
from lora_parity.verdict import mixed_batch, sleep_wake

COMPARISONS: dict[str, tuple[str, str]] = {
    "D.base_vs_after_sync": ("base", "base_after_sync"),
    "D.adapter_base_vs_after_sync": ("adapter_base", "base_after_sync"),
    "D.base_vs_after_coverage": ("base", "base_after_coverage"),
    "D.adapter_base_vs_after_coverage": ("adapter_base", "base_after_coverage"),
    "D.base_vs_after_restore": ("base", "base_after_restore"),
    "D.adapter_base_vs_after_restore": ("adapter_base", "base_after_restore"),
    "D.stale_vs_old_after_sync": ("stale", "old_after_sync"),
    "D.updated_vs_old_after_sync": ("updated", "old_after_sync"),
    **mixed_batch.COMPARISONS,
    **sleep_wake.COMPARISONS,
}
"""With `--adapter` (or a warm start) the base route's first scores are `adapter_base`."""
CHECKS = {"D.base_kept": ("D.base_vs_after_sync", "D.adapter_base_vs_after_sync"),
          "D.base_kept.coverage": ("D.base_vs_after_coverage", "D.adapter_base_vs_after_coverage"),
          "D.base_restored": ("D.base_vs_after_restore", "D.adapter_base_vs_after_restore"),
          "D.old_kept": ("D.stale_vs_old_after_sync",)}
"""Check id -> the comparisons it judges (the first that was made). Receipts made before a check's phase simply
lack its comparisons, so `verify` does not make it."""
BASE_CHECKS = {"D.base_kept": ("the engine's base model after the sync", "the sync changed the engine's base model"),
               "D.base_kept.coverage": ("the engine's base model after per-target coverage",
                                        "per-target coverage changed the engine's base model"),
               "D.base_restored": ("the engine's base model after the run",
                                   "the engine did not get its base weights back after the run")}
"""The base route's checks: what was scored, and the failing reason."""


def check_ids(comparisons: Mapping[str, ComparisonStats]) -> list[str]:
    """The checks this run makes: those whose phases were scored."""
    return [i for i, names in CHECKS.items() if any(n in comparisons for n in names)]


def add_checks(c: Any, comparisons: Mapping[str, ComparisonStats], thresholds: Mapping[str, Any]) -> None:
    """D.base_kept, D.base_kept.coverage, D.base_restored, D.old_kept: within the sampler's repeat noise; then the
    mixed batch's M.* (`mixed_batch`) and sleep and wake's W.* (`sleep_wake`)."""
    for check_id in check_ids(comparisons):
        cmp = next(comparisons[n] for n in CHECKS[check_id] if n in comparisons)
        t = thresholds[check_id]
        if check_id == "D.old_kept":
            follows = comparisons.get("D.updated_vs_old_after_sync")
            new = follows is not None and follows.max_abs <= t.budget
            c.add(check_id, "the replaced version, scored after the sync, still gives its stale scores",
                  cmp.max_abs, "<=", t.budget, "an old adapter's name serves " + (
                      "the new weights" if new else "other weights than it was published with"), note=t.note, n=cmp.n)
        else:
            what, reason = BASE_CHECKS[check_id]
            c.add(check_id, f"{what} gives its first base scores", cmp.max_abs, "<=", t.budget, reason,
                  note=t.note, n=cmp.n)
    mixed_batch.add_checks(c, comparisons, thresholds)
    sleep_wake.add_checks(c, comparisons, thresholds)
