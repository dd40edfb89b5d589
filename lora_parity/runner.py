"""`lora-parity run`: resolve the config and backends, run the sequence, write the receipt.

Everything before the sequence starts is preflight: bad input raises a `LoraParityError` and no
receipt is written. Once the sequence has started, every outcome, a crash included, ends in a
receipt.
"""

from __future__ import annotations

import datetime as dt
import hashlib
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

from lora_parity import __version__, backends, checks, config, synthetic
from lora_parity.errors import ConfigError
from lora_parity.faults import Faults
from lora_parity.phases import SYNC_MODES, Run, StopRun, run_sequence
from lora_parity.receipt import (
    SCHEMA_VERSION,
    BackendInfo,
    Environment,
    ModelInfo,
    Receipt,
    Revision,
    Verdict,
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
    """receipts/<model>__<trainer>__<sampler>__<UTC time>.json (the model part names a non-default probe set)."""
    model = cfg_name if probes == "default" else f"{cfg_name}.{probes}"
    return Path("receipts") / f"{model}__{trainer}__{sampler}__{when.strftime('%Y%m%dT%H%M%SZ')}.json"


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
    """What `execute` produced."""

    receipt: Receipt
    path: Path


def execute(opts: RunOptions, progress: Callable[[str, str, float], None] | None = None) -> RunResult:
    """Preflight, run the sequence, write the receipt; return it and its path."""
    # Preflight: nothing here writes a file.
    cfg = config.load(opts.model)
    if opts.sync not in SYNC_MODES:
        raise ConfigError(f"unknown sync mode {opts.sync!r}; choose from {', '.join(SYNC_MODES)}")
    trainer_cls = backends.resolve("trainer", opts.trainer)
    sampler_cls = backends.resolve("sampler", opts.sampler)
    vocab = cfg.model.synthetic.vocab_size if cfg.model.synthetic else _vocab_of(cfg)
    probes = config.make_probes(cfg.probes, opts.probes, vocab)
    faults = Faults(opts.inject, list(cfg.adapter.targets), probes.num_scored_positions, cfg.budgets.mean)
    when = dt.datetime.now(dt.UTC).replace(microsecond=0)
    out = opts.out or default_out(cfg.name, opts.probes, opts.trainer, opts.sampler, when)
    if out.exists() and not opts.force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it")
    revision = git_revision(opts.revision)

    # The run: from here on, every outcome is a receipt.
    say = progress or (lambda phase, status, seconds: None)
    timings: dict[str, float] = {}
    trainer_info, sampler_info = _pending_backend(opts.trainer), _pending_backend(opts.sampler)
    model_info = ModelInfo(name=cfg.name, source=_source(cfg), config_digest=cfg.digest(), dtype=cfg.model.dtype)
    workdir = Path(tempfile.mkdtemp(prefix="lora-parity-"))
    run: Run | None = None
    trainer = sampler = None
    device = "unknown"
    start = time.perf_counter()
    error: str | None = None
    try:
        try:
            model_dir: Path | None = None
            if any(getattr(cls, "needs_checkpoint", True) for cls in (trainer_cls, sampler_cls)):
                t0 = time.perf_counter()
                model_dir = synthetic.materialize(cfg)
                timings["model.materialize"] = time.perf_counter() - t0
                model_info = model_info.model_copy(update={
                    "weights_digest": synthetic.weights_digest(model_dir), "architecture": _architecture(model_dir)})
                say("model", "ok", timings["model.materialize"])
            sampler = sampler_cls(cfg, model_dir, timings)
            sampler_info = sampler.info()
            say("sampler.start", "ok", timings.get("sampler.start", timings.get("sampler.load", 0.0)))
            trainer = trainer_cls(cfg, model_dir, opts.seed, timings)
            trainer_info = trainer.info()
            say("trainer.load", "ok", timings.get("trainer.load", 0.0))
            device = str(trainer_info.settings.get("device", sampler_info.settings.get("device", "cpu")))
        except Exception as e:  # noqa: BLE001 - a failed start is recorded in the receipt
            error = f"setup: {type(e).__name__}: {e}" if not isinstance(e, ConfigError) else f"setup: {e}"
            say("setup", "error", time.perf_counter() - start)
        if error is None:
            run = Run(cfg=cfg, trainer=trainer, sampler=sampler, sequences=probes.sequences, seed=opts.seed,
                      workdir=workdir, faults=faults, sync_mode=opts.sync, per_target=opts.per_target, progress=say)
            try:
                run_sequence(run)
            except StopRun:
                error = run.error
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    finally:
        for backend in (trainer, sampler):
            if backend is not None:
                backend.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if run is not None:
            timings.update(run.timings)
        timings["total"] = time.perf_counter() - start
        scores = run.scores if run else {}
        ev = checks.evaluate(scores, cfg.budgets, errored=error is not None)
        receipt = seal({
            "schema_version": SCHEMA_VERSION,
            "tool_version": __version__,
            "created_at": when.isoformat().replace("+00:00", "Z"),
            "command": list(opts.command),
            "revision": revision,
            "model": model_info,
            "trainer": trainer_info,
            "sampler": sampler_info,
            "environment": _environment(device),
            "budgets": cfg.budgets,
            "probes": probes,
            "perturbation": run.perturbation if run else None,
            "sync_mode": opts.sync,
            "adapters": run.adapters if run else [],
            "injected_fault": opts.inject,
            "phases": run.phases if run else [],
            "scores": scores,
            "comparisons": ev.comparisons,
            "deltas": ev.deltas,
            "checks": ev.checks,
            "verdict": ev.verdict,
            "error": error,
            "timings": {k: round(v, 6) for k, v in timings.items()},
        })
        assert receipt.verdict == Verdict.ERROR or error is None
        path = write_atomic(receipt, out, force=opts.force)
    return RunResult(receipt, path)


def _source(cfg: config.ModelConfig) -> str:
    if cfg.model.synthetic:
        return f"synthetic:{cfg.name}"
    if cfg.model.path:
        return Path(cfg.model.path).name
    return f"hf:{cfg.model.hf_id}"


def _read_hf_config(cfg: config.ModelConfig) -> dict[str, Any]:
    import json

    assert cfg.model.path is not None
    return json.loads((Path(cfg.model.path) / "config.json").read_text(encoding="utf-8"))


def _vocab_of(cfg: config.ModelConfig) -> int:
    if cfg.model.path is None:
        raise ConfigError(f"{cfg.name}: no local checkpoint to run (hub models are not downloaded)")
    vocab = _read_hf_config(cfg).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ConfigError(f"{cfg.model.path}/config.json: no valid vocab_size")
    return vocab


def _architecture(model_dir: Path) -> str | None:
    import json

    try:
        archs = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None
