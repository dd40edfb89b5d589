"""Re-judge a `selftest --seeds` folder's receipts under a newer noise rule, from their raw scores.

    python scripts/rejudge-seeds.py [--as-recorded] [NAME=]DIR[,DIR...] ...
        (each DIR holds seed-NN/clean.json, seed-NN/fault-*.json; NAME=: the folders pooled under one name)

Each receipt is verified as it was made, then its checks and verdicts are derived again from the same raw
scores with `budgets.noise`'s later switches (`SWITCHES`) as the bf16 profile sets them now and
judged as the selftest judges: the clean run must pass, each fault must be caught by its declared checks.
`--as-recorded` keeps each receipt's own rule (for a model outside the bf16 profile): only the selftest's
declared checks are the current ones.
Prints one line per argument (false alarms, faults run and caught in every seed) and every run whose
judgement changed or that is judged wrong. Nothing is re-run and no receipt is written: this shows what the
newer rule says of the same measurements.
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from pathlib import Path

from lora_parity.evidence.receipt import Receipt
from lora_parity.models import config
from lora_parity.run import selftest
from lora_parity.verdict import checks
from lora_parity.verdict.verify import verify

SWITCHES = ("own_tail", "max_as_at_start", "fp32_balance", "max_at_start_factor", "max_growth_from", "delta_reference",
            "delta_direct", "mixed_fp32")
"""The noise rule's switches added after the first receipts; their values now: the bf16 profile's
(fp32_balance: None unless a profile opts in)."""


@functools.cache
def _switches_now() -> dict[str, object]:
    current = config.profile_budgets("bf16").noise
    assert current is not None
    return {name: getattr(current, name) for name in SWITCHES}


def rejudge(path: Path, as_recorded: bool = False) -> tuple[int, bool, bool] | None:
    """(run seed, judged right as recorded, judged right under the current rule) of one selftest receipt."""
    receipt = verify(path).receipt
    if any(signal in (receipt.error or "") for signal in ("SIGTERM", "SIGINT")):
        return None  # stopped by the time limit: no judgement either way (as scripts/tally-seeds.py)
    rule = receipt.budgets.noise
    assert rule is not None, f"{path}: made before the noise rule"
    switches = {} if as_recorded else _switches_now()  # --as-recorded: the receipt's own rule
    budgets = receipt.budgets.model_copy(update={"noise": rule.model_copy(update=switches)})
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
    return _run_seed(path, receipt), was, then


def _run_seed(path: Path, receipt: Receipt) -> int:
    """The run seed of a selftest receipt: the perturbation's, or (a run that stopped before it) its folder's
    seed-NN, or for a one-seed folder --seed + --first-seed of the command."""
    if receipt.perturbation is not None:
        return receipt.perturbation.seed
    if path.parent.name.startswith("seed-"):
        return int(path.parent.name.removeprefix("seed-"))
    cmd = list(receipt.command)
    flag = {name: int(cmd[cmd.index(name) + 1]) for name in ("--seed", "--first-seed") if name in cmd}
    return flag.get("--seed", 0) + flag.get("--first-seed", 0)


def _receipts(arg: str) -> tuple[str, list[Path]]:
    """NAME=DIR,DIR... (folders pooled under one name) or DIR; each DIR holds seed-NN/*.json, or one
    seed's receipts without a seed folder (a selftest of one seed from seed 0)."""
    name, _, dirs = arg.rpartition("=")
    folders = [Path(d) for d in dirs.split(",")]
    paths = [p for f in folders for p in sorted(f.glob("seed-*/*.json")) + sorted(f.glob("*.json"))]
    return name or folders[0].name, paths


def main(args: list[str]) -> None:
    as_recorded = "--as-recorded" in args
    for arg in (a for a in args if a != "--as-recorded"):
        name, paths = _receipts(arg)
        # per fault (clean too): per run seed, every judgement (a seed's run may have been made again)
        runs: dict[str, dict[int, list[tuple[bool, bool]]]] = defaultdict(lambda: defaultdict(list))
        changed = []
        for path in paths:
            judged = rejudge(path, as_recorded)
            if judged is None:
                continue
            seed, was, now = judged
            runs[path.stem][seed].append((was, now))
            where = f"{path.parent.parent.name}/{path.parent.name}/{path.name}"
            if was != now:
                changed.append(f"  {where}: {'right' if was else 'wrong'} as recorded, "
                               f"{'right' if now else 'wrong'} under the current rule")
            elif not now:
                changed.append(f"  {where}: wrong as recorded and under the current rule")
        clean = runs.pop("clean", {})
        seeds = set(clean)
        judged = [j for js in clean.values() for j in js]
        recorded = sum(not was for was, _ in judged)
        false_alarms = sum(not now for _, now in judged)
        caught = [f for f, by_seed in runs.items() if all(now for js in by_seed.values() for _, now in js)]
        everywhere = [f for f in caught if seeds <= set(runs[f])]
        missed = sorted(set(runs) - set(caught))
        short = {f: sorted(seeds - set(by_seed)) for f, by_seed in runs.items() if seeds - set(by_seed)}
        print(f"{name}: {len(seeds)} seeds ({len(judged)} clean runs); false alarms {recorded}/{len(judged)} as "
              f"recorded, {false_alarms}/{len(judged)} under the current rule; {len(everywhere)}/{len(runs)} faults "
              "run and caught in every seed"
              + (f"; missed: {', '.join(missed)}" if missed else "")
              + (f"; not run in every seed: {', '.join(f'{f} {s}' for f, s in short.items())}" if short else ""))
        for line in changed:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
