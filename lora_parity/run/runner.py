"""`lora-parity run`: resolve the config and backends, run the sequence, write the receipt.

Everything before the sequence starts is preflight: bad input raises a `LoraParityError` and no
receipt is written. Once the sequence has started, every outcome, a crash included, ends in a
receipt.
"""

from __future__ import annotations

import datetime as dt
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity import __version__, backends
from lora_parity.backends import served
from lora_parity.backends.base import (
    BackendOptions,
    PreflightOptions,
    Sampler,
    SamplerBackend,
    Trainer,
    TrainerBackend,
)
from lora_parity.evidence import outpath, tracebacks
from lora_parity.evidence.receipt import (
    SCHEMA_VERSION,
    BackendInfo,
    ErrorDetail,
    ModelInfo,
    Probes,
    Receipt,
    Reference,
    Revision,
    RouterAgreement,
    seal,
    write_atomic,
)
from lora_parity.models import config, realmodel, synthetic
from lora_parity.models.checkpoint import Checkpoint
from lora_parity.models.digest_cache import known_weights_digest
from lora_parity.models.provenance import environment, git_revision, redact_url, redacted_command, scrub_secrets, source
from lora_parity.run import early_launch, generation, preflight, reference_scorers, route_replay, start_adapter
from lora_parity.run import probes as probe_sources
from lora_parity.run.faults import Faults, one_token_ceiling, rewrites_files
from lora_parity.run.loop import with_loop
from lora_parity.run.options import RunOptions
from lora_parity.run.phases import WARM_FOLDER, Run, StopRun, run_sequence
from lora_parity.run.preflight import REFERENCE_MARGIN as REFERENCE_MARGIN
from lora_parity.run.preflight import reference_decision as reference_decision
from lora_parity.run.routing import router_agreement
from lora_parity.run.sync import SyncMode
from lora_parity.run.sync import mode as sync_mode_named
from lora_parity.util import interrupt, lean, process_clock, scratch
from lora_parity.util.errors import ConfigError, LoraParityError
from lora_parity.verdict import breakdown, checks, lifecycle

if TYPE_CHECKING:
    from lora_parity.backends.server_process import ServerProcess

__all__ = ["Backends", "Plan", "RunOptions", "RunResult", "execute", "git_revision", "prepare", "redact_url",
           "run_once"]


def default_out(cfg_name: str, probes: str, trainer: str, sampler: str, when: dt.datetime) -> Path:
    """lora-parity-receipts/<model>__<trainer>__<sampler>__<UTC>.json (model part names a non-default probe set)."""
    model = cfg_name if probes == "default" else f"{cfg_name}.{probes}"
    return Path("lora-parity-receipts") / f"{model}__{trainer}__{sampler}__{when.strftime('%Y%m%dT%H%M%SZ')}.json"


@dataclass
class RunResult:
    """What a run produced."""

    receipt: Receipt
    path: Path


@dataclass
class Plan:
    """Everything preflight resolved; nothing loaded yet."""

    opts: RunOptions
    cfg: config.ModelConfig
    trainer_cls: type[TrainerBackend]
    sampler_cls: type[SamplerBackend]
    sync: SyncMode
    probes: Probes
    revision: Revision
    timings: dict[str, float]  # preflight timings (importing the backends' libraries)
    server: ServerProcess | None = None  # the sampler's server, launched at preflight (`early_launch`), adopted
    trainer: Trainer | None = None
    """A trainer the caller built (the Python API, `lora_parity.api`): used as it is, not built from `trainer_cls`."""
    sampler: Sampler | None = None
    """A sampler the caller built, likewise (not built from `sampler_cls`)."""
    replays: bool = False
    """Route replay, as far as the config and the backends' classes tell (`route_replay.preflight`)."""
    reference_checkpoint: bool = False  # the Python API's `reference`: cfg.model.path loaded for the fp32 reference

    @property
    def sampled(self) -> bool:
        """`--probes sampled`: the sampler completes the probes at the start of the run."""
        return self.probes.source is not None and self.probes.source.kind == "sampled"

    @property
    def needs_checkpoint(self) -> bool:
        """Whether either backend (or the API's fp32 reference) loads the local checkpoint."""
        return any(c.traits.needs_checkpoint for c in (self.trainer_cls, self.sampler_cls)) or self.reference_checkpoint

    def backend_options(self) -> BackendOptions:
        """What the backends are built with."""
        o = self.opts
        return BackendOptions(seed=o.seed, tp=o.tp, url=o.tinker_url, base_model=o.base_model,
                              lora=self.sync.sampler_lora, sampler_url=o.sampler_url, api_key_env=o.api_key_env,
                              shared_dir=o.shared_dir, batch_invariant=o.batch_invariant, server=self.server)


def prepare(opts: RunOptions, launch_early: bool = False) -> Plan:
    """Preflight: resolve the config, backends and probes; raise on bad input; write nothing. With `launch_early`, a
    sampler's server is launched once the sampler's own checks pass, before the trainer's imports (`Plan.server`; a
    later refusal stops it: the caller stops it after the run). torch's compile cache goes to a scratch folder from
    here on (`scratch.torch_compile_cache`), removed when the backends close, or at once on a refusal."""
    scratch.torch_compile_cache()  # before torch is imported: it may make its default folder then
    start = time.perf_counter()
    try:
        plan = _prepare(opts, launch_early)
    except BaseException:
        scratch.remove_all()
        raise
    # preflight's own time (the config, the probes, every check), the backends' imports apart
    plan.timings["preflight"] = time.perf_counter() - start - plan.timings.get("backends.import", 0.0)
    return plan


def _prepare(opts: RunOptions, launch_early: bool) -> Plan:
    cfg = config.load(opts.model, opts.dtype, opts.budgets)
    if opts.per_target is None:  # no flag: the config decides; a flag wins over the config either way
        opts = replace(opts, per_target=cfg.per_target)
    if cfg.model.trust_remote_code and not opts.trust_remote_code:
        raise ConfigError(f"{cfg.name} sets model.trust_remote_code: true (runs the checkpoint's own Python code); "
                          "pass --trust-remote-code to allow it")
    cfg = _with_engine_args(cfg, opts)
    # The fake backends run a toy layout of their own, not the model's config.json shapes.
    cfg = start_adapter.apply(cfg, opts.adapter, model_shapes=opts.trainer != "fake")
    sync = sync_mode_named(opts.sync)
    # Preflight in three stages, one per import: before any backend, after the sampler's, after the trainer's.
    cfg, probes = preflight.before_backends(opts, cfg)
    start = time.perf_counter()
    sampler_cls = backends.resolve("sampler", opts.sampler)
    import_seconds = time.perf_counter() - start
    pre = PreflightOptions(trainer=opts.trainer, sampler=opts.sampler, inject=opts.inject,
                           inject_rewrites_files=rewrites_files(opts.inject), url=opts.tinker_url,
                           base_model=opts.base_model, tp=opts.tp, sync=opts.sync, sampler_url=opts.sampler_url,
                           api_key_env=opts.api_key_env, shared_dir=opts.shared_dir)
    # The sampler's own checks first: a server that cannot be reached stops the run before the trainer's imports.
    preflight.sampler_preflight(opts, sampler_cls, pre, cfg)
    options = BackendOptions(sampler_url=opts.sampler_url, batch_invariant=opts.batch_invariant)
    server = early_launch.launch(cfg, sampler_cls, options) if launch_early else None
    try:
        plan = _prepare_trainer(opts, cfg, sync, sampler_cls, pre, import_seconds, probes)
    except BaseException:  # a refusal (or Ctrl-C) from here on leaves no server running
        early_launch.stop(server)
        raise
    plan.server = server
    return plan


def _with_engine_args(cfg: config.ModelConfig, opts: RunOptions) -> config.ModelConfig:
    """The config's `sampler.engine_args`, `sleep_levels`, `sampling` and `loop` with `--engine-arg` (checked for the
    sampler: `backends.user_args`), `--sleep-levels`, `--sampling` and `--loop` over them."""
    from lora_parity.backends import engine_args, user_args
    from lora_parity.models import loop, sampling
    from lora_parity.run.sleep_wake import parse_levels

    given = user_args.check_for(opts.sampler, {**cfg.sampler.engine_args, **engine_args.parse(opts.engine_args)})
    levels = parse_levels(opts.sleep_levels)
    sampler = {"engine_args": given, "sleep_levels": list(cfg.sampler.sleep_levels if levels is None else levels),
               "sampling": sampling.merged(cfg.sampler.sampling, sampling.parse(opts.sampling)),
               "loop": loop.merged(cfg.sampler.loop, loop.parse(opts.loop))}
    return cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update=sampler)})


def _prepare_trainer(opts: RunOptions, cfg: config.ModelConfig, sync: SyncMode, sampler_cls: type[SamplerBackend],
                     pre: PreflightOptions, import_seconds: float, probes: Probes) -> Plan:
    """Preflight from the trainer's import on (`prepare`)."""
    start = time.perf_counter()
    trainer_cls = backends.resolve("trainer", opts.trainer)
    import_seconds += time.perf_counter() - start
    preflight.backend_checks(opts, cfg, trainer_cls, sampler_cls, pre, sync, probes)
    cfg = preflight.balance_where_it_holds(cfg, trainer_cls.traits, sampler_cls.traits)
    opts = replace(opts, route_replay=route_replay.mode_of(opts.route_replay, cfg))
    replays = route_replay.preflight(opts, cfg, trainer_cls, sampler_cls)
    return Plan(opts, cfg, trainer_cls, sampler_cls, sync, probes, git_revision(opts.revision),
                {"backends.import": import_seconds}, replays=replays)


def _pending_backend(name: str) -> BackendInfo:
    return BackendInfo(backend=name, versions={}, settings={"status": "not started"})


class Backends:
    """The loaded model, trainer and sampler; reusable across runs (selftest runs every fault on one load)."""

    def __init__(self, plan: Plan, say: Callable[[str, str, float], None]) -> None:
        cfg, opts = plan.cfg, plan.opts
        self.timings: dict[str, float] = dict(plan.timings)
        self.trainer: Trainer | None = None
        self.sampler: Sampler | None = None
        self.trainer_info = _pending_backend(opts.trainer)
        self.sampler_info = _pending_backend(opts.sampler)
        self.model_info = ModelInfo(name=cfg.name, source=source(cfg), config_digest=cfg.digest(),
                                    dtype=cfg.model.dtype)
        self.device = "unknown"
        self.next_adapter_id = 1
        self.error: str | None = None
        self.interrupted: KeyboardInterrupt | None = None
        """A SIGINT or SIGTERM that stopped a run on these backends: they are not used again."""
        self.error_detail: ErrorDetail | None = None
        self.reference: Reference | None = None
        """The fp32 reference decision of the latest run."""
        self.reference_scores: dict[str, Any] = {}
        """fp32 reference scores by probe-set digest: scored once per probe set on these backends."""
        self.exact_reference: Reference | None = None
        """The exact reference decision of the latest run."""
        self.model_dir: Path | None = None
        self._plan, self._say = plan, say

    def _materialize(self) -> Path:
        t0 = time.perf_counter()
        model_dir = self.model_dir = synthetic.materialize(self._plan.cfg)
        self.timings["model.materialize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.model_info = self.model_info.model_copy(update={
            "weights_digest": known_weights_digest(model_dir), "architecture": Checkpoint.open(model_dir).architecture,
            "source_sha256": realmodel.source_sha256(model_dir)})
        self.timings["model.digest"] = time.perf_counter() - t0  # the checkpoint's sha256 (issue 47: was untimed)
        self._say("model", "ok", self.timings["model.materialize"])
        return model_dir

    def open(self) -> None:
        """Materialize the checkpoint and start both backends; a failure is kept in `error`."""
        plan, say, timings = self._plan, self._say, self.timings
        start = time.perf_counter()
        try:
            model_dir = self._materialize() if plan.needs_checkpoint else None
            options = plan.backend_options()
            # A served sampler may return while its server starts: the trainer loads meanwhile.
            self.sampler = plan.sampler or plan.sampler_cls.create(plan.cfg, model_dir, timings, options)
            self.trainer = plan.trainer or plan.trainer_cls.create(plan.cfg, model_dir, timings, options)
            start_adapter.load(self.trainer, plan.opts.adapter)
            self.trainer_info = self.trainer.info()
            say("trainer.load", "ok", timings.get("trainer.load", 0.0))
            self.sampler_info = with_loop(self.sampler.info(), plan.cfg.sampler.loop)
            say("sampler.start", "ok", timings.get("sampler.start", timings.get("sampler.load", 0.0)))
            settings = {**self.sampler_info.settings, **self.trainer_info.settings}
            self.device = str(settings.get("device", "cpu"))
            timings["backends.open"] = time.perf_counter() - start  # the timed parts above, and what lies between
        except Exception as e:
            self.error = f"setup: {tracebacks.one_line(e)}"
            self.error_detail = tracebacks.describe(e, "setup")
            say("setup", "error", time.perf_counter() - start)
        except KeyboardInterrupt as e:
            self.interrupted = e
            self.error = f"setup: {interrupt.describe(e)}"
        finally:
            lean.resume_collector()  # paused by the CLI while the libraries imported and the backends started

    def close(self, process_exiting: bool = False) -> None:
        """Free both backends. When the process is about to exit, a backend that holds nothing but
        this process's own memory (`traits.releases_nothing_at_exit`) is left to the exit: tearing
        down an in-process vLLM engine takes about a second and frees only what the exit frees anyway."""
        if self.interrupted is not None:
            # The backends may be mid-call: end their processes instead of talking to them.
            interrupt.end_children()
        else:
            for backend in (self.trainer, self.sampler):
                if backend is not None and not (process_exiting and backend.traits.releases_nothing_at_exit):
                    backend.close()
        self.trainer = self.sampler = None
        scratch.prune_kept_cache()
        scratch.remove_all()


def _sequence(plan: Plan, loaded: Backends, faults: Faults, workdir: Path,
              say: Callable[[str, str, float], None]) -> tuple[Run, RouterAgreement | None]:
    """Zero the trainer, measure routing, run the sequence; the run's error is kept in `run.error`."""
    assert loaded.trainer is not None and loaded.sampler is not None
    loaded.trainer.zero_b()
    router = router_agreement(loaded.trainer, loaded.sampler, loaded.sampler_info.backend, plan.probes.sequences)
    replay = route_replay.start(route_replay.mode_of(plan.opts.route_replay, plan.cfg),
                                route_replay.is_moe(plan.cfg, loaded.model_dir), loaded.trainer, loaded.sampler,
                                loaded.sampler_info.backend, faults.routes)
    refs = reference_scorers.Scorers.build(plan, loaded, workdir / WARM_FOLDER if warms(plan) else None)
    run = Run(cfg=plan.cfg, trainer=loaded.trainer, sampler=loaded.sampler, sequences=plan.probes.sequences,
              seed=plan.opts.seed, workdir=workdir, faults=faults, sync_mode=plan.sync,
              per_target=plan.opts.per_target is not False, per_target_only=plan.opts.per_target_only, progress=say,
              per_layer=plan.opts.per_layer, first_adapter_id=loaded.next_adapter_id,
              reference=refs.start, reference_points=refs.points, exact_points=refs.exact,
              sampled=plan.sampled, start_adapter=plan.opts.adapter is not None or warms(plan),
              warm_start=warms(plan) and plan.opts.adapter is None, replay=replay)
    try:
        run_sequence(run)
    except StopRun:
        pass
    except KeyboardInterrupt as e:
        loaded.interrupted = e
    finally:
        refs.release()
    loaded.next_adapter_id = run.next_adapter_id
    _stop_if_interrupted(run, loaded)
    if loaded.interrupted is None:
        run.retire()
        loaded.sampler_info = served.settled(loaded.sampler, loaded.sampler_info)
    return run, router


def _stop_if_interrupted(run: Run, loaded: Backends) -> None:
    """A signal ends the run with an error that says so, even where a library turned the
    KeyboardInterrupt into another exception (the phase then failed with that exception)."""
    if loaded.interrupted is None and interrupt.received() is not None:
        loaded.interrupted = interrupt.Interrupted(interrupt.received() or 0)
    if loaded.interrupted is not None:
        where = f" in phase {run.phases[-1].name}" if run.phases and run.phases[-1].status.value == "error" else ""
        run.error = f"{interrupt.describe(loaded.interrupted)}{where}"


def run_once(plan: Plan, loaded: Backends, inject: str | None, out: Path, force: bool,
             say: Callable[[str, str, float], None]) -> RunResult:
    """One pass of the sequence on loaded backends, then the receipt, whatever happened."""
    cfg, probes = plan.cfg, plan.probes
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    faults = Faults(inject, cfg.adapter.kinds, probes.num_scored_positions, cfg.budgets.mean, plan.opts.sync,
                    sampled=plan.sampled, update="step" if warms(plan) else "noise",
                    start_adapter=plan.opts.adapter is not None, max_ceiling=one_token_ceiling(cfg.budgets))
    workdir = Path(tempfile.mkdtemp(prefix="lora-parity-"))
    start = time.perf_counter()
    run: Run | None = None
    router: RouterAgreement | None = None
    error = loaded.error
    try:
        if error is None:
            run, router = _sequence(plan, loaded, faults, workdir, say)
            error = run.error
    except KeyboardInterrupt as e:  # before the sequence started (zeroing the trainer, routing)
        loaded.interrupted = e
        error = interrupt.describe(e)
    except Exception as e:  # zero_b or the routing capture, before the first phase: still a receipt
        error = f"start: {e}" if isinstance(e, LoraParityError) else f"start: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.perf_counter() - start
        receipt = _receipt(plan, loaded, run, router, inject, error, when, seconds)
        path = write_atomic(receipt, out, force=force)
    if loaded.interrupted is not None:
        raise RunInterrupted(RunResult(receipt, path)) from loaded.interrupted
    return RunResult(receipt, path)


class RunInterrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM stopped the run; its receipt (verdict error) is written: `result`. A
    KeyboardInterrupt, so that a caller that lets Ctrl-C through lets this through too."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.receipt.error or "interrupted")
        self.result = result


def _receipt(plan: Plan, loaded: Backends, run: Run | None, router: RouterAgreement | None, inject: str | None,
             error: str | None, when: dt.datetime, seconds: float) -> Receipt:
    """The sealed receipt of one run (scores, checks derived from them, provenance, timings)."""
    cfg, opts = plan.cfg, plan.opts
    probes = generation.scored_probes(plan.probes, run.sequences if run else None)
    scores = run.scores if run else {}
    start = time.perf_counter()
    ev = checks.evaluate(scores, cfg.budgets, errored=error is not None)
    timings = {**loaded.timings, **(run.timings if run else {}), "total": seconds,
               "receipt.checks": time.perf_counter() - start, **process_clock.stamp("process.at_receipt")}
    sampler, phases = scrub_secrets(loaded.sampler_info), scrub_secrets(run.phases) if run else []
    return seal({
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "created_at": when.isoformat().replace("+00:00", "Z"),
        "command": redacted_command(opts.command, opts.tinker_url, opts.sampler_url),
        "revision": plan.revision,
        "model": loaded.model_info,
        # A server's error body may echo the API key it was sent: never into the receipt.
        "trainer": scrub_secrets(served.settled(loaded.trainer, loaded.trainer_info)),
        "sampler": sampler,
        "environment": environment(loaded.device),
        "budgets": cfg.budgets,
        "probes": probes,
        "perturbation": run.perturbation if run else None,
        "sync_mode": opts.sync,
        "adapters": run.adapters if run else [],
        "injected_fault": inject,
        "phases": phases,
        "scores": scores,
        "comparisons": ev.comparisons,
        "deltas": ev.deltas,
        "checks": ev.checks,
        "verdict": ev.verdict,
        "verdicts": ev.verdicts,
        "error": scrub_secrets(error),
        "timings": {k: round(v, 6) for k, v in timings.items()},
        "worst_positions": checks.compute_worst_positions(scores, probes.sequences),
        "router": router,
        "route_replay": run.replay.record() if run else None,
        "breakdown": breakdown.compute(scores),
        "error_detail": scrub_secrets((run.error_detail if run else None) or (loaded.error_detail if error else None)),
        "reference": loaded.reference if run else None,
        "exact_reference": loaded.exact_reference if run else None,
        "noise": ev.noise,
        "thresholds": ev.thresholds,
        "start_adapter": start_adapter.record(opts.adapter),
        "lifecycle": lifecycle.derive(sampler.backend, sampler.settings, phases),
    })


def warms(plan: Plan) -> bool:
    """`--update step` with a trainer that can start from an adapter: the run starts from the seeded warm
    adapter (`update_step`), unless the user gave one (`--adapter`, which is then the start)."""
    return plan.cfg.perturbation.update == "step" and plan.trainer_cls.traits.start_adapter_unavailable is None


def execute(opts: RunOptions, progress: Callable[[str, str, float], None] | None = None,
            process_exiting: bool = False) -> RunResult:
    """Preflight, load, run the sequence once, write the receipt; return it and its path.
    `process_exiting`: the caller exits right after (the CLI), see `Backends.close`."""
    say = progress or (lambda phase, status, seconds: None)
    started = process_clock.stamp("process.before_run")  # interpreter start and the CLI, before the run
    plan = prepare(opts, launch_early=True)
    plan.timings.update(started)
    try:
        when = dt.datetime.now(dt.UTC).replace(microsecond=0)
        out = opts.out or default_out(plan.cfg.name, probe_sources.label(opts.probes), opts.trainer, opts.sampler,
                                      when)
        lock = outpath.claim(out, opts.force)  # writable, not a folder, not taken by another run
        loaded = Backends(plan, say)
        try:
            loaded.open()
            return run_once(plan, loaded, opts.inject, out, opts.force, say)
        finally:
            loaded.close(process_exiting)
            lock.release()
    finally:
        early_launch.stop(plan.server)  # launched early, never adopted (the sampler stops its own)
