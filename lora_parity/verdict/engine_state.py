"""The engine's state after a sync (`run.engine_state`; docs/verdicts.md, "The engine after the sync"): its base
route must give its first base scores again after the sync and after per-target coverage (`D.base_kept`,
`D.base_kept.coverage`), and the version the sync replaced, scored while the new one is live, its stale scores
(`D.old_kept`); each within the sampler's own repeat noise (bit for bit where it repeats itself exactly). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import ComparisonStats

COMPARISONS: dict[str, tuple[str, str]] = {
    "D.base_vs_after_sync": ("base", "base_after_sync"),
    "D.adapter_base_vs_after_sync": ("adapter_base", "base_after_sync"),
    "D.base_vs_after_coverage": ("base", "base_after_coverage"),
    "D.adapter_base_vs_after_coverage": ("adapter_base", "base_after_coverage"),
    "D.stale_vs_old_after_sync": ("stale", "old_after_sync"),
    "D.updated_vs_old_after_sync": ("updated", "old_after_sync"),
}
"""With `--adapter` (or a warm start) the base route's first scores are `adapter_base`."""
CHECKS = {"D.base_kept": ("D.base_vs_after_sync", "D.adapter_base_vs_after_sync"),
          "D.base_kept.coverage": ("D.base_vs_after_coverage", "D.adapter_base_vs_after_coverage"),
          "D.old_kept": ("D.stale_vs_old_after_sync",)}
"""Check id -> the comparisons it judges (the first that was made)."""


def check_ids(comparisons: Mapping[str, ComparisonStats]) -> list[str]:
    """The checks this run makes: those whose phases were scored."""
    return [i for i, names in CHECKS.items() if any(n in comparisons for n in names)]


def add_checks(c: Any, comparisons: Mapping[str, ComparisonStats], thresholds: Mapping[str, Any]) -> None:
    """D.base_kept, D.base_kept.coverage, D.old_kept: within the sampler's repeat noise."""
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
            when = "the sync" if check_id == "D.base_kept" else "per-target coverage"
            c.add(check_id, f"the engine's base model after {when} gives its first base scores", cmp.max_abs,
                  "<=", t.budget, f"{when} changed the engine's base model", note=t.note, n=cmp.n)
