"""`lora-parity selftest`: a clean run, then every fault, each of which must be caught by its check;
with `seeds`, all of it once per seed, and the rates over the seeds.

All runs share one load of the trainer and the sampler (the model is loaded once, for every seed);
each run starts from zero-init B and uses adapter ids no earlier run used, so runs cannot see each other.
A server the sampler started that a run left dead is started again before the next run (`Row.restarted`),
and a fault that must end in an error is caught only by its own error (`FaultSpec.error_says`).

A seed changes both what is scored and the update (`plan_for_seed`): seed i (0, 1, ...) runs with
run seed `--seed` + i (the perturbation, and the sampled probes' generation) and each probe set's
seed plus `PROBE_SEED_STRIDE` x i (the random ids, or the text windows); a probe file is the user's
own tokens and stays as it is. Seed 0 is exactly the single-seed selftest. LoRA A is initialized
once, at the load, with `--seed`.

Margins (`margin`, `trip_ratio`): how far each check that decided a run's judgement sat on the right
side of its threshold, as a factor; above 1 the selftest judged that run right, the smallest is the
closest call. docs/verdicts.md states the rule.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from lora_parity.backends.base import BackendTraits, TensorReadingTrainer
from lora_parity.backends.served import ServedAdapters
from lora_parity.evidence.receipt import Check, CheckStatus, PhaseStatus, Receipt, Verdict
from lora_parity.models import sampling
from lora_parity.run import generation, loop, preflight
from lora_parity.run import probes as probe_sources
from lora_parity.run.faults import FAULTS, SAMPLED_FAULTS, SELFTEST_FAULTS, Faults, faults_for, not_applicable
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import Backends, Plan, prepare, run_once, warms
from lora_parity.util.errors import ConfigError
from lora_parity.verdict.check_rules import compared_nothing, target_of
from lora_parity.verdict.thresholds import EXACT_PREFIXES

NO_FAULTS = "none"
"""`--faults none`: the clean run of each seed and no fault."""

PROBE_SEED_STRIDE = 100_000
"""Seed i draws each probe set with the set's seed plus this times i (far from every set's own seed)."""


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
    seed: int = 0
    """The run seed this run used (`--seed` + the seed's index)."""
    margin: float | None = None
    """The closest of the checks that decided this run's judgement, as a factor past its threshold on
    the right side (`margin`): above 1 judged right; None where no check decides (an expected error)."""
    margin_check: str | None = None
    """The check that margin belongs to."""
    restarted: str | None = None
    """The sampler's server had exited at the end of this run and was started again for the next (what
    `_revive` said), or None."""

    @property
    def expected_error(self) -> bool:
        """The fault is meant to end the run in an error (nan, crash-at), and it did."""
        return self.caught and self.expected.startswith("error")

    @property
    def clean(self) -> bool:
        """A clean run (no fault injected)."""
        return self.fault.startswith("none")


Watch = Callable[[str, "Row | None"], None]
"""Called with (fault, None) when a run starts and (fault, row) when it ends ('none' is the clean run)."""


@dataclass(frozen=True)
class FaultTally:
    """One fault over every seed: how often its declared checks caught it, and the closest call."""

    fault: str
    expected: str
    caught: int
    runs: int
    closest: float | None
    """The smallest margin over the seeds (None: no check decides this fault, or none had a number)."""
    closest_check: str | None
    closest_seed: int | None


@dataclass
class SelftestResult:
    """The matrix (every seed's rows), and whether repeated clean runs gave identical scores."""

    rows: list[Row] = field(default_factory=list)
    repeats: int = 0
    identical_repeats: bool = True
    seeds: list[int] = field(default_factory=list)
    """The run seeds, in order (one for the single-seed selftest)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Faults the sampler's class takes but its started engine does not (fault -> why: vLLM-CPU's mixed batches)."""

    @property
    def ok(self) -> bool:
        """No false alarm, every fault caught in every seed, and every repeat bit-identical."""
        return all(r.caught for r in self.rows) and self.identical_repeats

    @property
    def clean_rows(self) -> list[Row]:
        """The clean runs of every seed."""
        return [r for r in self.rows if r.clean]

    @property
    def false_alarms(self) -> int:
        """Clean runs that did not pass."""
        return sum(not r.caught for r in self.clean_rows)

    def clean_closest(self) -> Row | None:
        """The clean run that came closest to a false alarm (smallest margin), or None."""
        return _closest(self.clean_rows)

    def tallies(self) -> list[FaultTally]:
        """Per fault, in the order they ran: caught k of N seeds, and the closest call."""
        order = list(dict.fromkeys(r.fault for r in self.rows if not r.clean))
        out = []
        for fault in order:
            rows = [r for r in self.rows if r.fault == fault]
            near = _closest(rows)
            out.append(FaultTally(fault, rows[0].expected, sum(r.caught for r in rows), len(rows),
                                  near.margin if near else None, near.margin_check if near else None,
                                  near.seed if near else None))
        return out


def _closest(rows: list[Row]) -> Row | None:
    with_margin = [r for r in rows if r.margin is not None]
    return min(with_margin, key=lambda r: r.margin if r.margin is not None else math.inf) if with_margin else None


def trip_ratio(check: Check) -> float | None:
    """How far a check's observed value lies toward tripping it, as a ratio to its threshold: above 1
    it is past the threshold (the check fails), below 1 short of it. '<=' checks: observed / budget;
    '>=' and '>': budget / observed; a cosine is compared as 1 - cosine against 1 - threshold (a ratio
    of two numbers near 1 says nothing). Infinite past a threshold of zero (or a '>=' observed at or
    below zero); None where there is no number (not reached, undefined, no budget)."""
    observed, budget, op = check.observed, check.budget, check.op
    if observed is None or budget is None or not (math.isfinite(observed) and math.isfinite(budget)):
        return None
    if check.id.endswith(".cosine"):
        observed, budget, op = 1.0 - observed, 1.0 - budget, "<="
    if op == "<=":
        if budget <= 0:
            return math.inf if observed > budget else 0.0
        return max(observed, 0.0) / budget
    if budget <= 0:
        return None
    return math.inf if observed <= 0 else budget / observed


def margin(checks: list[Check], must_trip: tuple[str, ...], must_pass: tuple[str, ...]) -> tuple[float | None,
                                                                                                   str | None]:
    """(margin, check id) of the closest call among the checks that decide a run: a check that must
    trip (a fault's declared check) counts its `trip_ratio`, a check that must pass (every check of a
    clean run, the checks a fault must hide from) the inverse. Above 1: judged right by that factor."""
    by_id = {c.id: c for c in checks}
    found: list[tuple[float, str]] = []
    for ids, invert in ((must_trip, False), (must_pass, True)):
        for entry in ids:
            # `X|Y` (a fault's entry that either check fulfils): the one nearer to tripping decides it.
            ratios = [(r, cid) for cid in entry.split("|")
                      if cid in by_id and (r := trip_ratio(by_id[cid])) is not None]
            if not ratios:
                continue
            ratio, cid = max(ratios)
            found.append(((math.inf if ratio == 0 else 1.0 / ratio) if invert else ratio, cid))
    if not found:
        return None, None
    value, cid = min(found)
    return value, cid


def _failing(receipt: Receipt) -> list[str]:
    return [c.id for c in receipt.checks if c.status in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE)
            or compared_nothing(c)]


def _tripped(check: Check | None, verdict: str) -> bool:
    """A declared check caught its fault: it failed or was inconclusive; for a fault whose verdict is inconclusive,
    also where it compared nothing (`compared_nothing`: not run, which keeps the run from passing)."""
    if check is None:
        return False
    return check.status in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE) or (
        verdict == "inconclusive" and compared_nothing(check))


def _without_absent_targets(checks: tuple[str, ...], status: dict[str, CheckStatus]) -> tuple[str, ...]:
    """`checks` less the per-target ones (T.*) when the run had no per-target coverage (`--no-per-target`):
    the fault must then be caught by the others; and less G.sampled.* and G.updated.* where the decode logprobs were
    tempered (G.trainer computed, they not: `generation.after_sync`), caught by G.trainer then."""
    if not any(c.startswith("T.") for c in status):
        checks = tuple(c for c in checks if not c.startswith("T."))
    if any(c.startswith("G.trainer.") for c in status) and not any(c.startswith(TEMPERED_ABSENT) for c in status):
        checks = tuple(c for c in checks if not c.startswith(TEMPERED_ABSENT))
    return checks


TEMPERED_ABSENT = ("G.sampled.", "G.updated.")
"""The generation checks a run with tempered decode logprobs does not compute."""


@dataclass(frozen=True)
class Judgement:
    """What the selftest expected of one run, what it saw, and how close the call was."""

    expected: str
    observed: str
    caught: bool
    margin: float | None
    margin_check: str | None


def judge(fault: str | None, receipt: Receipt, folder_before: set[str], folder_after: set[str],
          targets: list[str], num_positions: int, sampler: BackendTraits | None = None) -> Judgement:
    """The judgement of one run of the matrix, from its receipt (`sampler`: the sampler's traits, where
    they change what must catch the fault)."""
    failing = _failing(receipt)
    shown = ", ".join(failing[:4]) + (f" (+{len(failing) - 4} more)" if len(failing) > 4 else "")
    observed = f"{receipt.verdict.value}: {shown or receipt.error or 'all checks pass'}"
    if fault is None:
        near, near_id = margin(receipt.checks, (), tuple(c.id for c in receipt.checks))
        return Judgement("pass", observed, receipt.verdict == Verdict.PASS, near, near_id)
    sampled = receipt.probes.source is not None and receipt.probes.source.kind == "sampled"
    update = "step" if receipt.perturbation is not None and receipt.perturbation.warm_std is not None else "noise"
    spec = Faults(fault, targets, num_positions, receipt.budgets.mean, receipt.sync_mode, sampled=sampled,
                  update=update, start_adapter=receipt.start_adapter is not None).expected(sampler)
    status = {c.id: c.status for c in receipt.checks}
    by_id = {c.id: c for c in receipt.checks}
    caught_by = _without_absent_targets(spec.caught_by, status)
    expected = f"{spec.verdict}: {', '.join(c.replace('|', ' or ') for c in caught_by) or 'error recorded'}"
    caught = receipt.verdict.value == spec.verdict
    caught &= all(any(_tripped(by_id.get(c), spec.verdict) for c in entry.split("|")) for entry in caught_by)
    # Under --budgets exact every parity statistic is bitwise: the mean no longer lets a single token hide.
    must_pass = tuple(c for c in spec.must_pass if not (receipt.budgets.exact and c.startswith(EXACT_PREFIXES)))
    caught &= all(status.get(c) == CheckStatus.PASS for c in must_pass)
    if spec.verdict == "error":  # the fault's own error: a server a fault killed refuses every call
        caught &= re.search(spec.error_says, receipt.error or "") is not None
    if spec.name == "crash-at":
        phase = fault.partition("=")[2]
        done = [p.name for p in receipt.phases if p.status == PhaseStatus.OK]
        errored = [p.name for p in receipt.phases if p.status == PhaseStatus.ERROR]
        caught &= errored == [phase] and bool(done)
        # The receipt is the only file the crashed run added.
        caught &= len(folder_after - folder_before) == 1
    near, near_id = margin(receipt.checks, caught_by, must_pass)
    return Judgement(expected, observed, caught, near, near_id)


def plan_for(plan: Plan, fault: str) -> Plan:
    """The plan of one fault's run: per-target coverage only for a fault that a per-target check must
    catch or must let pass (drop-target); for the others it adds minutes to the selftest and no
    evidence about the fault (the clean runs keep it, so every T.* check is still shown to pass).
    With `--no-per-target`, a fault that only a per-target check can name still gets coverage of the
    target it breaks (drop-target: the dropped one), and of no other."""
    spec = FAULTS[fault.partition("=")[0]]
    named = [target_of(c) for c in spec.caught_by + spec.must_pass if c.startswith("T.")]
    needs_targets = bool(named)
    if not plan.opts.per_target:
        if not needs_targets:
            return plan
        dropped = plan.cfg.adapter.targets[0]
        covered = tuple(dict.fromkeys(dropped if name == "{target}" else name for name in named))
        # also where the config leaves coverage off (the GPU configs): the fault's own check needs it
        return replace(plan, opts=replace(plan.opts, per_target=True, per_target_only=covered))
    if needs_targets:
        return plan
    return replace(plan, opts=replace(plan.opts, per_target=False))


def plan_for_seed(plan: Plan, index: int) -> Plan:
    """The plan of seed `index`: run seed `--seed` + index, and the probes drawn again with every
    probe set's seed moved by `PROBE_SEED_STRIDE` x index (a probe file stays as it is). Index 0 is
    the plan itself."""
    if index == 0:
        return plan
    opts = replace(plan.opts, seed=plan.opts.seed + index)
    kind, _ = probe_sources.parse_ref(opts.probes)
    if kind == "file":
        return replace(plan, opts=opts)
    spec = plan.cfg.probes
    seeds = {name: seed + PROBE_SEED_STRIDE * index for name, seed in spec.seeds.items()}
    moved = plan.cfg.model_copy(update={"probes": spec.model_copy(update={"seeds": seeds})})
    probes = preflight.make_probes(opts, moved)
    return replace(plan, opts=opts, probes=probes)


def selftest(opts: RunOptions, out_dir: Path | None, repeat: int = 1,
             progress: Callable[[str, str, float], None] | None = None,
             faults: list[str] | None = None, watch: Watch | None = None, seeds: int = 1,
             first_seed: int = 0, only: tuple[str, ...] = ()) -> SelftestResult:
    """Run the clean run (`repeat` times) and every fault that applies to the sync mode and the
    sampler (with a sampler served over HTTP, the serving-layer faults too; or only `faults`), once per seed
    (`plan_for_seed`), on one load of the backends; write each receipt into `out_dir` (with several
    seeds, into `out_dir/seed-NN/`, NN the run seed); `watch` hears of each run as it starts and ends.
    `first_seed` K runs seed indices K .. K + seeds - 1: exactly those of a longer selftest, so that one
    over many seeds can be split across processes or machines and its receipts pooled. `only` (the
    CLI's `--faults`) keeps those of the applicable faults, to fill in the runs a split selftest is missing."""
    say = progress or (lambda phase, status, seconds: None)
    tell: Watch = watch or (lambda fault, row: None)
    if only:  # a name that is no selftest fault at all is refused before any backend is imported
        pick_faults(only, SELFTEST_FAULTS + SAMPLED_FAULTS)
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"--out-dir {out_dir}: not a folder")
    plan = prepare(opts)
    folder = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="lora-parity-selftest-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out-dir {folder}: cannot create the folder: {e.strerror or e}") from None
    result = SelftestResult(repeats=max(1, repeat))
    loaded = Backends(plan, say)
    targets = plan.cfg.adapter.kinds
    update = "step" if warms(plan) else "noise"
    # the traits of the sampler it builds for this config (in-process vLLM with prefix caching reads its cache)
    applicable = faults_for(opts.sync, plan.sampler_cls.built_traits(plan.cfg), plan.sampled, targets, update,
                            plan.trainer_cls.traits, plan.cfg.model.dtype,
                            issubclass(plan.trainer_cls, TensorReadingTrainer), plan.replays,
                            plan.cfg.sampler.sleep_levels)
    # the decode path's faults that act only with tempered decode logprobs, or only without them
    tempered = sampling.tempered(plan.cfg.sampler.sampling, plan.cfg.sampler.engine_args) is not None
    off = {**(generation.UNTEMPERED_FAULTS if tempered else dict.fromkeys(generation.TEMPERED_FAULT_NAMES, "")),
           **loop.off(plan.cfg.sampler.loop)}  # and the faults the user's loop leaves out
    applicable = [name for name in applicable if name not in off]
    fault_names = faults if faults is not None else applicable
    if only:
        fault_names = pick_faults(only, applicable)
    try:
        loaded.open()
        fault_names = _applicable_here(fault_names, loaded, result)
        for index in range(first_seed, first_seed + max(1, seeds)):
            seed_plan = plan_for_seed(plan, index)
            seed = seed_plan.opts.seed
            result.seeds.append(seed)
            seed_folder = folder / f"seed-{seed:02d}" if seeds > 1 or first_seed > 0 else folder
            seed_folder.mkdir(parents=True, exist_ok=True)
            _one_seed(seed_plan, loaded, seed_folder, result, fault_names, targets, tell, say)
    finally:
        loaded.close()
    return result


def _applicable_here(names: list[str], loaded: Backends, result: SelftestResult) -> list[str]:
    """The faults that apply to the sampler as it started: an engine may find at start-up what its class cannot
    say (vLLM-CPU's LoRA ops defect leaves its mixed batches off, so no mixed-batch fault can be caught there). The
    others are left out, each with why, in `result.left_out` (the summary says them: never a silent pass)."""
    traits = loaded.sampler.traits if loaded.sampler is not None else None
    if traits is None:
        return names
    for name in names:
        why = not_applicable(name.partition("=")[0], traits)
        if why is not None:
            result.left_out[name] = why
    return [name for name in names if name not in result.left_out]


def pick_faults(only: tuple[str, ...], applicable: list[str]) -> list[str]:
    """The applicable faults named in `only` (a name as listed, or as its receipt file names it:
    `crash-at=stale` or `crash-at-stale`), in the selftest's order; a name that is not one of them is
    a `ConfigError` that lists those that are. `none` alone keeps none: only the clean runs (a false-alarm
    rate over many seeds)."""
    if only == (NO_FAULTS,):
        return []
    by_name = {name: name for name in applicable} | {name.replace("=", "-"): name for name in applicable}
    unknown = [name for name in only if name not in by_name]
    if unknown:
        raise ConfigError(f"--faults: {', '.join(unknown)} not among this run's faults: {', '.join(applicable)}")
    wanted = {by_name[name] for name in only}
    return [name for name in applicable if name in wanted]


def _revive(loaded: Backends) -> str | None:
    """Start again the server of a served sampler that exited since it started (`ServedAdapters.revive`),
    so that the next run meets a live server, not the one a fault killed; what was done, or None."""
    return loaded.sampler.revive() if isinstance(loaded.sampler, ServedAdapters) else None


def _one_seed(plan: Plan, loaded: Backends, folder: Path, result: SelftestResult, fault_names: list[str],
              targets: list[str], tell: Watch, say: Callable[[str, str, float], None]) -> None:
    """The clean runs and every fault on one seed's plan; rows appended to `result`."""
    n, seed = plan.probes.num_scored_positions, plan.opts.seed
    sampler = loaded.sampler.traits if loaded.sampler is not None else plan.sampler_cls.built_traits(plan.cfg)
    first_scores = None
    for i in range(result.repeats):
        path = folder / (f"clean-{i:02d}.json" if result.repeats > 1 else "clean.json")
        name = "none" if result.repeats == 1 else f"none #{i + 1}"
        tell(name, None)
        t0 = time.perf_counter()
        receipt = run_once(plan, loaded, None, path, True, say).receipt
        j = judge(None, receipt, set(), set(), targets, n, sampler)
        result.rows.append(Row(name, j.expected, j.observed, j.caught, str(path), time.perf_counter() - t0,
                               seed, j.margin, j.margin_check, _revive(loaded)))
        tell(name, result.rows[-1])
        if first_scores is None:
            first_scores = receipt.scores
        elif receipt.scores != first_scores:
            result.identical_repeats = False
    for fault in fault_names:
        path = folder / f"fault-{fault.replace('=', '-')}.json"
        path.unlink(missing_ok=True)
        before = {p.name for p in folder.iterdir()}
        tell(fault, None)
        t0 = time.perf_counter()
        receipt = run_once(plan_for(plan, fault), loaded, fault, path, True, say).receipt
        after = {p.name for p in folder.iterdir()}
        j = judge(fault, receipt, before, after, targets, n, sampler)
        result.rows.append(Row(fault, j.expected, j.observed, j.caught, str(path), time.perf_counter() - t0,
                               seed, j.margin, j.margin_check, _revive(loaded)))
        tell(fault, result.rows[-1])
