"""`lora-parity run`: resolve the config and backends, run the sequence, write the receipt.

Everything before the sequence starts is preflight: bad input raises a `LoraParityError` and no
receipt is written. Once the sequence has started, every outcome, a crash included, ends in a
receipt.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity import __version__, backends, checks, config, outpath, stats, synthetic
from lora_parity.errors import ConfigError, LoraParityError
from lora_parity.faults import Faults
from lora_parity.phases import MERGED_MODES, SYNC_MODES, Run, StopRun, run_sequence
from lora_parity.receipt import (
    SCHEMA_VERSION,
    BackendInfo,
    Environment,
    ModelInfo,
    Probes,
    Receipt,
    Revision,
    RouterAgreement,
    seal,
    write_atomic,
)


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


def git_revision(explicit: str | None, cwd: Path | None = None) -> Revision:
    """--revision if given, else `git rev-parse HEAD` of the working directory, else unknown."""
    if explicit:
        return Revision(commit=explicit, source="flag")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd, timeout=10)
        if head.returncode != 0:
            return Revision(commit="unknown", source="unknown", reason=head.stderr.strip().splitlines()[-1][:200]
                            if head.stderr.strip() else "git rev-parse failed")
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=cwd, timeout=10)
        return Revision(commit=head.stdout.strip(), source="git", dirty=bool(status.stdout.strip()))
    except (OSError, subprocess.SubprocessError) as e:
        return Revision(commit="unknown", source="unknown", reason=f"git not available: {type(e).__name__}")


def default_out(cfg_name: str, probes: str, trainer: str, sampler: str, when: dt.datetime) -> Path:
    """lora-parity-receipts/<model>__<trainer>__<sampler>__<UTC>.json (model part names a non-default probe set)."""
    model = cfg_name if probes == "default" else f"{cfg_name}.{probes}"
    return Path("lora-parity-receipts") / f"{model}__{trainer}__{sampler}__{when.strftime('%Y%m%dT%H%M%SZ')}.json"


def _environment(device: str) -> Environment:
    torch_version = sys.modules["torch"].__version__ if "torch" in sys.modules else None
    return Environment(
        python=platform.python_version(),
        platform=f"{platform.system()}-{platform.machine()}",
        torch=torch_version,
        device=device,
        hostname_digest=hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
    )


def _pending_backend(name: str) -> BackendInfo:
    return BackendInfo(backend=name, versions={}, settings={"status": "not started"})


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
    trainer_cls: Any
    sampler_cls: Any
    probes: Probes
    revision: Revision
    timings: dict[str, float]
    """Preflight timings (importing the backends' libraries)."""


def prepare(opts: RunOptions) -> Plan:
    """Preflight: resolve the config, backends and probes; raise on bad input; write nothing."""
    cfg = config.load(opts.model)
    if opts.sync not in SYNC_MODES:
        raise ConfigError(f"unknown sync mode {opts.sync!r}; choose from {', '.join(SYNC_MODES)}")
    # Before any backend import: a run this machine cannot hold stops here, in well under a second.
    from lora_parity import plan as launch_plan

    launch_plan.preflight(cfg, opts.trainer, opts.sampler)
    start = time.perf_counter()
    trainer_cls = backends.resolve("trainer", opts.trainer)
    sampler_cls = backends.resolve("sampler", opts.sampler)
    import_seconds = time.perf_counter() - start
    _service_preflight(opts, trainer_cls, sampler_cls)
    _tp_preflight(opts, trainer_cls)
    vocab = cfg.model.synthetic.vocab_size if cfg.model.synthetic else _vocab_of(cfg)
    probes = config.make_probes(cfg.probes, opts.probes, vocab)
    Faults(opts.inject, list(cfg.adapter.targets), probes.num_scored_positions, cfg.budgets.mean, opts.sync)
    _merged_preflight(opts, trainer_cls, sampler_cls)
    _reference_preflight(opts, trainer_cls, sampler_cls)
    return Plan(opts, cfg, trainer_cls, sampler_cls, probes, git_revision(opts.revision),
                {"backends.import": import_seconds})


REFERENCES = ("fp32",)


def _reference_preflight(opts: RunOptions, trainer_cls: type, sampler_cls: type) -> None:
    if opts.reference is None:
        return
    if opts.reference not in REFERENCES:
        raise ConfigError(f"unknown reference {opts.reference!r}; choose from {', '.join(REFERENCES)}")
    if not any(getattr(cls, "needs_checkpoint", True) for cls in (trainer_cls, sampler_cls)):
        raise ConfigError("--reference fp32 loads the checkpoint with HF; these backends use none")


class Backends:
    """The loaded model, trainer and sampler; reusable across runs (selftest runs every fault on one load)."""

    def __init__(self, plan: Plan, say: Callable[[str, str, float], None]) -> None:
        cfg, opts = plan.cfg, plan.opts
        self.timings: dict[str, float] = dict(plan.timings)
        self.trainer: Any = None
        self.sampler: Any = None
        self.trainer_info = _pending_backend(opts.trainer)
        self.sampler_info = _pending_backend(opts.sampler)
        self.model_info = ModelInfo(name=cfg.name, source=_source(cfg), config_digest=cfg.digest(),
                                    dtype=cfg.model.dtype)
        self.device = "unknown"
        self.next_adapter_id = 1
        self.error: str | None = None
        self.model_dir: Path | None = None
        self._plan, self._say = plan, say

    def open(self) -> None:
        """Materialize the checkpoint and start both backends; a failure is kept in `error`."""
        cfg, opts, say, timings = self._plan.cfg, self._plan.opts, self._say, self.timings
        start = time.perf_counter()
        try:
            model_dir: Path | None = None
            if any(getattr(cls, "needs_checkpoint", True) for cls in (self._plan.trainer_cls, self._plan.sampler_cls)):
                t0 = time.perf_counter()
                model_dir = self.model_dir = synthetic.materialize(cfg)
                timings["model.materialize"] = time.perf_counter() - t0
                self.model_info = self.model_info.model_copy(update={
                    "weights_digest": synthetic.weights_digest(model_dir), "architecture": _architecture(model_dir)})
                say("model", "ok", timings["model.materialize"])
            self.sampler = self._plan.sampler_cls(cfg, model_dir, timings,
                                                  **_service_options(self._plan.sampler_cls, opts),
                                                  **_sampler_options(self._plan.sampler_cls, opts))
            self.sampler_info = self.sampler.info()
            say("sampler.start", "ok", timings.get("sampler.start", timings.get("sampler.load", 0.0)))
            self.trainer = self._plan.trainer_cls(cfg, model_dir, opts.seed, timings,
                                                  **_service_options(self._plan.trainer_cls, opts),
                                                  **_tp_options(self._plan.trainer_cls, opts))
            self.trainer_info = self.trainer.info()
            say("trainer.load", "ok", timings.get("trainer.load", 0.0))
            settings = {**self.sampler_info.settings, **self.trainer_info.settings}
            self.device = str(settings.get("device", "cpu"))
        except Exception as e:
            self.error = f"setup: {e}" if isinstance(e, LoraParityError) else f"setup: {type(e).__name__}: {e}"
            say("setup", "error", time.perf_counter() - start)

    def close(self, process_exiting: bool = False) -> None:
        """Free both backends. When the process is about to exit, a backend that holds nothing but
        this process's own memory (`releases_nothing_at_exit`) is left to the exit: tearing down an
        in-process vLLM engine takes about a second and frees only what the exit frees anyway."""
        for backend in (self.trainer, self.sampler):
            if backend is not None and not (process_exiting and getattr(backend, "releases_nothing_at_exit", False)):
                backend.close()
        self.trainer = self.sampler = None


def run_once(plan: Plan, loaded: Backends, inject: str | None, out: Path, force: bool,
             say: Callable[[str, str, float], None]) -> RunResult:
    """One pass of the sequence on loaded backends, then the receipt, whatever happened."""
    cfg, opts, probes = plan.cfg, plan.opts, plan.probes
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    faults = Faults(inject, list(cfg.adapter.targets), probes.num_scored_positions, cfg.budgets.mean, opts.sync)
    workdir = Path(tempfile.mkdtemp(prefix="lora-parity-"))
    start = time.perf_counter()
    error = loaded.error
    run: Run | None = None
    router: RouterAgreement | None = None
    try:
        if error is None:
            loaded.trainer.zero_b()
            router = _router_agreement(loaded, probes.sequences)
            run = Run(cfg=cfg, trainer=loaded.trainer, sampler=loaded.sampler, sequences=probes.sequences,
                      seed=opts.seed, workdir=workdir, faults=faults, sync_mode=opts.sync,
                      per_target=opts.per_target, progress=say, first_adapter_id=loaded.next_adapter_id,
                      reference=_reference(plan, loaded))
            try:
                run_sequence(run)
            except StopRun:
                error = run.error
            finally:
                loaded.next_adapter_id = run.next_adapter_id
                run.retire()
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        timings = {**loaded.timings, **(run.timings if run else {}), "total": time.perf_counter() - start}
        scores = run.scores if run else {}
        ev = checks.evaluate(scores, cfg.budgets, errored=error is not None)
        receipt = seal({
            "schema_version": SCHEMA_VERSION,
            "tool_version": __version__,
            "created_at": when.isoformat().replace("+00:00", "Z"),
            "command": _redacted_command(opts),
            "revision": plan.revision,
            "model": loaded.model_info,
            "trainer": loaded.trainer_info,
            "sampler": loaded.sampler_info,
            "environment": _environment(loaded.device),
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
        })
        path = write_atomic(receipt, out, force=force)
    return RunResult(receipt, path)


ROUTER_STATE = "zero-init trainer (B = 0) vs the sampler's base model"


def _reference(plan: Plan, loaded: Backends) -> Callable[[list[list[int]]], Any] | None:
    if plan.opts.reference is None or loaded.model_dir is None:
        return None
    from lora_parity.backends.hf import fp32_reference

    return fp32_reference(plan.cfg, loaded.model_dir)


def _router_agreement(loaded: Backends, sequences: list[list[int]]) -> RouterAgreement | None:
    """Router top-k agreement at zero-init, for MoE models: a backend exposes its routing with
    `router_topk(sequences)` ([sequence][token][MoE layer] -> expert ids; None for a dense model).
    A side that does not expose it makes the record `not_available`, with the reason, never a guess."""
    trainer_fn = getattr(loaded.trainer, "router_topk", None)
    sampler_fn = getattr(loaded.sampler, "router_topk", None)
    try:
        trainer_routes = trainer_fn(sequences) if trainer_fn is not None else None
        if trainer_routes is None:
            return None
        if sampler_fn is None:
            reason = getattr(loaded.sampler, "routing_unavailable", None) or "the sampler does not expose its routing"
            return RouterAgreement(status="not_available", reason=f"{loaded.sampler_info.backend}: {reason}",
                                   state=ROUTER_STATE)
        per_layer = stats.topk_agreement(trainer_routes, sampler_fn(sequences))
    except Exception as e:  # routing is a diagnostic: a capture that fails is recorded, the run goes on
        return RouterAgreement(status="not_available", reason=f"routing capture failed: {type(e).__name__}: {e}"[:300],
                               state=ROUTER_STATE)
    first = trainer_routes[0][0] if trainer_routes and trainer_routes[0] else []
    return RouterAgreement(status="measured", state=ROUTER_STATE, num_layers=len(per_layer),
                           top_k=len(first[0]) if first else 0, num_tokens=sum(len(s) for s in sequences),
                           agreement=math.fsum(per_layer) / len(per_layer) if per_layer else 0.0,
                           per_layer=per_layer)


def execute(opts: RunOptions, progress: Callable[[str, str, float], None] | None = None,
            process_exiting: bool = False) -> RunResult:
    """Preflight, load, run the sequence once, write the receipt; return it and its path.
    `process_exiting`: the caller exits right after (the CLI), see `Backends.close`."""
    say = progress or (lambda phase, status, seconds: None)
    plan = prepare(opts)
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    out = opts.out or default_out(plan.cfg.name, opts.probes, opts.trainer, opts.sampler, when)
    lock = outpath.claim(out, opts.force)  # writable, not a folder, not taken by another run
    loaded = Backends(plan, say)
    try:
        loaded.open()
        return run_once(plan, loaded, opts.inject, out, opts.force, say)
    finally:
        loaded.close(process_exiting)
        lock.release()


def redact_url(url: str) -> str:
    """A service URL without credentials, query or fragment: what a receipt may record."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _redacted_command(opts: RunOptions) -> list[str]:
    """The command line, with the service URL's credentials removed."""
    if not opts.tinker_url:
        return list(opts.command)
    return [arg.replace(opts.tinker_url, redact_url(opts.tinker_url)) for arg in opts.command]


def _service_options(cls: Any, opts: RunOptions) -> dict[str, Any]:
    """Constructor options of a backend that talks to a service (`takes_service_options`): tinker."""
    if not getattr(cls, "takes_service_options", False):
        return {}
    return {"url": opts.tinker_url, "base_model": opts.base_model}


def _merged_preflight(opts: RunOptions, trainer_cls: Any, sampler_cls: Any) -> None:
    """The merged sync modes need a trainer that merges and a sampler that reloads its base weights."""
    if opts.sync not in MERGED_MODES:
        return
    if not hasattr(trainer_cls, "merged_tensors"):
        raise ConfigError(f"--sync {opts.sync} needs a trainer that can merge its adapter; {opts.trainer!r} cannot")
    if not hasattr(sampler_cls, "reload_base"):
        raise ConfigError(f"--sync {opts.sync} needs a sampler that reloads base weights; {opts.sampler!r} cannot")


def _sampler_options(cls: Any, opts: RunOptions) -> dict[str, Any]:
    """`lora=False` for a sampler in a merged sync mode: it serves the merged base weights alone."""
    return {"lora": False} if opts.sync in MERGED_MODES and hasattr(cls, "reload_base") else {}


def _tp_options(cls: Any, opts: RunOptions) -> dict[str, Any]:
    """The `tp` keyword, for a trainer that runs tensor parallel (`supports_tp`): megatron."""
    return {"tp": opts.tp} if getattr(cls, "supports_tp", False) else {}


def _tp_preflight(opts: RunOptions, trainer_cls: Any) -> None:
    """--tp is a positive size, and other than 1 only for a trainer that runs tensor parallel."""
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {opts.tp}")
    if opts.tp != 1 and not getattr(trainer_cls, "supports_tp", False):
        raise ConfigError(f"--tp applies to the megatron trainer only, not {opts.trainer!r}")


def _service_preflight(opts: RunOptions, *classes: Any) -> None:
    """Service options only where a backend takes them; each backend's own `preflight(opts)` (the
    tinker backends: the service answers within seconds)."""
    if (opts.tinker_url or opts.base_model) and not any(getattr(c, "takes_service_options", False) for c in classes):
        raise ConfigError("--tinker-url and --base-model apply to the tinker backends only")
    for check in dict.fromkeys(getattr(c, "preflight", None) for c in classes):
        if check is not None:
            check(opts)


def _source(cfg: config.ModelConfig) -> str:
    if cfg.model.synthetic:
        return f"synthetic:{cfg.name}"
    if cfg.model.path:
        return Path(cfg.model.path).name
    return f"hf:{cfg.model.hf_id}"


def _read_hf_config(cfg: config.ModelConfig) -> dict[str, Any]:
    folder = _local_checkpoint(cfg)
    assert folder is not None
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def _local_checkpoint(cfg: config.ModelConfig) -> Path | None:
    """The config's checkpoint folder: its path, or its hub id's snapshot in the local HF cache."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    if cfg.model.hf_id is not None:
        from lora_parity.plan import hub_checkpoint

        return hub_checkpoint(cfg.model.hf_id)
    return None


def _vocab_of(cfg: config.ModelConfig) -> int:
    folder = _local_checkpoint(cfg)
    if folder is None:
        raise ConfigError(f"{cfg.name}: no local checkpoint to run (hub models are not downloaded)")
    vocab = _read_hf_config(cfg).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ConfigError(f"{folder}/config.json: no valid vocab_size")
    return vocab


def _architecture(model_dir: Path) -> str | None:
    try:
        archs = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None
