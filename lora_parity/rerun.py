"""`lora-parity verify --rerun`: re-execute the run a receipt describes and compare its scores.

What it proves, beyond `verify`: that the code and machine at hand, given the receipt's config,
probes, seed, backends, sync mode and injected fault, produce the receipt's raw scores again: bit for
bit on the CPU in fp32, within the repeat noise the receipt itself recorded elsewhere (a GPU engine
does not repeat exactly). It runs the current working tree; the answer says whether that is the
revision the receipt names. Exit 0: the scores match; 1: they differ (the first differing phase and
position named); 2: the run cannot be repeated here (a config or probe set that changed, a backend
missing).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, ConfigError
from lora_parity.receipt import Receipt

_OPTION_PARAMS = ("model", "probes", "seed", "per_target", "tinker_url", "base_model", "tp", "reference",
                  "dtype", "trust_remote_code")
"""`run` options carried over from the receipt's recorded command line."""
REPEATS = ("A.sampler_repeat", "A.trainer_repeat", "C.sampler_repeat")


@dataclass(frozen=True)
class RerunResult:
    """The comparison of a receipt with a fresh run of it."""

    code: int
    """0 the scores match, 1 they differ, 2 the run could not be repeated."""
    message: str
    revision: str
    """Which code ran: the recorded revision, or the current tree and how it differs."""


def _command_params(command: list[str]) -> dict[str, Any]:
    """The options of a recorded `run` or `selftest` command line, parsed as the CLI parses them."""
    if not command or command[0] not in ("run", "selftest"):
        return {}
    import typer

    from lora_parity.cli import app

    sub = typer.main.get_command(app).commands[command[0]]  # type: ignore[attr-defined]
    try:
        return dict(sub.make_context(command[0], list(command[1:]), resilient_parsing=True).params)
    except Exception as e:  # click's usage errors
        raise ConfigError(f"the recorded command cannot be parsed: {e}") from None


def options_for(receipt: Receipt) -> Any:
    """The `RunOptions` that repeat the receipt's run (backends, sync mode and fault from the receipt;
    the rest from its recorded command line, defaulting to the receipt's model and probe set)."""
    from lora_parity.runner import RunOptions

    params = {k: v for k, v in _command_params(list(receipt.command)).items() if k in _OPTION_PARAMS and v is not None}
    params.setdefault("model", receipt.model.name)
    params.setdefault("probes", receipt.probes.set)
    if receipt.perturbation is not None:
        params["seed"] = receipt.perturbation.seed
    return RunOptions(trainer=receipt.trainer.backend, sampler=receipt.sampler.backend, sync=receipt.sync_mode,
                      inject=receipt.injected_fault, **params)


def tolerance(receipt: Receipt) -> float:
    """0 on the CPU in fp32 (bit-identical); else the largest repeat noise the receipt recorded."""
    if receipt.environment.device == "cpu" and receipt.model.dtype == "float32":
        return 0.0
    noise = [c.max_abs for k, c in receipt.comparisons.items() if k in REPEATS and c.max_abs is not None]
    return max(noise, default=0.0)


def first_difference(recorded: dict[str, list[list[float]]], fresh: dict[str, list[list[float]]],
                     tol: float) -> str | None:
    """The first phase (in recorded order) and position where `fresh` is not `recorded` within `tol`."""
    for key, seqs in recorded.items():
        if key not in fresh:
            return f"phase {key}: not reached in the rerun"
        for s, (old, new) in enumerate(zip(seqs, fresh[key], strict=False)):
            if len(old) != len(new):
                return f"phase {key}, sequence {s}: {len(new)} positions, recorded {len(old)}"
            for t, (a, b) in enumerate(zip(old, new, strict=True)):
                if not (a == b or (tol > 0 and math.isfinite(a - b) and abs(a - b) <= tol)):
                    return f"phase {key}, sequence {s}, position {t}: {b!r}, recorded {a!r} (|diff| {abs(a - b):.3g})"
    extra = [k for k in fresh if k not in recorded]
    return f"phase {extra[0]}: scored in the rerun, not in the receipt" if extra else None


def _revision_note(receipt: Receipt) -> str:
    from lora_parity.provenance import git_revision

    current, recorded = git_revision(None), receipt.revision
    if current.source == "git" and current.commit == recorded.commit and not current.dirty:
        return f"at the recorded revision {recorded.commit[:12]}"
    now = f"{current.commit[:12]}{' with uncommitted changes' if current.dirty else ''}"
    return f"the current tree ({now}); the receipt was made at {recorded.commit[:12]}: the revisions differ"


def rerun(receipt: Receipt, progress: Any = None) -> RerunResult:
    """Repeat the receipt's run (nothing is written beside it) and compare the raw scores."""
    from lora_parity.runner import execute, prepare

    note = _revision_note(receipt)
    try:
        opts = options_for(receipt)
        plan = prepare(opts)
        if plan.cfg.digest() != receipt.model.config_digest:
            raise ConfigError(f"config {plan.cfg.name} is not the one the receipt ran (its digest changed)")
        if plan.probes.digest != receipt.probes.digest:
            raise ConfigError(f"probes {opts.probes} are not the receipt's (their digest differs)")
    except ConfigError as e:
        return RerunResult(EXIT_BAD_INPUT, f"cannot rerun: {e}", note)
    with tempfile.TemporaryDirectory(prefix="lora-parity-rerun-") as tmp:
        from dataclasses import replace

        fresh = execute(replace(opts, out=Path(tmp) / "rerun.json"), progress=progress).receipt
    tol = tolerance(receipt)
    how = "bit for bit" if tol == 0 else f"within the recorded repeat noise {tol:.3g}"
    diff = first_difference(receipt.scores, fresh.scores, tol)
    if diff is not None:
        return RerunResult(EXIT_FAIL, f"rerun differs ({how}): {diff}", note)
    return RerunResult(EXIT_PASS, f"rerun reproduces every score ({len(receipt.scores)} phases, {how})", note)
