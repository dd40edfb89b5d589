"""Re-judge a `selftest --seeds` folder's receipts under a newer noise rule, from their raw scores.

    python scripts/rejudge-seeds.py [NAME=]DIR[,DIR...] ...   (each DIR holds seed-NN/clean.json, seed-NN/fault-*.json;
                                                              NAME=: the folders pooled under one name)

Each receipt is verified as it was made, then its checks and verdicts are derived again from the same raw
scores with `budgets.noise.own_tail`, `max_as_at_start` and `fp32_balance` as the bf16 profile sets them now and
judged as the selftest judges: the clean run must pass, each fault must be caught by its declared checks.
Prints one line per argument (false alarms, faults caught in every seed) and every run whose judgement
changed. Nothing is re-run and no receipt is written: this shows what the newer rule says of the same
measurements.
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from pathlib import Path

from lora_parity.models import config
from lora_parity.run import selftest
from lora_parity.verdict import checks
from lora_parity.verdict.verify import verify

SWITCHES = ("own_tail", "max_as_at_start", "fp32_balance")  # fp32_balance: None unless a profile opts in
"""The noise rule's switches added after the first receipts; their values now: the bf16 profile's."""


@functools.cache
def _switches_now() -> dict[str, object]:
    current = config.profile_budgets("bf16").noise
    assert current is not None
    return {name: getattr(current, name) for name in SWITCHES}


def rejudge(path: Path) -> tuple[bool, bool] | None:
    """(judged right as recorded, judged right under the current rule) of one selftest receipt."""
    receipt = verify(path).receipt
    if any(signal in (receipt.error or "") for signal in ("SIGTERM", "SIGINT")):
        return None  # stopped by the time limit: no judgement either way (as scripts/tally-seeds.py)
    rule = receipt.budgets.noise
    assert rule is not None, f"{path}: made before the noise rule"
    budgets = receipt.budgets.model_copy(update={"noise": rule.model_copy(update=_switches_now())})
    ev = checks.evaluate(receipt.scores, budgets, errored=receipt.error is not None)
    now = receipt.model_copy(update={"budgets": budgets, "checks": ev.checks, "verdict": ev.verdict,
                                     "verdicts": ev.verdicts})
    # The dropped target is the config's first; a run covers it first (or alone: selftest --no-per-target).
    covered = [p.name.removeprefix("target.") for p in receipt.phases if p.name.startswith("target.")]
    listed = receipt.trainer.settings.get("targets")
    targets = [str(t) for t in listed] if isinstance(listed, list) else covered[:1] or ["q_proj"]
    n = receipt.probes.num_scored_positions
    # The receipt was the only file its run added (crash-at); the folder listing is not recorded.
    was = selftest.judge(receipt.injected_fault, receipt, set(), {"r"}, targets, n).caught
    then = selftest.judge(receipt.injected_fault, now, set(), {"r"}, targets, n).caught
    return was, then


def _receipts(arg: str) -> tuple[str, list[Path]]:
    """NAME=DIR,DIR... (folders pooled under one name) or DIR; each DIR holds seed-NN/*.json."""
    name, _, dirs = arg.rpartition("=")
    folders = [Path(d) for d in dirs.split(",")]
    return name or folders[0].name, [p for f in folders for p in sorted(f.glob("seed-*/*.json"))]


def main(args: list[str]) -> None:
    for arg in args:
        name, paths = _receipts(arg)
        rows: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
        changed = []
        for path in paths:
            judged = rejudge(path)
            if judged is None:
                continue
            rows[path.stem].append(judged)
            was, now = judged
            if was != now:
                where = f"{path.parent.parent.name}/{path.parent.name}/{path.name}"
                changed.append(f"  {where}: {'right' if was else 'wrong'} as recorded, "
                               f"{'right' if now else 'wrong'} under the current rule")
        clean = rows.pop("clean", [])
        seeds = len(clean)
        caught = sum(all(now for _, now in runs) for runs in rows.values())
        partial = [fault for fault, runs in rows.items() if len(runs) < seeds]
        false_alarms = sum(not now for _, now in clean)
        recorded = sum(not was for was, _ in clean)
        print(f"{name}: {seeds} seeds; false alarms {recorded}/{seeds} as recorded, "
              f"{false_alarms}/{seeds} under the current rule; {caught}/{len(rows)} faults caught in every seed "
              "they ran"
              + (f" ({len(partial)} did not run in every seed)" if partial else ""))
        for line in changed:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
