"""`lora-parity verify --rerun`: re-execute the run a receipt describes and compare its scores.

What it proves, beyond `verify`: that the code and machine at hand, given the receipt's config,
probes, seed, backends, sync mode and injected fault, produce the receipt's raw scores again: bit for
bit on the CPU in fp32, within the repeat noise the receipt itself recorded elsewhere (a GPU engine
does not repeat exactly). It runs the current working tree; the answer says whether that is the
revision the receipt names. Exit 0: the scores match and the verdict is pass; 1: they match and the
verdict is not pass (as `verify`), or they differ (the first differing phase and position named); 2:
the run cannot be repeated here (a config or probe set that changed, a backend missing, an input the
receipt cannot give).

A receipt is data, never configuration: it may come from anyone (docs/threat-model.md). The run is
rebuilt from an allow-list of options (`CARRIED`) whose values `run` checks as it checks a user's;
a trust flag, a URL, a credential, an environment variable's name or a path is never taken from it.
The model is a shipped config named by the receipt, else the verifier's own `--model`; a Tinker run
needs the verifier's own `--tinker-url`.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import Receipt, Verdict
from lora_parity.evidence.receipt_io import one_line
from lora_parity.util.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, ConfigError

CARRIED = ("probes", "per_target", "tp", "reference", "dtype", "budgets", "base_model")
"""`run` options carried over from the receipt's recorded command line (checked by `run`'s own
preflight). Never `--trust-remote-code`, `--tinker-url`, `--sampler-url`, `--api-key-env`,
`--shared-dir`, `--adapter`, `--out` or `--model`: those are the verifier's to give."""
REPEATS = ("A.sampler_repeat", "A.trainer_repeat", "C.sampler_repeat")
SERVICE_BACKENDS = ("tinker",)
"""Backends that talk to a service at a URL: rerun only with the verifier's own `--tinker-url`."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_PROBE_SET = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

ParseCommand = Callable[[str, list[str]], dict[str, Any]]
"""The CLI's parser of a recorded command line: (`run` or `selftest`, its arguments) -> the values
of its options, parsed as the CLI parses them."""


@dataclass(frozen=True)
class RerunResult:
    """The comparison of a receipt with a fresh run of it."""

    code: int
    """0 the scores match and the verdict is pass, 1 they differ or the verdict is not pass, 2 the
    run could not be repeated."""
    message: str
    revision: str
    """Which code ran: the recorded revision, or the current tree and how it differs."""


@dataclass(frozen=True)
class VerifierInputs:
    """What the person running `verify --rerun` gives (the receipt never gives these)."""

    model: str | None = None
    """`--model`: a config name, YAML file or checkpoint folder, for a run on anything but a shipped config."""
    tinker_url: str | None = None
    """`--tinker-url`: the Tinker service a tinker run is repeated on."""
    probes: str | None = None
    """`--probes`: the probe file (or set) of a run whose probes were a file."""


def _command_params(command: list[str], parse: ParseCommand) -> dict[str, Any]:
    """The options of a recorded `run` or `selftest` command line, parsed as the CLI parses them."""
    if not command or command[0] not in ("run", "selftest"):
        return {}
    try:
        return parse(command[0], list(command[1:]))
    except Exception as e:  # click's usage errors
        raise ConfigError(f"the recorded command cannot be parsed: {one_line(str(e))}") from None


def shipped_config(name: str) -> str:
    """The shipped config (in `config.configs_dir()`) that `name`, taken from a receipt, names;
    `ConfigError` for anything else (a path, `../`, a name no config has)."""
    from lora_parity.models.config import configs_dir

    path = configs_dir() / f"{name}.yaml"
    if not _NAME.fullmatch(name) or ".." in name or not path.is_file():
        raise ConfigError(f"the receipt's model {one_line(repr(name))} is not a shipped config; a receipt never "
                          "names a path to load: pass the model with --model")
    return str(path)


def options_for(receipt: Receipt, parse: ParseCommand, mine: VerifierInputs = VerifierInputs()) -> Any:
    """The `RunOptions` that repeat the receipt's run: backends, sync mode and fault from the receipt,
    the `CARRIED` options from its recorded command line, the model from `mine.model` or a shipped
    config the receipt names, URLs only from `mine`. `ConfigError` when the run needs what only the
    verifier can give."""
    from lora_parity.run.options import RunOptions

    if receipt.sync_mode == "user":
        raise ConfigError("the receipt's run went through the Python API (lora_parity.api.check): its trainer, engine "
                          "and sync are the caller's objects; rerun the caller's test instead")
    recorded = _command_params(list(receipt.command), parse)
    params = {k: v for k, v in recorded.items() if k in CARRIED and v is not None}
    params["model"] = mine.model or shipped_config(str(recorded.get("model") or receipt.model.name))
    probes = str(params.get("probes") or receipt.probes.set)
    from_file = receipt.probes.source is not None and receipt.probes.source.kind == "file"
    if mine.probes is None and (from_file or probes.endswith(".jsonl") or not _PROBE_SET.fullmatch(probes)):
        raise ConfigError(f"the receipt's probes {one_line(repr(probes))} are a file; a receipt never names a "
                          "path to read: pass your copy with --probes")
    params["probes"] = mine.probes or probes
    service = [b for b in (receipt.trainer.backend, receipt.sampler.backend) if b in SERVICE_BACKENDS]
    if service and mine.tinker_url is None:
        raise ConfigError(f"the receipt's run used a {service[0]} service; a receipt never names a URL to "
                          "contact: pass the service with --tinker-url")
    if mine.tinker_url is not None:
        params["tinker_url"] = mine.tinker_url
    else:
        params.pop("base_model", None)
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
    from lora_parity.models.provenance import git_revision

    current, recorded = git_revision(None), receipt.revision
    if current.source == "git" and current.commit == recorded.commit and not current.dirty:
        return f"at the recorded revision {recorded.commit[:12]}"
    now = f"{current.commit[:12]}{' with uncommitted changes' if current.dirty else ''}"
    return f"the current tree ({now}); the receipt was made at {recorded.commit[:12]}: the revisions differ"


def plan_for(receipt: Receipt, parse: ParseCommand, mine: VerifierInputs = VerifierInputs()) -> tuple[Any, Any]:
    """The options (`options_for`) and the preflight plan (`runner.prepare`) of the receipt's run, checked to be its
    config and probes (their digests); `ConfigError` otherwise. Used by `rerun` and `locate`."""
    from lora_parity.run.runner import prepare

    opts = options_for(receipt, parse, mine)
    plan = prepare(opts)
    if plan.cfg.digest() != receipt.model.config_digest:
        raise ConfigError(f"config {plan.cfg.name} is not the one the receipt ran (its digest changed)")
    if plan.probes.digest != receipt.probes.digest:
        raise ConfigError(f"probes {opts.probes} are not the receipt's (their digest differs)")
    return opts, plan


def rerun(receipt: Receipt, parse: ParseCommand, mine: VerifierInputs = VerifierInputs(),
          progress: Any = None) -> RerunResult:
    """Repeat the receipt's run (nothing is written beside it) and compare the raw scores; the exit
    code then follows the receipt's verdict, as `verify`'s does. `parse` is the CLI's parser of the
    recorded command line; `mine` what the verifier gave."""
    from lora_parity.run.runner import execute

    note = _revision_note(receipt)
    try:
        opts, _ = plan_for(receipt, parse, mine)
    except ConfigError as e:
        return RerunResult(EXIT_BAD_INPUT, f"cannot rerun: {e}", note)
    with tempfile.TemporaryDirectory(prefix="lora-parity-rerun-") as tmp:
        from dataclasses import replace

        fresh = execute(replace(opts, out=Path(tmp) / "rerun.json"), progress=progress).receipt
    if fresh.error is not None and receipt.error is None:  # e.g. a GPU receipt re-run on a CPU machine: the cause
        return RerunResult(EXIT_BAD_INPUT, f"cannot rerun here: the rerun stopped: {one_line(fresh.error)}", note)
    tol = tolerance(receipt)
    how = "bit for bit" if tol == 0 else f"within the recorded repeat noise {tol:.3g}"
    diff = first_difference(receipt.scores, fresh.scores, tol)
    if diff is not None:
        return RerunResult(EXIT_FAIL, f"rerun differs ({how}): {diff}", note)
    verdict = receipt.verdict
    code = EXIT_PASS if verdict == Verdict.PASS else EXIT_FAIL
    return RerunResult(code, f"rerun reproduces every score ({len(receipt.scores)} phases, {how}); "
                             f"verdict {verdict.value}", note)
