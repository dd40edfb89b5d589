"""`lora-parity selftest`: a clean run, then every fault, each of which must be caught by its check.

All runs share one load of the trainer and the sampler (the model is loaded once); each run starts
from zero-init B and uses adapter ids no earlier run used, so runs cannot see each other.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from lora_parity.faults import FAULTS, Faults, faults_for
from lora_parity.receipt import CheckStatus, PhaseStatus, Receipt, Verdict
from lora_parity.runner import Backends, Plan, RunOptions, prepare, run_once


@dataclass(frozen=True)
class Row:
    """One line of the selftest matrix."""

    fault: str
    expected: str
    observed: str
    caught: bool
    receipt: str
    seconds: float = 0.0
    """Wall time of this run."""

    @property
    def expected_error(self) -> bool:
        """The fault is meant to end the run in an error (nan, crash-at), and it did."""
        return self.caught and self.expected.startswith("error")


Watch = Callable[[str, "Row | None"], None]
"""Called with (fault, None) when a run starts and (fault, row) when it ends ('none' is the clean run)."""


@dataclass
class SelftestResult:
    """The matrix, and whether repeated clean runs gave identical scores."""

    rows: list[Row] = field(default_factory=list)
    repeats: int = 0
    identical_repeats: bool = True

    @property
    def ok(self) -> bool:
        """The clean run passed, every fault was caught, and every repeat was bit-identical."""
        return all(r.caught for r in self.rows) and self.identical_repeats


def _failing(receipt: Receipt) -> list[str]:
    return [c.id for c in receipt.checks if c.status in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE)]


def _without_absent_targets(checks: tuple[str, ...], status: dict[str, CheckStatus]) -> tuple[str, ...]:
    """`checks` less the per-target ones (T.*) when the run had no per-target coverage (`--no-per-target`):
    the fault must then be caught by the others."""
    if any(c.startswith("T.") for c in status):
        return checks
    return tuple(c for c in checks if not c.startswith("T."))


def judge(fault: str | None, receipt: Receipt, folder_before: set[str], folder_after: set[str],
          targets: list[str], num_positions: int) -> tuple[str, str, bool]:
    """(expected, observed, caught) for one run of the matrix."""
    failing = _failing(receipt)
    shown = ", ".join(failing[:4]) + (f" (+{len(failing) - 4} more)" if len(failing) > 4 else "")
    observed = f"{receipt.verdict.value}: {shown or receipt.error or 'all checks pass'}"
    if fault is None:
        return "pass", observed, receipt.verdict == Verdict.PASS
    sampled = receipt.probes.source is not None and receipt.probes.source.kind == "sampled"
    spec = Faults(fault, targets, num_positions, receipt.budgets.mean, receipt.sync_mode, sampled=sampled).expected()
    status = {c.id: c.status for c in receipt.checks}
    caught_by = _without_absent_targets(spec.caught_by, status)
    expected = f"{spec.verdict}: {', '.join(caught_by) or 'error recorded'}"
    caught = receipt.verdict.value == spec.verdict
    caught &= all(status.get(c) in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE) for c in caught_by)
    caught &= all(status.get(c) == CheckStatus.PASS for c in spec.must_pass)
    if spec.name == "nan":
        caught &= "non-finite" in (receipt.error or "")
    if spec.name == "crash-at":
        phase = fault.partition("=")[2]
        done = [p.name for p in receipt.phases if p.status == PhaseStatus.OK]
        errored = [p.name for p in receipt.phases if p.status == PhaseStatus.ERROR]
        caught &= errored == [phase] and bool(done) and "injected crash" in (receipt.error or "")
        # The receipt is the only file the crashed run added.
        caught &= len(folder_after - folder_before) == 1
    return expected, observed, caught


def plan_for(plan: Plan, fault: str) -> Plan:
    """The plan of one fault's run: per-target coverage only for a fault that a per-target check must
    catch or must let pass (drop-target); for the others it adds minutes to the selftest and no
    evidence about the fault (the clean runs keep it, so every T.* check is still shown to pass)."""
    spec = FAULTS[fault.partition("=")[0]]
    if not plan.opts.per_target or any(c.startswith("T.") for c in spec.caught_by + spec.must_pass):
        return plan
    return replace(plan, opts=replace(plan.opts, per_target=False))


def selftest(opts: RunOptions, out_dir: Path | None, repeat: int = 1,
             progress: Callable[[str, str, float], None] | None = None,
             faults: list[str] | None = None, watch: Watch | None = None) -> SelftestResult:
    """Run the clean run (`repeat` times) and every fault that applies to the sync mode and the
    sampler (with vllm-server, the serving-layer faults too; or only `faults`); write each receipt
    into `out_dir`; `watch` hears of each run as it starts and ends."""
    say = progress or (lambda phase, status, seconds: None)
    tell: Watch = watch or (lambda fault, row: None)
    plan = prepare(opts)
    folder = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="lora-parity-selftest-"))
    folder.mkdir(parents=True, exist_ok=True)
    result = SelftestResult()
    loaded = Backends(plan, say)
    targets, n = list(plan.cfg.adapter.targets), plan.probes.num_scored_positions
    try:
        loaded.open()
        first_scores = None
        for i in range(max(1, repeat)):
            path = folder / (f"clean-{i:02d}.json" if repeat > 1 else "clean.json")
            name = "none" if repeat == 1 else f"none #{i + 1}"
            tell(name, None)
            t0 = time.perf_counter()
            receipt = run_once(plan, loaded, None, path, True, say).receipt
            expected, observed, caught = judge(None, receipt, set(), set(), targets, n)
            result.rows.append(Row(name, expected, observed, caught, str(path), time.perf_counter() - t0))
            tell(name, result.rows[-1])
            if first_scores is None:
                first_scores = receipt.scores
            elif receipt.scores != first_scores:
                result.identical_repeats = False
        result.repeats = max(1, repeat)
        for fault in faults if faults is not None else faults_for(opts.sync, plan.sampler_cls.traits, plan.sampled):
            path = folder / f"fault-{fault.replace('=', '-')}.json"
            path.unlink(missing_ok=True)
            before = {p.name for p in folder.iterdir()}
            tell(fault, None)
            t0 = time.perf_counter()
            receipt = run_once(plan_for(plan, fault), loaded, fault, path, True, say).receipt
            after = {p.name for p in folder.iterdir()}
            expected, observed, caught = judge(fault, receipt, before, after, targets, n)
            result.rows.append(Row(fault, expected, observed, caught, str(path), time.perf_counter() - t0))
            tell(fault, result.rows[-1])
    finally:
        loaded.close()
    return result
