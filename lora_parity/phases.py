"""The sequence: base → zero-init → perturb → stale → sync → republish, then per-target coverage
(and, where sampler and trainer share a service, the stale adapter again and the trainer once more).

`run_sequence` reads top to bottom; each step is a small method of `Run` that records its scores,
adapters and timing. Checks are not made here: `checks.evaluate` derives them from the recorded
scores afterwards, the same way `lora-parity verify` does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_parity import stats
from lora_parity.backends.base import AdapterHandle, Sampler, Scores, Trainer
from lora_parity.config import ModelConfig
from lora_parity.errors import LoraParityError, ScoreError
from lora_parity.faults import Faults
from lora_parity.receipt import AdapterVersion, Perturbation, PhaseRecord, PhaseStatus

SYNC_MODES = ("new-id", "inplace", "merged", "memory")
# Modes where the trainer merges alpha/r·BA into the base weights and the sampler, running without
# LoRA, reloads its base weights in place: from a folder (merged) or from tensors in memory (memory).
MERGED_MODES = ("merged", "memory")


def run_sequence(run: Run) -> None:
    """Every phase in order; stops at the first phase that raises (recorded as an error)."""
    if run.sampler_scores_base:
        run.step("base", lambda: run.sampler_score("base", None))
    run.step("publish_zero", run.publish_zero)
    run.step("zero", lambda: run.sampler_score("zero", run.handle, repeat=True))
    run.step("trainer_zero", lambda: run.trainer_score("trainer_zero", repeat=True))
    if run.reference is not None:
        run.step("reference_fp32", run.reference_score)
    run.step("perturb", run.perturb)
    run.step("trainer_updated", lambda: run.trainer_score("trainer_updated"))
    run.step("stale", run.stale)
    run.step("sync", run.sync)
    run.step("updated", lambda: run.sampler_score("updated", run.handle, repeat=True))
    if run.sampler_shares_trainer_state:
        # The old sampling client again, now that a newer one was used: does the trainer keep its update?
        run.step("stale_after_sync", lambda: run.sampler_score("stale_after_sync", run.stale_handle))
        run.step("trainer_after_stale", lambda: run.trainer_score("trainer_after_stale"))
    if run.cfg.per_target and run.per_target and run.trainer_has_per_target:
        for kind in run.cfg.adapter.targets:
            run.step(f"target.{kind}", functools.partial(run.target_coverage, kind))


class StopRun(Exception):
    """Raised by `Run.step` after recording a failed phase; ends the sequence."""


@dataclass
class Run:
    """State of one run: backends, probes, and everything recorded so far."""

    cfg: ModelConfig
    trainer: Trainer
    sampler: Sampler
    sequences: list[list[int]]
    seed: int
    workdir: Path
    faults: Faults
    sync_mode: str = "new-id"
    per_target: bool = True
    progress: Callable[[str, str, float], None] = lambda phase, status, seconds: None
    scores: dict[str, Scores] = field(default_factory=dict)
    phases: list[PhaseRecord] = field(default_factory=list)
    adapters: list[AdapterVersion] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    perturbation: Perturbation | None = None
    handle: AdapterHandle | None = None
    stale_handle: AdapterHandle | None = None
    """The adapter the stale phase scored (the one published before the update)."""
    error: str | None = None
    zero_tensors: object = None
    """Merged zero-init weights kept for the stale-tensors fault only."""
    first_adapter_id: int = 1
    """Adapter ids of this run start here, so that runs sharing a sampler never reuse an id."""
    reference: Callable[[list[list[int]]], Scores] | None = None
    """Scores the base model in fp32 (`--reference fp32`): what both sides approximate at zero-init."""

    @property
    def sampler_scores_base(self) -> bool:
        """False for a sampler that cannot serve the base model (its info says why)."""
        return getattr(self.sampler, "base_unavailable", None) is None

    @property
    def sampler_shares_trainer_state(self) -> bool:
        """True for a sampler whose adapters are handles on the trainer's own service (Tinker): an old
        one may serve the trainer's current weights, or write its own back into them."""
        return bool(getattr(self.sampler, "shares_trainer_state", False))

    @property
    def trainer_has_per_target(self) -> bool:
        """False for a trainer that updates every target together (its info says why)."""
        return getattr(self.trainer, "per_target_unavailable", None) is None

    @property
    def next_adapter_id(self) -> int:
        """The first id a later run on the same sampler may use."""
        return self.first_adapter_id + len(self.adapters) + 1

    def step(self, name: str, action: Callable[[], object]) -> None:
        """Run one phase, timing it; on an exception record it and stop the sequence."""
        start = time.perf_counter()
        try:
            self.faults.on_phase(name)
            action()
        except Exception as e:
            seconds = time.perf_counter() - start
            message = str(e) if isinstance(e, LoraParityError) else f"{type(e).__name__}: {e}"
            self.error = f"phase {name}: {message}"
            self.phases.append(PhaseRecord(name=name, status=PhaseStatus.ERROR, seconds=seconds, message=message))
            self.progress(name, "error", seconds)
            raise StopRun(self.error) from e
        seconds = time.perf_counter() - start
        self.phases.append(PhaseRecord(name=name, status=PhaseStatus.OK, seconds=seconds))
        self.timings[name] = seconds
        self.progress(name, "ok", seconds)

    def _record(self, key: str, scores: Scores) -> None:
        stats.check_finite(scores, key)
        expected = [len(s) - 1 for s in self.sequences]
        if [len(s) for s in scores] != expected:
            raise ScoreError(f"{key}: scored positions {[len(s) for s in scores]}, expected {expected}")
        self.scores[key] = scores

    def _timed(self, key: str, fn: Callable[[], Scores]) -> Scores:
        start = time.perf_counter()
        out = fn()
        self.timings[f"score.{key}"] = time.perf_counter() - start
        return out

    def reference_score(self) -> None:
        """The fp32 reference scores (informational: comparisons R.*, no checks)."""
        assert self.reference is not None
        reference = self.reference
        self._record("reference_fp32", self._timed("reference_fp32", lambda: reference(self.sequences)))

    def sampler_score(self, key: str, handle: AdapterHandle | None, repeat: bool = False) -> None:
        """Sampler scores under `handle` (None: base model), twice with `repeat`."""
        for k in (key, f"{key}_repeat") if repeat else (key,):
            raw = self._timed(k, lambda: self.sampler.score(self.sequences, handle))
            self._record(k, self.faults.sampler_scores(raw))

    def trainer_score(self, key: str, repeat: bool = False) -> None:
        """Trainer scores of its current state, twice with `repeat`."""
        for k in (key, f"{key}_repeat") if repeat else (key,):
            self._record(k, self._timed(k, lambda: self.trainer.score(self.sequences)))

    def publish(self, version: int, label: str = "") -> AdapterHandle | None:
        """Export the trainer's adapter to a new folder and load it on the sampler: a new name and
        id per version (`new-id`), or the same ones reloaded in place (`inplace`); in the merged
        modes, reload the sampler's base weights with the adapter merged in (no handle)."""
        if self.sync_mode in MERGED_MODES:
            self._publish_merged(version, label)
            return None
        start = time.perf_counter()
        folder = self.trainer.export_adapter(self.workdir / f"adapter-v{version}{label}")
        self.faults.after_export(version, folder)
        if self.sync_mode == "inplace" and self.handle is not None:
            name, adapter_id = self.handle.name, self.handle.adapter_id
        else:
            adapter_id = self.first_adapter_id + version
            name = f"lora-parity-{adapter_id}-v{version}"
        inplace = self.sync_mode == "inplace" and not self.faults.is_("no-reload-flag")
        handle = self.sampler.publish(folder, name, adapter_id, inplace=inplace)
        seconds = time.perf_counter() - start
        self.adapters.append(AdapterVersion(version=version, name=name, adapter_id=adapter_id,
                                            mode=self.sync_mode, seconds=seconds))
        self.timings[f"publish.v{version}"] = seconds
        previous, self.handle = self.handle, handle
        if previous is not None and previous.adapter_id != handle.adapter_id:
            self.sampler.retire(previous)
        return handle

    def publish_zero(self) -> None:
        """Publish the zero-init adapter (version 0)."""
        if self.faults.is_("stale-tensors"):
            self.zero_tensors = self.trainer.merged_tensors()  # type: ignore[attr-defined]
        self.publish(version=0)

    def _publish_merged(self, version: int, label: str = "") -> None:
        start = time.perf_counter()
        folder = self.workdir / f"merged-v{version}{label}"
        if self.sync_mode == "merged":
            self.sampler.reload_base(folder=self.trainer.export_merged(folder))  # type: ignore[attr-defined]
        else:
            self.sampler.reload_base(tensors=self.trainer.merged_tensors())  # type: ignore[attr-defined]
        seconds = time.perf_counter() - start
        self.adapters.append(AdapterVersion(version=version, name=folder.name, adapter_id=0, mode=self.sync_mode,
                                            seconds=seconds))
        self.timings[f"publish.v{version}"] = seconds

    def perturb(self) -> None:
        """The deterministic trainer-only update of the LoRA B tensors (not published)."""
        if self.faults.is_("frozen-trainer"):
            return
        self.perturbation = self.trainer.perturb(self.cfg.perturbation.std, self.seed)

    def stale(self) -> None:
        """Sampler scores of the published zero-init adapter while the trainer has moved on."""
        if self.faults.is_("leak") and self.sync_mode in MERGED_MODES:
            self._publish_merged(version=len(self.adapters), label="-leak")
        elif self.faults.is_("leak"):
            assert self.handle is not None
            folder = self.trainer.export_adapter(self.workdir / "adapter-leak")
            self.sampler.publish(folder, self.handle.name, self.handle.adapter_id, inplace=True)
        self.stale_handle = self.handle
        self.sampler_score("stale", self.handle)

    def sync(self) -> None:
        """Publish the updated adapter."""
        if self.faults.is_("skip-sync"):
            return
        if self.faults.is_("reuse-adapter-id"):
            assert self.handle is not None
            folder = self.trainer.export_adapter(self.workdir / "adapter-v1")
            self.sampler.publish(folder, self.handle.name, self.handle.adapter_id, inplace=False)
            return
        if self.faults.is_("stale-path"):
            # The updated weights are written, but the sampler reloads from the zero-init folder.
            self.trainer.export_merged(self.workdir / "merged-v1")  # type: ignore[attr-defined]
            self.sampler.reload_base(folder=self.workdir / "merged-v0")  # type: ignore[attr-defined]
            return
        if self.faults.is_("stale-tensors"):
            # The sampler is handed a copy of the weights taken before the update.
            self.sampler.reload_base(tensors=self.zero_tensors)  # type: ignore[attr-defined]
            return
        self.publish(version=1)

    def retire(self) -> None:
        """Unload the adapter this run left on the sampler; in the merged modes, give the sampler its
        original base weights back."""
        if self.sync_mode in MERGED_MODES and self.adapters:
            self.sampler.reset_base()  # type: ignore[attr-defined]
        if self.handle is not None:
            self.sampler.retire(self.handle)
            self.handle = None

    def target_coverage(self, kind: str) -> None:
        """From zero-init, perturb target kind `kind` alone, sync, and score both sides."""
        self.trainer.zero_b()
        self.trainer.perturb(self.cfg.perturbation.std, self.seed, only=kind)
        self.trainer_score(f"target.{kind}.trainer")
        self.publish(version=len(self.adapters), label=f"-{kind}")
        self.sampler_score(f"target.{kind}.sampler", self.handle)
