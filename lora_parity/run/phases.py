"""The sequence: base → zero-init → perturb → stale → sync (→ fresh) → republish, then sleep and wake where asked
(`sleep_wake`), then per-target coverage (and, where sampler and trainer share a service, the stale adapter again and
the trainer once more; where the sampler scores through its prefix cache, stale and updated read that way too). With
`--probes sampled` the sampler first completes the probes (`sample`), and after sync generates from the same prompts
again (`generate_updated`); docs/probes-and-adapters.md. `run_sequence` reads top to bottom; each step is a method of
`Run` that records its scores, adapters and timing. `checks.evaluate` derives the checks afterwards, as verify does."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lora_parity.backends.base import (
    AdapterHandle,
    CachedScoringSampler,
    Sampler,
    Scores,
    SteppingTrainer,
    TensorReadingTrainer,
    Trainer,
)
from lora_parity.evidence import tracebacks
from lora_parity.evidence.receipt import (
    AdapterVersion,
    Calibration,
    ErrorDetail,
    Perturbation,
    PhaseRecord,
    PhaseStatus,
)
from lora_parity.models import update_step
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import RECIPE
from lora_parity.run import calibrate_trainer, engine_state, generation, layer_coverage, mixed_batch, reference_points
from lora_parity.run.faults import Faults
from lora_parity.run.loop import after_sync as after_loop_sync
from lora_parity.run.route_replay import Replay
from lora_parity.run.sleep_wake import after_sync as sleep_and_wake
from lora_parity.run.sync import SyncMode
from lora_parity.run.sync import mode as sync_mode_named
from lora_parity.util.errors import ScoreError
from lora_parity.verdict import stats
from lora_parity.verdict.routes import OWN_ROUTES, SEARCH_KEY

if TYPE_CHECKING:
    from lora_parity.backends import fp32_points

T = TypeVar("T")

FRESH_ID_OFFSET = 1_000_000
"""The fresh load's adapter id is the run's first id plus this: never an id a sync of this run or a later run on the
same sampler uses (they count up from the run's first id by one per version)."""
WARM_FOLDER = "warm-start"  # where in the run's folder the warm start adapter (`--update step`) is written


def run_sequence(run: Run) -> None:
    """Every phase in order; stops at the first phase that raises (recorded as an error)."""
    if run.warm_start:
        run.step("warm_start", run.warm)
    _base_and_publish_zero(run)
    run.step("zero", lambda: run.sampler_score("zero", run.handle, repeat=True))
    run.step("trainer_zero", run.trainer_zero)
    if run.reference is not None:
        run.step("reference_fp32", run.reference_score)
    if run.calibrates:
        run.step("calibrate", run.calibrate)
    run.step("perturb", run.perturb)
    _trainer_updated(run, after_engine=False)
    run.step("stale", run.stale)
    if run.sampler_reads_prefix_cache:  # warm the prefix cache with the old adapter
        run.step("stale_cached", lambda: run.cached_score("stale_cached", run.handle))
    run.step("sync", run.sync)
    run.step("updated", lambda: run.sampler_score("updated", run.handle, repeat=True))
    _trainer_updated(run, after_engine=True)
    if run.sampler_reads_prefix_cache:  # ... and read after sync, before `fresh` (whose retire clears the cache)
        run.step("updated_cached", lambda: run.cached_score("updated_cached", run.handle))
    if run.checks_fresh:  # the trainer's tensors loaded fresh must score exactly as the synced adapter
        run.step("fresh", run.fresh)
    if run.sampled:
        run.step("generate_updated", run.generate_updated)
    engine_state.after_sync(run)
    if run.sampler_shares_trainer_state:
        # The old sampling client again, now that a newer one was used: does the trainer keep its update?
        run.step("stale_after_sync", lambda: run.sampler_score("stale_after_sync", run.stale_handle))
        run.step("trainer_after_stale", lambda: run.trainer_score("trainer_after_stale"))
    sleep_and_wake(run)
    engine_state.merged_fresh(run)  # X where the sync merges: the weights handed over again at once
    _coverage_and_reference(run)


def _trainer_updated(run: Run, after_engine: bool) -> None:
    """The updated trainer, scored two ways: right after the update, or with route replay after the engine's
    updated pass, whose routes it replays (`after_engine`)."""
    if run.replay.on == after_engine:
        run.step("trainer_updated", lambda: run.trainer_score("trainer_updated"))
        run.step("trainer_updated_alt", run.trainer_score_alone)


def _coverage_and_reference(run: Run) -> None:
    """Per-target coverage, then the fp32 and the exact references at every point the trainer moved to."""
    for kind in run.covered_targets:
        run.step(f"target.{kind}", functools.partial(run.target_coverage, kind))
    if run.exact_states:  # before per-layer coverage: a target the engine computes exactly needs none
        run.step("exact_reference", functools.partial(reference_points.score_exact, run))
    for kind, group in layer_coverage.groups_of(run):
        run.step(f"target.{layer_coverage.tag(kind, group)}", functools.partial(layer_coverage.cover, run, kind, group))
    engine_state.after_coverage(run, bool(run.covered_targets))
    if run.reference_states:
        run.step("reference_updated", functools.partial(reference_points.score, run))
    if run.exact_states:
        run.step("exact_reference_layers", functools.partial(reference_points.score_exact, run, "layers"))
    engine_state.after_run(run)


def _base_and_publish_zero(run: Run) -> None:
    """The base model, then the zero-init adapter published; with `--probes sampled` the adapter is
    published first, and the probes sampled from it before anything is scored."""
    if run.sampled:
        run.step("publish_zero", run.publish_zero)
        run.step("sample", run.sample)
    if run.sampler_scores_base:
        run.step("base", lambda: run.sampler_score(run.base_key, None))
    if not run.sampled:
        run.step("publish_zero", run.publish_zero)


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
    sync_mode: str | SyncMode = "new-id"
    per_target: bool = True
    per_layer: bool = True
    """Per-layer coverage after per-target coverage (`layer_coverage`)."""
    per_target_only: tuple[str, ...] | None = None
    """Per-target coverage of these target kinds only (None: every target)."""
    progress: Callable[[str, str, float], None] = lambda phase, status, seconds: None
    scores: dict[str, Scores] = field(default_factory=dict)
    phases: list[PhaseRecord] = field(default_factory=list)
    adapters: list[AdapterVersion] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    perturbation: Perturbation | None = None
    handle: AdapterHandle | None = None
    stale_handle: AdapterHandle | None = None
    """The adapter the stale phase scored (the one published before the update)."""
    kept: AdapterHandle | None = None
    """The version the sync replaced, kept loaded until `engine_state` scored it (`SyncMode.keeps_versions`)."""
    base_restored: bool = False
    """The merged modes' restore gave the sampler its checkpoint's base weights back (`SyncMode.restore_base`)."""
    error: str | None = None
    error_detail: ErrorDetail | None = None  # where the phase that stopped the run raised
    calibration: Calibration | None = None
    """The std search of `perturbation.std: auto`, once it ran."""
    target_calibrations: dict[str, Calibration] = field(default_factory=dict)
    """Each target kind's own std search (per-target coverage, std auto)."""
    first_adapter_id: int = 1
    """Adapter ids of this run start here, so that runs sharing a sampler never reuse an id."""
    reference: Callable[..., Scores] | None = None
    """Scores the base model in fp32 (`--reference fp32`): what both sides approximate at zero-init (sequences[,
    the routes it replays])."""
    reference_points: fp32_points.PointScorer | None = None
    """Scores the fp32 model with given LoRA tensors (`reference_points`): the updated and per-target points."""
    reference_states: dict[str, dict[str, RawTensor]] = field(default_factory=dict)
    """The trainer's tensors kept for `reference_points`, by the score key they go to."""
    exact_points: fp32_points.PointScorer | None = None
    """The exact reference (`MirroredSampler.exact_scorer`): the start, updated and per-target points."""
    exact_states: dict[str, dict[str, RawTensor]] = field(default_factory=dict)
    """The trainer's tensors kept for `exact_points`, by the score key they go to."""
    sampled: bool = False
    """`--probes sampled`: each sequence's prompt, then what the zero-init adapter samples (`generation`)."""
    start_adapter: bool = False
    """`--adapter`: both sides start from the user's adapter; the sampler's base scores go to `adapter_base`."""
    prompts: list[list[int]] = field(default_factory=list)  # the prompts the sampler generated from (sampled)
    generated: list[list[int]] = field(default_factory=list)
    """What the sampler generated from `prompts` with the synced adapter (`sampled` runs)."""
    published: dict[Path, generation.FolderState] = field(default_factory=dict)
    """What each adapter folder the sampler was handed held (`generation.remember`), checked before it scores."""
    warm_start: bool = False
    """`--update step` from zero-init: the seeded warm adapter (`update_step`) is the start point (version 0)."""
    replay: Replay = field(default_factory=Replay)
    """Route replay on an MoE model (`route_replay`): the engine's routes of each pass, replayed by the trainer."""
    mode: SyncMode = field(init=False)
    """How weights reach the sampler: the `sync_mode` strategy, as the injected fault (if any) changes it."""

    def __post_init__(self) -> None:
        self.mode = self.faults.wrap_sync(sync_mode_named(self.sync_mode))

    @property
    def base_key(self) -> str:
        """Where the sampler's base-model scores go: `base`, or `adapter_base` with `--adapter`."""
        return "adapter_base" if self.start_adapter else "base"

    @property
    def sampler_scores_base(self) -> bool:
        """False for a sampler that cannot serve the base model (its traits say why)."""
        return self.sampler.traits.base_unavailable is None

    @property
    def sampler_shares_trainer_state(self) -> bool:
        """A sampler on the trainer's service (Tinker): an old handle may serve or overwrite the trainer's weights."""
        return self.sampler.traits.shares_trainer_state

    @property
    def mixes_batches(self) -> bool:  # the sampler mixes routes in one batch after the sync
        return mixed_batch.applies(self)

    bucket_bytes = property(lambda self: self.cfg.sampler.loop.bucket_bytes)  # the user's sync in buckets, or None

    @property
    def sampler_reads_prefix_cache(self) -> bool:  # a `CachedScoringSampler` whose traits say so as built
        return isinstance(self.sampler, CachedScoringSampler) and self.sampler.traits.reads_prefix_cache

    @property
    def covered_targets(self) -> list[str]:
        """The target kinds per-target coverage runs for, in the config's order (none where it is off)."""
        if not (self.per_target and self.trainer_has_per_target):
            return []
        return [k for k in self.cfg.adapter.kinds if self.per_target_only is None or k in self.per_target_only]

    @property
    def checks_fresh(self) -> bool:
        """The exact sync check (X) applies: the trainer's tensors can be read, the sync publishes a LoRA adapter."""
        return isinstance(self.trainer, TensorReadingTrainer) and self.mode.sampler_lora

    def fresh(self) -> None:  # the trainer's current tensors loaded fresh and scored
        engine_state.fresh(self, FRESH_ID_OFFSET)

    @property
    def trainer_has_per_target(self) -> bool:
        """False for a trainer that updates every target together (its traits say why)."""
        return self.trainer.traits.per_target_unavailable is None

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
            message = tracebacks.one_line(e)
            self.error = f"phase {name}: {message}"
            self.error_detail = detail = tracebacks.describe(e, name)
            self.phases.append(PhaseRecord(name=name, status=PhaseStatus.ERROR, seconds=seconds, message=message,
                                           error_type=detail.type, frames=detail.frames))
            self.progress(name, "error", seconds)
            raise StopRun(self.error) from e
        except KeyboardInterrupt:  # SIGINT or SIGTERM (lora_parity.util.interrupt): the runner records why
            self.phases.append(PhaseRecord(name=name, status=PhaseStatus.ERROR, seconds=time.perf_counter() - start,
                                           message="interrupted"))
            raise
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

    def _timed(self, key: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = fn()
        self.timings[f"score.{key}"] = time.perf_counter() - start
        return out

    def reference_score(self) -> None:
        """The fp32 reference scores (informational: comparisons R.*, no checks)."""
        assert self.reference is not None
        reference, key = self.reference, "reference_fp32"
        routes = self.replay.table(key, self.sequences, trainer=False) if self.replay.on else None
        self._record(key, self._timed(key, lambda: reference(self.sequences, routes)))

    def sampler_score(self, key: str, handle: AdapterHandle | None, repeat: bool = False) -> None:
        """Sampler scores under `handle` (None: base model), twice with `repeat`."""
        if handle is not None:
            self.faults.before_scoring(handle.path)
            generation.check_unchanged(handle.path, self.published)
        for k in (key, f"{key}_repeat") if repeat else (key,):
            raw = self._timed(k, functools.partial(self.replay.score, self.sampler, k, self.sequences, handle))
            self._record(k, self.faults.sampler_scores(raw))

    def cached_score(self, key: str, handle: AdapterHandle | None) -> None:
        """Sampler scores under `handle`, read through the prefix cache (`score_cached`)."""
        sampler = self.sampler
        assert isinstance(sampler, CachedScoringSampler)
        raw = self._timed(key, lambda: sampler.score_cached(self.sequences, handle))
        self._record(key, self.faults.sampler_scores(raw))

    def trainer_score(self, key: str, repeat: bool = False) -> None:
        """Trainer scores of its current state, twice with `repeat`."""
        for k in (key, f"{key}_repeat") if repeat else (key,):
            with self.replay.replaying(self.trainer, k, self.sequences):
                self._record(k, self._timed(k, lambda: self.trainer.score(self.sequences)))

    def trainer_zero(self) -> None:
        """The trainer at the start point, twice; its tensors kept for the exact reference."""
        self.trainer_score("trainer_zero", repeat=True)
        if self.replay.on:  # its own routes too: how much of A the replay removes (verdict.routes.replay_share)
            self._record(OWN_ROUTES, self._timed(OWN_ROUTES, lambda: self.trainer.score(self.sequences)))
        reference_points.snapshot(self, "zero")

    def trainer_score_alone(self) -> None:
        """The trainer's updated state scored a second way, one sequence per call (another packing and batch
        composition): what batching alone moves at the point C is judged (`trainer_updated_alt`)."""
        with self.replay.replaying(self.trainer, "trainer_updated_alt", self.sequences):
            self._record("trainer_updated_alt", self._timed("trainer_updated_alt", lambda: [
                self.trainer.score([seq])[0] for seq in self.sequences]))

    def exported(self, version: int, folder: Path) -> None:
        """Adapter-file faults rewrite each exported folder before the sampler loads it."""
        self.faults.after_export(version, folder)
        generation.remember(self.published, folder)

    def publish_zero(self) -> None:
        """Publish the zero-init adapter (version 0)."""
        self.mode.publish(self, version=0)

    @property
    def steps(self) -> bool:
        """`--update step` on a trainer that takes one (`SteppingTrainer`): the update is an optimizer step."""
        return self.cfg.perturbation.update == "step" and isinstance(self.trainer, SteppingTrainer)

    @property
    def calibrates(self) -> bool:
        """Whether the update's size is searched on the trainer (`perturbation.std: auto`, or `--update step`'s lr)."""
        return self.steps or self.cfg.perturbation.std == "auto"

    def _std(self, calibration: Calibration | None) -> float:
        std = self.cfg.perturbation.std
        return calibration.std if calibration is not None else 0.0 if std == "auto" else std

    def _learning_rate(self, calibration: Calibration | None) -> float:
        return calibration.std if calibration is not None else self.cfg.perturbation.learning_rate

    def warm(self) -> None:
        """Move the trainer to the seeded warm adapter (`update_step.warm_start`): the start point."""
        update_step.warm_start(self.trainer, self.workdir / WARM_FOLDER, self.cfg.perturbation.warm_std, self.seed)

    def calibrate(self) -> None:
        """std auto: the smallest std whose trainer change stands out of A's noise (`--update step`: the lr)."""
        with self.replay.replaying(self.trainer, "calibrate", self.sequences):
            self.calibration = calibrate_trainer.on_trainer(self.trainer, self.sequences, self.scores, self.seed,
                                                            self.cfg, steps=self.steps)

    def sample(self) -> None:
        """Replace each probe sequence by its prompt + a completion sampled with the zero-init adapter
        (same lengths); record the sampler's own logprobs of them (`sampled_generation`)."""
        self.prompts = generation.prompts(self.sequences)
        sequences, logprobs = self._timed("sampled_generation", lambda: generation.generate(
            self.sampler, self.prompts, [len(s) for s in self.sequences], self.seed, self.handle))
        self.sequences = sequences
        self._record(generation.sampled_name(self), logprobs)

    def generate_updated(self) -> None:
        """The generation path after sync (`generation.after_sync`)."""
        generation.after_sync(self)

    def perturb(self) -> None:
        """The deterministic trainer-only update of the LoRA B tensors (not published)."""
        std = self._std(self.calibration)
        trainer = self.trainer
        if isinstance(trainer, SteppingTrainer) and self.steps:
            lr = self._learning_rate(self.calibration)
            with self.replay.replaying(trainer, "perturb", self.sequences):
                update = self.faults.perturb(lambda: trainer.step(self.sequences, lr, self.seed))
            if update is not None and self.warm_start:
                update = update.model_copy(update={"warm_std": self.cfg.perturbation.warm_std})
        else:
            update = self.faults.perturb(lambda: trainer.perturb(std, self.seed))
        if update is not None and update.kind == "lora_b_noise" and update.recipe is None:  # else the trainer's own
            update = update.model_copy(update={"recipe": RECIPE})
        if update is not None and self.calibration is not None:
            update = update.model_copy(update={"calibration": self.calibration})
        self.perturbation = update
        reference_points.snapshot(self, "updated")
        if self.replay.on and self.calibration is not None:  # as the search saw it: what verify re-derives it from
            self.trainer_score(SEARCH_KEY)

    def stale(self) -> None:
        """Sampler scores of the published zero-init adapter while the trainer has moved on."""
        self.mode.before_stale(self)
        self.stale_handle = self.handle
        self.sampler_score("stale", self.handle)

    def sync(self) -> None:
        """Publish the update as the sync mode does, then the user's loop (`after_loop_sync`); what it published (a
        folder it may have rewritten in place) is the new baseline of the changed-on-disk check."""
        self.mode.sync(self)
        after_loop_sync(self)
        if self.handle is not None and self.handle.path.is_dir():
            generation.remember(self.published, self.handle.path)

    def retire(self) -> None:
        """Leave the sampler as the run found it (`engine_state.retire`)."""
        engine_state.retire(self)

    def target_coverage(self, kind: str, tag: str | None = None) -> None:
        """From zero-init, perturb target kind `kind` alone, sync, and score both sides (under `tag`, default `kind`:
        per-layer coverage runs it with the trainer restricted to some layers). With std auto the search's last forward
        was taken at the chosen std on exactly this state, so it is the trainer's score (not run again), except with
        route replay: the trainer is scored after the engine, with that pass's routes (the search replays the zero
        pass's, the start point's)."""
        tag = tag or kind
        key = f"target.{tag}"
        searches = self.calibrates or self.steps
        with self.replay.replaying(self.trainer, f"{key}.calibrate", self.sequences) if searches else nullcontext():
            found = calibrate_trainer.search_target(self, kind, tag) if self.calibrates else None
            if found is None:
                self.trainer.zero_b()
                if isinstance(self.trainer, SteppingTrainer) and self.steps:
                    lr = self._learning_rate(self.target_calibrations.get(tag))
                    self.trainer.step(self.sequences, lr, self.seed, only=kind)
                else:
                    self.trainer.perturb(self._std(self.target_calibrations.get(tag)), self.seed, only=kind)
        if not self.replay.on:
            self._record(f"{key}.trainer", found) if found is not None else self.trainer_score(f"{key}.trainer")
        elif found is not None:  # the search's last forward, with the zero pass's routes (verify re-derives it)
            self._record(self.replay.searched(key), found)
        reference_points.snapshot(self, key)
        self.mode.publish(self, version=len(self.adapters), label=f"-{tag.replace('@', '-layers-')}")
        self.sampler_score(f"{key}.sampler", self.handle)
        if self.replay.on:
            self.trainer_score(f"{key}.trainer")
