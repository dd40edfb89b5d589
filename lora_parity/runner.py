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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity import __version__, backends, breakdown, checks, config, outpath, realmodel, synthetic
from lora_parity import probes as probe_sources
from lora_parity.backends.base import (
    BackendOptions,
    PreflightOptions,
    Sampler,
    SamplerBackend,
    Trainer,
    TrainerBackend,
)
from lora_parity.checkpoint import Checkpoint, vocab_size, weights_digest
from lora_parity.errors import ConfigError, LoraParityError
from lora_parity.faults import Faults
from lora_parity.phases import Run, StopRun, run_sequence
from lora_parity.provenance import environment, git_revision, redact_url, redacted_command, source
from lora_parity.receipt import (
    SCHEMA_VERSION,
    BackendInfo,
    ModelInfo,
    Probes,
    Receipt,
    Revision,
    RouterAgreement,
    seal,
    write_atomic,
)
from lora_parity.routing import router_agreement
from lora_parity.sync import SyncMode
from lora_parity.sync import mode as sync_mode_named

__all__ = ["Backends", "Plan", "RunOptions", "RunResult", "execute", "git_revision", "prepare", "redact_url",
           "run_once"]


@dataclass(frozen=True)
class RunOptions:
    """Options of `lora-parity run`."""

    model: str | None = None
    trainer: str = "hf"
    sampler: str = "vllm"
    probes: str = "default"
    out: Path | None = None
    revision: str | None = None
    seed: int = 0
    force: bool = False
    inject: str | None = None
    sync: str = "new-id"
    per_target: bool = True
    command: tuple[str, ...] = ()
    tinker_url: str | None = None
    """URL of the Tinker service (the tinker backends only)."""
    base_model: str | None = None
    """Base model name on the Tinker service (default: the one model it serves)."""
    tp: int = 1
    """Tensor-parallel size of the trainer (the megatron trainer only)."""
    reference: str | None = None
    """'fp32': also score the base model in fp32 with HF, the reference both sides approximate."""
    dtype: str | None = None
    """Cast a checkpoint passed by path to this dtype (budgets follow it); None: its config.json's."""


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
    timings: dict[str, float]
    """Preflight timings (importing the backends' libraries)."""

    @property
    def needs_checkpoint(self) -> bool:
        """Whether either backend loads the local checkpoint."""
        return self.trainer_cls.traits.needs_checkpoint or self.sampler_cls.traits.needs_checkpoint

    def backend_options(self) -> BackendOptions:
        """What the backends are built with."""
        o = self.opts
        return BackendOptions(seed=o.seed, tp=o.tp, url=o.tinker_url, base_model=o.base_model,
                              lora=self.sync.sampler_lora)


def prepare(opts: RunOptions) -> Plan:
    """Preflight: resolve the config, backends and probes; raise on bad input; write nothing."""
    cfg = config.load(opts.model, opts.dtype)
    sync = sync_mode_named(opts.sync)
    # Before any backend import: a run this machine cannot hold stops here, in well under a second.
    from lora_parity import plan as launch_plan

    launch_plan.preflight(cfg, opts.trainer, opts.sampler)
    check_options(opts, cfg)
    start = time.perf_counter()
    trainer_cls = backends.resolve("trainer", opts.trainer)
    sampler_cls = backends.resolve("sampler", opts.sampler)
    import_seconds = time.perf_counter() - start
    _service_preflight(opts, trainer_cls, sampler_cls)
    _tp_preflight(opts, trainer_cls)
    probes = probe_sources.make(cfg, opts.probes, lambda: vocab_size(cfg))
    Faults(opts.inject, list(cfg.adapter.targets), probes.num_scored_positions, cfg.budgets.mean, opts.sync)
    sync.require(trainer_cls, sampler_cls, opts.trainer, opts.sampler)
    plan = Plan(opts, cfg, trainer_cls, sampler_cls, sync, probes, git_revision(opts.revision),
                {"backends.import": import_seconds})
    _reference_preflight(plan)
    return plan


REFERENCES = ("fp32",)


def check_options(opts: RunOptions, cfg: config.ModelConfig) -> None:
    """Every option value that can be checked without importing a backend (torch, vLLM, transformers
    come with the backends): backend names, --inject, --reference, --tp, an existing --out. Bad
    input is refused in well under a second."""
    for kind, name, table in (("trainer", opts.trainer, backends.TRAINERS), ("sampler", opts.sampler,
                                                                            backends.SAMPLERS)):
        if name not in table:
            raise ConfigError(f"unknown {kind} backend {name!r}; choose from {', '.join(sorted(table))}")
    Faults(opts.inject, list(cfg.adapter.targets), 1, cfg.budgets.mean, opts.sync)
    if opts.reference is not None and opts.reference not in REFERENCES:
        raise ConfigError(f"unknown reference {opts.reference!r}; choose from {', '.join(REFERENCES)}")
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {opts.tp}")
    if opts.out is not None:
        outpath.check_writable(opts.out, opts.force)


def _reference_preflight(plan: Plan) -> None:
    reference = plan.opts.reference
    if reference is None:
        return
    if reference not in REFERENCES:
        raise ConfigError(f"unknown reference {reference!r}; choose from {', '.join(REFERENCES)}")
    if not plan.needs_checkpoint:
        raise ConfigError("--reference fp32 loads the checkpoint with HF; these backends use none")


def _tp_preflight(opts: RunOptions, trainer_cls: type[TrainerBackend]) -> None:
    """--tp is a positive size, and other than 1 only for a trainer that runs tensor parallel."""
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {opts.tp}")
    if opts.tp != 1 and not trainer_cls.traits.supports_tp:
        raise ConfigError(f"--tp applies to the megatron trainer only, not {opts.trainer!r}")


def _service_preflight(opts: RunOptions, *classes: type[TrainerBackend] | type[SamplerBackend]) -> None:
    """Service options only where a backend takes them; then each backend's own `preflight` (the
    tinker backends: the service answers within seconds)."""
    if (opts.tinker_url or opts.base_model) and not any(c.traits.takes_service_options for c in classes):
        raise ConfigError("--tinker-url and --base-model apply to the tinker backends only")
    pre = PreflightOptions(trainer=opts.trainer, sampler=opts.sampler, inject=opts.inject, url=opts.tinker_url,
                           base_model=opts.base_model, tp=opts.tp, sync=opts.sync)
    for cls in classes:
        cls.preflight(pre)


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
        self.model_dir: Path | None = None
        self._plan, self._say = plan, say

    def _materialize(self) -> Path:
        t0 = time.perf_counter()
        model_dir = self.model_dir = synthetic.materialize(self._plan.cfg)
        self.timings["model.materialize"] = time.perf_counter() - t0
        self.model_info = self.model_info.model_copy(update={
            "weights_digest": weights_digest(model_dir), "architecture": Checkpoint.open(model_dir).architecture,
            "source_sha256": realmodel.source_sha256(model_dir)})
        self._say("model", "ok", self.timings["model.materialize"])
        return model_dir

    def open(self) -> None:
        """Materialize the checkpoint and start both backends; a failure is kept in `error`."""
        plan, say, timings = self._plan, self._say, self.timings
        start = time.perf_counter()
        try:
            model_dir = self._materialize() if plan.needs_checkpoint else None
            options = plan.backend_options()
            self.sampler = plan.sampler_cls.create(plan.cfg, model_dir, timings, options)
            self.sampler_info = self.sampler.info()
            say("sampler.start", "ok", timings.get("sampler.start", timings.get("sampler.load", 0.0)))
            self.trainer = plan.trainer_cls.create(plan.cfg, model_dir, timings, options)
            self.trainer_info = self.trainer.info()
            say("trainer.load", "ok", timings.get("trainer.load", 0.0))
            settings = {**self.sampler_info.settings, **self.trainer_info.settings}
            self.device = str(settings.get("device", "cpu"))
        except Exception as e:
            self.error = f"setup: {e}" if isinstance(e, LoraParityError) else f"setup: {type(e).__name__}: {e}"
            say("setup", "error", time.perf_counter() - start)

    def close(self, process_exiting: bool = False) -> None:
        """Free both backends. When the process is about to exit, a backend that holds nothing but
        this process's own memory (`traits.releases_nothing_at_exit`) is left to the exit: tearing
        down an in-process vLLM engine takes about a second and frees only what the exit frees anyway."""
        for backend in (self.trainer, self.sampler):
            if backend is not None and not (process_exiting and backend.traits.releases_nothing_at_exit):
                backend.close()
        self.trainer = self.sampler = None


def _sequence(plan: Plan, loaded: Backends, faults: Faults, workdir: Path,
              say: Callable[[str, str, float], None]) -> tuple[Run, RouterAgreement | None]:
    """Zero the trainer, measure routing, run the sequence; the run's error is kept in `run.error`."""
    assert loaded.trainer is not None and loaded.sampler is not None
    loaded.trainer.zero_b()
    router = router_agreement(loaded.trainer, loaded.sampler, loaded.sampler_info.backend, plan.probes.sequences)
    run = Run(cfg=plan.cfg, trainer=loaded.trainer, sampler=loaded.sampler, sequences=plan.probes.sequences,
              seed=plan.opts.seed, workdir=workdir, faults=faults, sync_mode=plan.opts.sync,
              per_target=plan.opts.per_target, progress=say, first_adapter_id=loaded.next_adapter_id,
              reference=_reference(plan, loaded))
    try:
        run_sequence(run)
    except StopRun:
        pass
    finally:
        loaded.next_adapter_id = run.next_adapter_id
        run.retire()
    return run, router


def run_once(plan: Plan, loaded: Backends, inject: str | None, out: Path, force: bool,
             say: Callable[[str, str, float], None]) -> RunResult:
    """One pass of the sequence on loaded backends, then the receipt, whatever happened."""
    cfg, probes = plan.cfg, plan.probes
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    faults = Faults(inject, list(cfg.adapter.targets), probes.num_scored_positions, cfg.budgets.mean, plan.opts.sync)
    workdir = Path(tempfile.mkdtemp(prefix="lora-parity-"))
    start = time.perf_counter()
    run: Run | None = None
    router: RouterAgreement | None = None
    error = loaded.error
    try:
        if error is None:
            run, router = _sequence(plan, loaded, faults, workdir, say)
            error = run.error
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.perf_counter() - start
        receipt = _receipt(plan, loaded, run, router, inject, error, when, seconds)
        path = write_atomic(receipt, out, force=force)
    return RunResult(receipt, path)


def _receipt(plan: Plan, loaded: Backends, run: Run | None, router: RouterAgreement | None, inject: str | None,
             error: str | None, when: dt.datetime, seconds: float) -> Receipt:
    """The sealed receipt of one run (scores, checks derived from them, provenance, timings)."""
    cfg, opts, probes = plan.cfg, plan.opts, plan.probes
    timings = {**loaded.timings, **(run.timings if run else {}), "total": seconds}
    scores = run.scores if run else {}
    ev = checks.evaluate(scores, cfg.budgets, errored=error is not None)
    return seal({
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "created_at": when.isoformat().replace("+00:00", "Z"),
        "command": redacted_command(opts.command, opts.tinker_url),
        "revision": plan.revision,
        "model": loaded.model_info,
        "trainer": loaded.trainer_info,
        "sampler": loaded.sampler_info,
        "environment": environment(loaded.device),
        "budgets": cfg.budgets,
        "probes": probes,
        "perturbation": run.perturbation if run else None,
        "sync_mode": opts.sync,
        "adapters": run.adapters if run else [],
        "injected_fault": inject,
        "phases": run.phases if run else [],
        "scores": scores,
        "comparisons": ev.comparisons,
        "deltas": ev.deltas,
        "checks": ev.checks,
        "verdict": ev.verdict,
        "error": error,
        "timings": {k: round(v, 6) for k, v in timings.items()},
        "worst_positions": checks.compute_worst_positions(scores, probes.sequences),
        "router": router,
        "breakdown": breakdown.compute(scores),
    })


def _reference(plan: Plan, loaded: Backends) -> Callable[[list[list[int]]], Any] | None:
    if plan.opts.reference is None or loaded.model_dir is None:
        return None
    from lora_parity.backends.hf import fp32_reference

    return fp32_reference(plan.cfg, loaded.model_dir)


def execute(opts: RunOptions, progress: Callable[[str, str, float], None] | None = None,
            process_exiting: bool = False) -> RunResult:
    """Preflight, load, run the sequence once, write the receipt; return it and its path.
    `process_exiting`: the caller exits right after (the CLI), see `Backends.close`."""
    say = progress or (lambda phase, status, seconds: None)
    plan = prepare(opts)
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    out = opts.out or default_out(plan.cfg.name, probe_sources.label(opts.probes), opts.trainer, opts.sampler, when)
    lock = outpath.claim(out, opts.force)  # writable, not a folder, not taken by another run
    loaded = Backends(plan, say)
    try:
        loaded.open()
        return run_once(plan, loaded, opts.inject, out, opts.force, say)
    finally:
        loaded.close(process_exiting)
        lock.release()
