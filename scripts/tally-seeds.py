"""Tally `selftest --seeds` receipts pooled from several processes (gpu-evidence.sh `pseeds`), as the
selftest judges them, into one markdown row per configuration.

    python scripts/tally-seeds.py NAME=DIR[,DIR...] ...      (each DIR holds seed-NN/clean.json, seed-NN/fault-*.json;
                                                              one seed from seed 0: no seed-NN folder)

Every receipt is verified first (a receipt that fails `verify` stops the tally). Left out, and counted:
runs whose engines never started (a setup error: no verdict was reached) and runs stopped by the time
limit (interrupted). A fault whose declared check is per-target (T.*) in a run without that target's
coverage is listed as not measured rather than judged. Nothing is re-run.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from lora_parity.run import selftest
from lora_parity.run.faults import Faults
from lora_parity.verdict.verify import verify


def _fault(path: Path) -> str | None:
    return None if path.stem == "clean" else path.stem.removeprefix("fault-").replace("crash-at-", "crash-at=")


def tally(name: str, folders: list[Path]) -> str:
    clean: list[tuple[bool, float | None, str | None]] = []
    faults: dict[str, list[tuple[bool, float | None]]] = defaultdict(list)
    unmeasured: dict[str, int] = defaultdict(int)
    skipped = {"setup": 0, "interrupted": 0}
    seeds = set()
    for folder in folders:
        for path in sorted(folder.glob("seed-*/*.json")) + sorted(folder.glob("*.json")):  # one seed from 0: flat
            receipt = verify(path).receipt
            error = receipt.error or ""
            if error.startswith("setup:"):
                skipped["setup"] += 1
                continue
            if "SIGTERM" in error or "SIGINT" in error:
                skipped["interrupted"] += 1
                continue
            fault = _fault(path)
            covered = [p.name.removeprefix("target.") for p in receipt.phases if p.name.startswith("target.")]
            n = receipt.probes.num_scored_positions
            targets = list(receipt.trainer.settings.get("targets") or covered or ["q_proj"])
            if fault is not None:
                sampled = receipt.probes.source is not None and receipt.probes.source.kind == "sampled"
                spec = Faults(fault, targets, n, receipt.budgets.mean, receipt.sync_mode, sampled=sampled,
                              start_adapter=receipt.start_adapter is not None).expected()
                wanted = {c.split(".")[1] for c in spec.caught_by if c.startswith("T.")}
                if wanted and not wanted <= set(covered):
                    unmeasured[fault] += 1
                    continue
            # The receipt was the only file its run added (crash-at); the folder listing is not recorded.
            j = selftest.judge(fault, receipt, set(), {"r"}, targets, n)
            seeds.add((folder.name, path.parent.name))
            if fault is None:
                clean.append((j.caught, j.margin, j.margin_check))
            else:
                faults[fault].append((j.caught, j.margin))
    false_alarms = sum(not ok for ok, _, _ in clean)
    whole = [f for f, runs in faults.items() if all(ok for ok, _ in runs)]
    missed = [f"{f} {sum(ok for ok, _ in runs)}/{len(runs)}" for f, runs in faults.items()
              if not all(ok for ok, _ in runs)]
    closest = min(((m, c) for ok, m, c in clean if ok and m is not None), default=None)
    fault_margins = [m for runs in faults.values() for ok, m in runs if ok and m is not None]
    left_out = ", ".join(f"{v} {k}" for k, v in skipped.items() if v)
    return (f"| {name} | {len(clean)} | {false_alarms}/{len(clean)} | {len(whole)}/{len(faults)} | "
            f"{'; '.join(missed) or '-'} | "
            f"{f'{closest[0]:.3g} ({closest[1]})' if closest else '-'} | "
            f"{f'{min(fault_margins):.3g}' if fault_margins else '-'} | "
            f"{', '.join(f'{f} ({k})' for f, k in unmeasured.items()) or '-'} | {left_out or '-'} |")


def main(args: list[str]) -> None:
    print("| configuration | seeds (clean runs) | false alarms | faults caught in every seed | missed (caught/runs) "
          "| closest clean margin | closest fault margin | not measured (runs) | left out (runs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arg in args:
        name, _, dirs = arg.partition("=")
        print(tally(name, [Path(d) for d in dirs.split(",")]))


if __name__ == "__main__":
    main(sys.argv[1:])
