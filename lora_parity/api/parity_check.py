"""`check`: the A/B/C sequence on the caller's own trainer, engine and sync, run by lora-parity's runner (the same
phases, per-target and per-layer coverage, noise model, checks, verdict and receipt as `lora-parity run`), and
its `Result`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ValidationError

from lora_parity.api import tensors as tn
from lora_parity.api.caller import (
    BACKEND,
    NO_BASE,
    CallerCachedEngine,
    CallerEngine,
    CallerTensorTrainer,
    CallerTrainer,
)
from lora_parity.api.protocols import CachedScoringEngine, Engine, Sync, TensorLoadingEngine, Trainer
from lora_parity.evidence import outpath, tracebacks
from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict
from lora_parity.models.config import AdapterSpec, ModelConfig, ModelSpec, PerturbationSpec, ProbeSpec, profile_budgets
from lora_parity.models.provenance import git_revision
from lora_parity.run import probes as probe_sources
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import Backends, Plan, run_once
from lora_parity.run.sync import CallerSync
from lora_parity.util.errors import ConfigError, PhaseError
from lora_parity.verdict import checks as verdict_checks
from lora_parity.verdict import explain

MAX_SEQUENCES = 256
"""Most sequences one check scores (as a probe file: `probes.max_sequences`' default)."""
Progress = Callable[[str, str, float], None]
"""Called after each phase with (phase, 'ok' or 'error', seconds)."""
Dtype = Literal["float32", "bfloat16", "float16"]
"""What the caller's models compute in."""
Std = float | Literal["auto"]
"""The std of the noise on B, or 'auto': calibrated on the trainer (`perturbation.std`)."""


@dataclass(frozen=True)
class Result:
    """What `check` found: the receipt (the same schema as the CLI's) and where it was written."""

    receipt: Receipt
    path: Path | None
    """The receipt file (`out`), or None where `check` was given none."""

    @property
    def verdict(self) -> Verdict:
        """pass, fail, inconclusive or error."""
        return self.receipt.verdict

    @property
    def passed(self) -> bool:
        """The verdict is pass."""
        return self.receipt.verdict == Verdict.PASS

    @property
    def failed_checks(self) -> list[str]:
        """Ids of the checks that failed, in order (`C.parity.mean`, `X.sync.identical`, `T.q_proj.slope`, ...)."""
        return [c.id for c in self.receipt.checks if c.status == CheckStatus.FAIL]

    def summary(self) -> str:
        """The verdict, the run's error if any, one line per check that did not pass (what it means), and why
        phases were skipped (an engine without a base-model route: `BaseScoringEngine`)."""
        receipt = self.receipt
        lines = [f"lora-parity: verdict {receipt.verdict.value}"]
        if receipt.error:
            lines.append(f"  error: {receipt.error}")
        if receipt.sampler.settings.get("base_model") == NO_BASE:
            lines.append(f"  base phases skipped: {NO_BASE}")
        failing = frozenset(self.failed_checks)
        for c in verdict_checks.not_passing(receipt.checks):
            why = c.reason if c.status == CheckStatus.NOT_REACHED else f"{c.status.value}: {explain.line(c, failing)}"
            lines.append(f"  {c.id}: {why}")
        if self.path is not None:
            lines.append(f"  receipt: {self.path}")
        return "\n".join(lines)


def check(trainer: Trainer, engine: Engine, sync: Sync, sequences: Sequence[Sequence[int]], *,
          alpha: float, targets: Sequence[str] | None = None, rank: int | None = None, seed: int = 0,
          dtype: Dtype = "float32", budgets: str | None = None, std: Std = "auto", per_target: bool = True,
          per_layer: bool = True, out: Path | str | None = None, force: bool = False, model: str = "caller-model",
          reference: Path | str | None = None, revision: str | None = None,
          progress: Progress | None = None) -> Result:
    """Run base → zero-init → update → stale → sync → fresh → per-target (and per-layer) coverage on the caller's
    objects and judge it as `lora-parity run` does; return the `Result` (write the receipt to `out` if given).

    `trainer` and `engine` follow `lora_parity.api.protocols`; `sync()` is the caller's own sync, called once per
    adapter version. The start point is the trainer's A with B zero; lora-parity's update is seeded noise on B
    (`std`, or 'auto': calibrated on the trainer). Targets and rank are read from the trainer's tensor names and
    shapes (given, they must match); `alpha` is recorded. `dtype` is what the models compute in; it picks the
    budget profile where `budgets` names none ('fp32' for float32, else 'bf16'). `reference` is the folder of the
    base model's HF checkpoint (config.json, safetensors) the two sides compute on: where given, its fp32 copy scores
    the start point as `lora-parity run` scores it, and A is judged by what precision explains (each side's distance
    from fp32) instead of the profile's fixed budgets. On return the trainer holds its tensors as they were, and
    `sync()` has been called once more, so the engine serves them again.

    Bad input (no tensors, a name that is not a LoRA tensor's, an existing `out` without `force`) raises
    `ConfigError` before anything runs; once the sequence starts every outcome, an exception in the caller's
    code included, ends in a receipt (verdict error)."""
    _require(trainer, "trainer", ("score", "lora_state_dict", "load_lora_state_dict"))
    _require(engine, "engine", ("score",))
    if not callable(sync):
        raise ConfigError(f"sync: {type(sync).__name__} is not callable (the caller's sync takes no arguments)")
    start = tn.read_state(trainer.lora_state_dict(), "trainer")
    layout = tn.layout(start)
    rows = [seq.tolist() if hasattr(seq, "tolist") else seq for seq in sequences]  # numpy or torch rows too
    probes = probe_sources.given(rows, MAX_SEQUENCES)
    folder = _reference_folder(reference)
    cfg = _config(model, dtype, layout, targets, rank, alpha, budgets, std, per_target, probes.sequences, folder)
    loads = isinstance(engine, TensorLoadingEngine)
    path = Path(out) if out is not None else None
    if path is not None:
        outpath.check_writable(path, force, option="out")
    wrapped = (CallerTensorTrainer if loads else CallerTrainer)(trainer, start)
    opts = RunOptions(model=model, trainer=BACKEND, sampler=BACKEND, sync=CallerSync.name, seed=seed,
                      per_target=per_target, per_layer=per_layer, out=path, force=force, revision=revision)
    sampler = (CallerCachedEngine if isinstance(engine, CachedScoringEngine) else CallerEngine)(engine)
    plan = Plan(opts, cfg, type(wrapped), type(sampler), CallerSync(sync), probes, git_revision(revision), {},
                trainer=wrapped, sampler=sampler, reference_checkpoint=folder is not None)
    try:
        result = _run(plan, progress or (lambda phase, status, seconds: None))
    except BaseException:
        _restore(wrapped, sync, None)
        raise
    _restore(wrapped, sync, result)
    return result


def _reference_folder(reference: Path | str | None) -> Path | None:
    """The `reference` checkpoint folder; `ConfigError` where it is not one (before anything runs)."""
    if reference is None:
        return None
    folder = Path(reference)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"reference: {folder} is not a model folder (no config.json in it)")
    return folder


def _require(obj: object, who: str, methods: tuple[str, ...]) -> None:
    """`ConfigError` naming the methods of its protocol (`lora_parity.api.protocols`) that `obj` lacks."""
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"{who}: {type(obj).__name__} has no {', '.join(missing)} (lora_parity.api.protocols)")


def _restore(trainer: CallerTrainer, sync: Sync, result: Result | None) -> None:
    """The caller's tensors back as they were, and synced once more. Where that fails after the run, `PhaseError`
    names the run's verdict and receipt; while the run's own exception is on its way (`result` None), it goes on."""
    try:
        trainer.restore()
        sync()
    except Exception as e:
        if result is None:
            return
        where = f", receipt {result.path}" if result.path is not None else ""
        raise PhaseError(f"the check ended (verdict {result.verdict.value}{where}), but putting the trainer's "
                         f"tensors back and syncing them failed: {tracebacks.one_line(e)}") from e


def _run(plan: Plan, say: Progress) -> Result:
    """One pass of the runner on the plan's backends; the receipt at `opts.out`, else in a folder removed after."""
    out, force = plan.opts.out, plan.opts.force
    lock = outpath.claim(out, force) if out is not None else None
    try:
        with tempfile.TemporaryDirectory(prefix="lora-parity-api-") as scratch:
            loaded = Backends(plan, say)
            try:
                loaded.open()
                result = run_once(plan, loaded, None, out or Path(scratch) / "receipt.json", force, say)
            finally:
                loaded.close()
    finally:
        if lock is not None:
            lock.release()
    return Result(result.receipt, result.path if out is not None else None)


def _config(model: str, dtype: Dtype, layout: tn.Layout, targets: Sequence[str] | None, rank: int | None,
            alpha: float, budgets: str | None, std: Std, per_target: bool,
            sequences: list[list[int]], reference: Path | None = None) -> ModelConfig:
    """The run's config: the adapter as the trainer's tensors show it, the update, the budgets; `ConfigError` where
    the given targets or rank are not the tensors'."""
    if targets is not None and sorted(targets) != sorted(layout.targets):
        raise ConfigError(f"targets {sorted(targets)}: the trainer's LoRA tensors are on {sorted(layout.targets)}")
    if rank is not None and rank != layout.rank:
        raise ConfigError(f"rank {rank}: the trainer's LoRA tensors have rank {layout.rank}")
    profile = budgets or ("fp32" if dtype == "float32" else "bf16")
    try:
        return ModelConfig(
            name=model, description="the caller's trainer and engine (lora_parity.api.check)",
            model=ModelSpec(path=str(reference) if reference is not None else model, dtype=dtype),
            adapter=AdapterSpec(rank=layout.rank, alpha=alpha, targets=list(targets or layout.targets)),
            perturbation=PerturbationSpec(std=std),
            probes=ProbeSpec(lengths=[len(s) for s in sequences], seeds={"default": 0}, max_sequences=MAX_SEQUENCES),
            budgets=profile_budgets(profile), per_target=per_target)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(top)"
        raise ConfigError(f"check: {where}: {first.get('msg')}") from None

