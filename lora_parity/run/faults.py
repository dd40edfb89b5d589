"""Fault injection: one fault at the seam where it happens in practice.

Adapter-file faults rewrite the exported PEFT folder before the sampler loads it (an exported update's
tensors: `lora_parity.run.update_faults`); sync faults wrap the run's sync mode (`lora_parity.run.sync`)
in a `SyncWrapper` (`lora_parity.run.sync_faults`) that changes what the sync does; route faults change the
expert routes the trainer replays (`lora_parity.run.moe_faults`); scoring-path faults
change what the sampler returns (the only faults that touch scores, because there the fault *is* in the
scores). Each fault names the check that must catch it; `lora-parity selftest` runs them all and asserts
exactly that.

A fault may not apply to a sampler, as its traits say (`not_applicable`): the serving-layer faults
need a sampler served over HTTP, a sampler that refuses a same-name reload with an error never
silently keeps the old adapter, so the faults that only do that reload do not apply to it, and one
that gives every load a prefix-cache namespace of its own (SGLang) never serves a reloaded adapter
from the old one's blocks.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from lora_parity.backends.base import UNSERVABLE, AdapterHandle, BackendTraits, Routes, Scores, Sequences
from lora_parity.evidence.receipt import Budgets, Perturbation
from lora_parity.models import adapter_files as af
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import is_lora_b, target_kind
from lora_parity.run import generation, loop, sleep_faults
from lora_parity.run.fault_spec import ADAPTER_MODES as ADAPTER_MODES
from lora_parity.run.fault_spec import FaultSpec as FaultSpec
from lora_parity.run.moe_faults import EXPERT_DROPPED, EXPERT_FAULTS, ROUTE_FAULTS, corrupt_routes, drop_expert
from lora_parity.run.serving_faults import SameNameNoInplace, StaleFolder, UnloadBeforeScore, WarmPrefixCache
from lora_parity.run.sync import SyncMode
from lora_parity.run.sync_faults import (
    KeepMerged,
    Leak,
    ReuseAdapterId,
    SkipSync,
    StalePath,
    StaleTensors,
    no_reload_flag,
)
from lora_parity.run.update_faults import FP16_MAX as FP16_MAX
from lora_parity.run.update_faults import UPDATE_FILE_FAULTS as UPDATE_FILE_FAULTS
from lora_parity.run.update_faults import rewrite_update
from lora_parity.util.errors import ConfigError, PhaseError

BASE_SHIFT = 0.05
"""base-changed: half the largest shift of a score after the sync (nats)."""

EXACT = "X.sync.identical"
"""The exact sync check: where the sampler repeats itself bit for bit it fails on any published adapter that is
not the trainer's, however small the difference (docs/verdicts.md, "The exact sync check (X)")."""

NONZERO_SYNC_NET = f"C.parity.mean|{EXACT}"
"""What catches a sync that delivers part of the update, from a non-zero start (`--update step`, `--adapter`):
C's mean, or the exact check where the sampler repeats bit for bit (X). The missing part is a share of the
change, and in bf16 that share can stay within C's noise-derived mean threshold: on SmolLM2-135M bf16 (H200,
hf trainer, --update step) stale-a in 1 of 2 seeds, drop-target in 2 of 2, up-gets-gate in 1 of 1, with X
failing in every one of them (docs/verdicts.md)."""

FAULTS: dict[str, FaultSpec] = {f.name: f for f in (
    FaultSpec("skip-sync", "the sync step does nothing", ("C.parity.mean",), "fail", sync=SkipSync),
    FaultSpec("reuse-adapter-id", "republish under the old name and id without an in-place reload",
              ("C.parity.mean",), "fail", modes=("new-id",), sync=ReuseAdapterId, reloads_same_name=True),
    FaultSpec("no-reload-flag", "sync in place under the same name and id, without load_inplace",
              ("C.parity.mean",), "fail", modes=("inplace",), sync=no_reload_flag, reloads_same_name=True),
    FaultSpec("stale-path", "the merged weights are written, but the sampler reloads the previous folder",
              ("C.parity.mean",), "fail", modes=("merged",), sync=StalePath),
    FaultSpec("stale-tensors", "the sampler is handed weights copied before the update",
              ("C.parity.mean",), "fail", modes=("memory",), sync=StaleTensors),
    # Only per-target coverage names a dropped target: where its share of the change is small next to
    # the noise, C moves by less than its threshold (docs/verdicts.md, "Detection power"). With a warm
    # start (--update step) the dropped target loses its warm part too: the sampler moves, the wrong way,
    # by a share of the change C's mean can miss (SmolLM2-135M bf16, H200: within it in 2 of 2 seeds) while
    # the exact check (X, where the sampler repeats bit for bit) and the dropped target's scale name it.
    FaultSpec("drop-target", "the exported adapter lacks the first target module's tensors",
              ("T.{target}.moved",), "fail", modes=ADAPTER_MODES, rewrites_files=True,
              caught_by_step=(NONZERO_SYNC_NET, "T.{target}.scale|T.{target}.cosine")),
    FaultSpec("wrong-scale", "the exported adapter's lora_alpha is doubled", ("C.delta.scale",), "fail",
              modes=ADAPTER_MODES, rewrites_files=True),
    FaultSpec("wrong-direction", "the exported B tensors are negated", ("C.delta.cosine",), "fail",
              modes=ADAPTER_MODES, rewrites_files=True),
    FaultSpec("one-token", "one sampler logprob is off (9 nats, or less so the mean stays within budget)",
              ("A.parity.max",), "fail", must_pass=("A.parity.mean",)),
    FaultSpec("frozen-trainer", "the perturbation is not applied", ("B.stimulus",), "inconclusive",
              skips_update=True),
    FaultSpec("leak", "the sampler gets the update before the stale phase", ("B.withheld",), "fail", sync=Leak),
    FaultSpec("nonzero-init", "the published zero-init adapter has non-zero B (with a warm start: other B than the "
              "trainer's)", ("A.zero_adapter_noop",), "fail", modes=ADAPTER_MODES, rewrites_files=True,
              caught_by_step=("A.parity.mean|A.fp32.balance|A.fp32.sampler.mean|A.fp32.sampler.p99|A.fp32.sampler.max",)),
    # A.parity.max: under the bf16 profile a shifted sampler is also far from the fp32 reference, so
    # A's triangulated mean budget widens with it (A.fp32.sampler.* fail instead); the max ceiling
    # is absolute in every profile (seen on the H200 selftest of SmolLM2-135M bf16).
    FaultSpec("misalign", "sampler scores shifted by one position", ("A.parity.max",), "fail"),
    FaultSpec("nan", "the sampler returns NaN at one position", (), "error", error_says="non-finite"),
    # The faults only an update of A and B can reveal (`--update step`, docs/faults.md): under the noise
    # update A never changes, so stale-a publishes the very same files.
    FaultSpec("stale-a", "the published adapter carries the new B with the previous version's A",
              ("C.parity.mean",), "fail", modes=ADAPTER_MODES, rewrites_files=True, caught_by_step=(NONZERO_SYNC_NET,),
              needs_step="the noise update never moves A, so the previous version's A is the new one"),
    # The sampler moves the way of the refreshed half only: by its distance or its direction. Either can stay
    # within its threshold alone: on SmolLM2-135M bf16 (H200) C.parity.mean did in 5 of 45 runs (the cosine
    # in none), on the fake's warm start the cosine did. Both did at once on the Qwen3-0.6B shape (H200, hf,
    # noise update) in 2 of 10 seeds (C.delta.cosine at 0.86 and 0.92 of its threshold), where the exact check
    # failed in all 10: the sampler's scores were not the trainer's adapter's.
    FaultSpec("partial-export", "half the layers (the later ones) keep the previous version's tensors",
              (f"C.parity.mean|C.delta.cosine|{EXACT}",), "fail", modes=ADAPTER_MODES, rewrites_files=True,
              caught_by_step=(f"{NONZERO_SYNC_NET}|C.delta.cosine",)),
    # A rounding of the adapter: C sees it where the rounding outweighs the two sides' own difference (the
    # embedded default, fp32: 3-4x its threshold), not on SmolLM2-135M fp32 (CPU, --update step: C.parity.mean at
    # 0.51 of its threshold at most over 5 seeds); the exact check failed in all 5 (docs/verdicts.md).
    FaultSpec("fp16-export", "every exported tensor is cast to fp16 (beyond 65504: inf; below 6e-8: zero; "
              "rounded to fp16's 11-bit mantissa in between)", (f"C.parity.mean|{EXACT}",), "fail",
              modes=ADAPTER_MODES, rewrites_files=True, only_rounds=True),
    # As partial-export: the sampler's up_proj moves another way, by distance or direction; on SmolLM2-135M
    # bf16 (H200) C.parity.mean stayed within its threshold in 2 of 43 runs, never with the cosine too.
    FaultSpec("up-gets-gate", "the synced adapter's up_proj tensors are gate_proj's (unsloth-zoo #941: the "
              "hot-load appends gate_proj twice, shapes match, nothing errors)", ("C.parity.mean|C.delta.cosine",),
              "fail", modes=ADAPTER_MODES, rewrites_files=True, needs_targets=("gate_proj", "up_proj"),
              caught_by_step=(f"{NONZERO_SYNC_NET}|C.delta.cosine",)),
    FaultSpec("same-name-no-inplace", "sync reloads under the same name without load_inplace and does not read "
              "the server's reply", ("C.parity.mean",), "fail", modes=ADAPTER_MODES, sync=SameNameNoInplace,
              serving_layer=True),
    FaultSpec("warm-prefix-cache", "sync overwrites the published adapter folder and reloads it in place under the "
              "same name and path, with prefix-cache blocks of the old adapter warm", ("P.parity.mean",), "fail",
              must_pass=("C.parity.mean",), modes=ADAPTER_MODES, sync=WarmPrefixCache, reads_reloaded_cache=True),
    FaultSpec("stale-folder", "sync loads the folder published before the update under the update's name (in place "
              "under the same name with --sync inplace); SGLang serves a path already loaded under another name with "
              "only a logged warning (sgl-project/sglang#13771)", ("C.parity.mean",), "fail", modes=ADAPTER_MODES,
              sync=StaleFolder, serving_layer=True),
    FaultSpec("unload-before-score", "sync unloads the adapter about to be scored instead of the old one",
              (), "error", modes=ADAPTER_MODES, sync=UnloadBeforeScore, serving_layer=True, counts_on_unload=True,
              error_says=r"^phase updated: .* answered 4\d\d"),
    FaultSpec("base-changed", "the sync also changes the engine's base model (every sampler score from the sync on "
              "is lower by 0-0.1 nats, as a base weight scaled on the engine's side moves them)",
              ("D.base_kept",), "fail", modes=ADAPTER_MODES, needs_base=True),
    FaultSpec("old-name-follows", "after the sync, the replaced version's name serves the new adapter (a frozen "
              "snapshot that follows the live weights)", ("D.old_kept",), "fail", modes=("new-id", "tensors"),
              needs_versions=True),
    FaultSpec("mixed-one-route", "in a batch that mixes the base model and adapter versions, every request gets the "
              "first request's route (LoRA slots mapped to the wrong requests: vllm #16040, #36370)", ("M.updated",),
              "fail", must_pass=("C.parity.mean",), modes=ADAPTER_MODES, needs_mixed=True, needs_base=True),
    FaultSpec("base-not-restored", "the merged modes' restore at the end of the run leaves the merged weights in "
              "place (a reset that scrambled the base: miles #2520)", ("D.base_restored",), "fail",
              modes=("merged", "memory"), sync=KeepMerged, needs_base=True),
    # The trainer's tensors reach X as an empty set: no fresh adapter is loaded, X compares nothing and is not run
    # (0 elements), so the run can at best be inconclusive; it must never pass on a comparison over nothing.
    FaultSpec("empty-handoff", "the trainer's tensors reach the exact sync check as an empty set (a checksum a "
              "transport dropped reads as verified while verifying nothing: miles #2730, sglang #36190)", (EXACT,),
              "inconclusive", modes=ADAPTER_MODES, hands_x=True),
    FaultSpec("crash-at", "an exception in the named phase (crash-at=PHASE)", (), "error",
              error_says="injected crash"),
    FaultSpec("adapter-changed", "the published adapter's files change on disk before the sampler scores with it",
              (), "error", modes=ADAPTER_MODES, error_says="changed on disk after it was published"),
    FaultSpec("gen-no-adapter", "after sync the sampler generates without the adapter (prompt scoring has it)",
              ("G.updated.parity.mean", "G.trainer.parity.mean"), "fail", modes=ADAPTER_MODES, needs_sampled=True),
    FaultSpec("prompt-no-adapter", "after sync the sampler scores the generated tokens without the adapter "
              "(generation has it)", ("G.updated.parity.mean",), "fail", must_pass=("G.trainer.parity.mean",),
              modes=ADAPTER_MODES, needs_sampled=True),
    # CUDA graphs captured before the update replaying its old weight addresses: the decode path computes with the
    # replaced version, prompt scoring with the new one.
    FaultSpec("graphs-hold-old", "after sync the sampler generates with the replaced version's weights while prompt "
              "scoring has the new ones (CUDA graphs replaying old weight addresses: vllm #48941; sglang #27140, "
              "garbled step-1 rollouts, no error)", ("G.updated.parity.mean", "G.trainer.parity.mean"), "fail",
              modes=("new-id", "tensors"), needs_versions=True, needs_sampled=True),
    *ROUTE_FAULTS, *EXPERT_FAULTS,
    *sleep_faults.SLEEP_FAULTS, *generation.TEMPERED_FAULTS, *loop.LOOP_FAULTS,
)}
SELFTEST_FAULTS = [name if name != "crash-at" else "crash-at=stale" for name, spec in FAULTS.items()
                   if not spec.needs_sampled]
SAMPLED_FAULTS = [name for name, spec in FAULTS.items() if spec.needs_sampled]
"""Faults of the generation path: the selftest runs them only with `--probes sampled`."""
FILE_FAULTS = tuple(name for name, spec in FAULTS.items() if spec.rewrites_files)
"""Faults that rewrite the exported PEFT files (a trainer that exports none cannot take them)."""


def rewrites_files(inject: str | None) -> bool:
    """`--inject NAME[=...]` names a fault that rewrites exported PEFT files (one of `FILE_FAULTS`)."""
    return inject is not None and inject.partition("=")[0] in FILE_FAULTS


SERVING_LAYER_FAULTS = tuple(name for name, spec in FAULTS.items() if spec.serving_layer)
"""Faults of the HTTP serving layer (a sampler with `traits.served_over_http` only)."""


def not_applicable(name: str, sampler: BackendTraits) -> str | None:
    """Why fault `name` does not apply to a sampler with these traits, or None if it does."""
    spec = FAULTS[name]
    if spec.serving_layer and not sampler.served_over_http:
        return ("it is a fault of the serving layer: it needs a sampler served over HTTP (--sampler vllm-server "
                "or sglang)")
    if spec.reloads_same_name and sampler.same_name_reload_refused:
        return f"this sampler {sampler.same_name_reload_refused}"
    if spec.reads_reloaded_cache and not sampler.reads_prefix_cache:
        return ("it scores no request through a prefix cache (the phases stale_cached and updated_cached read one: "
                "vllm-server, sglang, or vllm with --engine-arg enable_prefix_caching=true)")
    if spec.reads_reloaded_cache and sampler.reload_gets_fresh_cache:
        return f"this sampler {sampler.reload_gets_fresh_cache}"
    if spec.counts_on_unload and sampler.unload_reloads:
        return f"this sampler {sampler.unload_reloads}"
    if spec.needs_base and sampler.base_unavailable:
        return f"it changes the base model, which this sampler cannot serve ({sampler.base_unavailable})"
    if spec.needs_mixed and sampler.mixed_batch_unavailable:
        return f"it breaks mixed batches, which this sampler does not score ({sampler.mixed_batch_unavailable})"
    if spec.needs_sleep and sampler.sleep_unavailable:
        return f"it breaks sleep and wake, which this sampler does not do ({sampler.sleep_unavailable})"
    if spec.needs_versions and sampler.shares_trainer_state:
        return "this sampler's versions are handles on the trainer's own service (checked by S.trainer_kept)"
    return None


def not_applicable_to_trainer(name: str, reads_tensors: bool) -> str | None:
    """Why fault `name` does not apply to a trainer (`reads_tensors`: a `TensorReadingTrainer`), or None if it does."""
    if FAULTS[name].hands_x and not reads_tensors:
        return "its LoRA tensors cannot be read, so the exact sync check (X) it hands them to does not run"
    return None


def require_applies(spec: str | None, sampler: BackendTraits, sampler_name: str, reads_tensors: bool = True,
                    trainer_name: str = "") -> None:
    """Preflight: `ConfigError` if the injected fault does not apply to this sampler, or to the trainer."""
    name = (spec or "").partition("=")[0]
    why = not_applicable(name, sampler) if name in FAULTS else None
    if why is not None:
        raise ConfigError(f"fault {spec!r} does not apply to sampler {sampler_name!r}: {why}")
    why = not_applicable_to_trainer(name, reads_tensors) if name in FAULTS else None
    if why is not None:
        raise ConfigError(f"fault {spec!r} does not apply to trainer {trainer_name!r}: {why}")


ROUNDING_DTYPES = ("float32",)
"""Model dtypes whose numerics resolve an adapter rounded to fp16 (`only_rounds`). In bf16 or fp16 the
model rounds each layer's output to 8 or 11 bits, so an adapter rounded to 11 bits moves the scores by
less than the two sides already differ: on SmolLM2-135M bf16 (H200, hf and megatron trainers), fp16-export's
C.parity.mean stayed at 0.30-0.80 of its threshold in all 45 runs; it is no fault the verdict can see there."""


def faults_for(sync_mode: str, sampler: BackendTraits | None = None, sampled: bool = False,
               targets: list[str] | None = None, update: str = "noise", trainer: BackendTraits | None = None,
               dtype: str | None = None, reads_tensors: bool = True, replays: bool = False,
               sleeps: Sequence[int] = ()) -> list[str]:
    """The selftest's faults that apply to `sync_mode` and to a sampler with these traits (default:
    one that is not served over HTTP); with `sampled`, also the generation path's; with `targets`, only
    those whose target kinds the adapter has; with `update` noise, not those only a step can reveal; with
    `trainer` traits, not the rounding faults it cannot resolve; with a `dtype` other than float32, not
    the rounding faults either (`ROUNDING_DTYPES`); without `reads_tensors`, not those of X's hand-off; without
    `replays` (the run replays expert routes), not the route faults; only those of the sleep levels in `sleeps`."""
    traits = sampler or BackendTraits()
    rounds = (trainer is None or not trainer.rounding_unresolved) and (dtype is None or dtype in ROUNDING_DTYPES)
    names = [f for f in SELFTEST_FAULTS + (SAMPLED_FAULTS if sampled else [])
             if (update == "step" or FAULTS[f.partition("=")[0]].needs_step is None)
             and (rounds or not FAULTS[f.partition("=")[0]].only_rounds)
             and not_applicable_to_trainer(f.partition("=")[0], reads_tensors) is None
             and (replays or not FAULTS[f.partition("=")[0]].needs_replay)
             and _sleeps_at(FAULTS[f.partition("=")[0]], sleeps)]
    return [f for f in names if (not FAULTS[f.partition("=")[0]].modes
            or sync_mode in FAULTS[f.partition("=")[0]].modes) and not_applicable(f.partition("=")[0], traits) is None
            and (targets is None or set(FAULTS[f.partition("=")[0]].needs_targets) <= set(targets))]


def _sleeps_at(spec: FaultSpec, sleeps: Sequence[int]) -> bool:
    """A fault that breaks no sleep, or one of whose sleep levels the run exercises (`sleeps`)."""
    return not spec.needs_sleep or bool(set(spec.needs_sleep) & set(sleeps))


def check_crash_phase(spec: str | None, phases: list[str]) -> None:
    """crash-at=PHASE names a phase of the sequence (a typo would never crash, and the run would pass)."""
    name, _, phase = (spec or "").partition("=")
    if name == "crash-at" and phase and phase not in phases:
        raise ConfigError(f"crash-at: no phase {phase!r}; phases: {', '.join(phases)}")


def one_token_ceiling(budgets: Budgets) -> float:
    """What A allows one token: the fp32-triangulated max ceiling where the budgets have one, else the max."""
    return budgets.a_triangulation.max if budgets.a_triangulation is not None else budgets.max


class Faults:
    """The injected fault of a run (or none): hooks the sequence calls at each seam."""

    def __init__(self, spec: str | None, targets: list[str], num_positions: int, mean_budget: float,
                 sync_mode: str = "new-id", sampled: bool = False, update: str = "noise",
                 start_adapter: bool = False, max_ceiling: float = 0.0) -> None:
        self.name: str | None = None
        self.nonzero_start = update == "step" or start_adapter
        """The run starts from non-zero B (the warm start of `--update step`, or the user's `--adapter`):
        the sampler holds that start at version 0, so the export faults start with the update."""
        self.previous: dict[str, af.Tensor] | None = None
        """The last exported version's tensors, as the trainer wrote them (stale-a, partial-export keep them)."""
        self.crash_phase: str | None = None
        self.changed: set[Path] = set()
        self.synced = False
        self.first_routes: Routes | None = None  # the engine's routes first handed to the trainer (expert-dropped)
        if spec:
            name, _, arg = spec.partition("=")
            if name not in FAULTS:
                raise ConfigError(f"unknown fault {spec!r}; faults: {', '.join(FAULTS)}")
            if FAULTS[name].modes and sync_mode not in FAULTS[name].modes:
                raise ConfigError(f"fault {name!r} applies to sync modes {', '.join(FAULTS[name].modes)}, "
                                  f"not {sync_mode!r}")
            if FAULTS[name].needs_sampled and not sampled:
                raise ConfigError(f"fault {name!r} breaks the generation path after sync: it needs --probes sampled")
            missing = [t for t in FAULTS[name].needs_targets if t not in targets]
            if missing:
                raise ConfigError(f"fault {name!r} needs target modules {', '.join(FAULTS[name].needs_targets)}; "
                                  f"the adapter lacks {', '.join(missing)}")
            if (name == "crash-at") != bool(arg):
                raise ConfigError("crash-at needs a phase (crash-at=PHASE); other faults take no argument")
            self.name, self.crash_phase = name, arg or None
        self.targets = list(targets)
        self.dropped_target = targets[0]
        # Off by 9 nats as in the seed's review, or less where the mean budget is tighter, so that
        # the mean stays within budget (with room for the backends' own disagreement) and only the
        # tail checks can catch it; but at least twice what A allows one token (`max_ceiling`): a token
        # off by less can sit within precision once its own noise points the other way (SmolLM2-135M
        # bf16 on the H200, --update step seed 2: 2.4 nats off, 1.94 apart against the 2.0 ceiling).
        self.one_token_offset = min(9.0, max(0.25 * mean_budget * num_positions, 2.0 * max_ceiling))

    def expected(self, sampler: BackendTraits | None = None) -> FaultSpec:
        """What must catch this fault (on a sampler with these traits)."""
        assert self.name is not None
        spec = FAULTS[self.name]
        if self.is_("drop-target") and sampler is not None and self.unservable(sampler):
            return replace(spec, caught_by=(), verdict="error", must_pass=(), error_says=re.escape(UNSERVABLE))
        caught_by = spec.caught_by_step if self.nonzero_start and spec.caught_by_step is not None else spec.caught_by
        return replace(spec, caught_by=tuple(c.format(target=self.dropped_target) for c in caught_by))

    def unservable(self, sampler: BackendTraits) -> bool:
        """drop-target leaves an adapter this sampler refuses (`traits.adapter_needs`): another target
        needs the dropped one beside it."""
        return any(needed == self.dropped_target and kind in self.targets and kind != needed
                   for kind, needed in sampler.adapter_needs)

    def is_(self, name: str) -> bool:
        """Whether `name` is the injected fault."""
        return self.name == name

    def _spec(self) -> FaultSpec | None:
        return FAULTS[self.name] if self.name is not None else None

    def wrap_sync(self, mode: SyncMode) -> SyncMode:
        """The run's sync mode, as the injected sync fault (if any) changes it: a new object per run."""
        spec = self._spec()
        return spec.sync(mode) if spec is not None and spec.sync is not None else mode

    def perturb(self, apply: Callable[[], Perturbation]) -> Perturbation | None:
        """The trainer's update (`apply`), unless the fault keeps the trainer frozen."""
        spec = self._spec()
        return None if spec is not None and spec.skips_update else apply()

    def on_phase(self, phase: str) -> None:
        """crash-at=PHASE: raise at the start of PHASE. Notes when the sync has begun (base-changed)."""
        self.synced = self.synced or phase == "sync"
        if self.crash_phase == phase:
            raise PhaseError(f"injected crash in phase {phase}")

    def after_export(self, version: int, folder: Path) -> None:
        """Adapter-file faults: rewrite the exported PEFT folder before the sampler sees it."""
        if self.name not in FILE_FAULTS or (self.nonzero_start and version == 0 and not self.is_("nonzero-init")):
            # With a warm start, version 0 is the start adapter the sampler already holds: the faults of an
            # update's export start with the update (at zero-init they left B = 0 unchanged there too).
            if self.name in FILE_FAULTS:
                self.previous = af.read_adapter(folder)[1]
            return
        config, tensors = af.read_adapter(folder)
        previous, self.previous = self.previous, tensors
        if self.name in UPDATE_FILE_FAULTS:
            tensors = rewrite_update(self.name, version, tensors, previous)
        elif self.is_("drop-target"):
            tensors = {n: t for n, t in tensors.items() if target_kind(n) != self.dropped_target}
        elif self.is_("wrong-scale"):
            config["lora_alpha"] = 2 * config["lora_alpha"]
        elif self.is_(EXPERT_DROPPED) and version > 0:
            tensors = drop_expert(tensors, int(config["r"]), self.first_routes)
        elif self.is_("wrong-direction"):
            tensors = {n: af.negate(t) if is_lora_b(n) else t for n, t in tensors.items()}
        elif self.is_("nonzero-init") and version == 0:
            rng = random.Random(0)
            tensors = {n: af.Tensor.from_floats(t.dtype, t.shape, [rng.gauss(0, 0.02) for _ in t.to_floats()])
                       if is_lora_b(n) else t for n, t in tensors.items()}
        af.write_adapter(folder, config, tensors)

    def before_scoring(self, folder: Path) -> None:
        """adapter-changed: the first published folder the sampler scores with is rewritten on disk
        (lora_alpha doubled) after it was published."""
        if self.is_("adapter-changed") and not self.changed:
            config, tensors = af.read_adapter(folder)
            config["lora_alpha"] = 2 * config["lora_alpha"]
            af.write_adapter(folder, config, tensors)
            self.changed.add(folder)

    def generation_handle(self, handle: AdapterHandle | None, old: AdapterHandle | None = None) -> AdapterHandle | None:
        """The adapter the sampler generates with after sync (gen-no-adapter: none; graphs-hold-old: the version the
        sync replaced, `old`, where the sync kept it loaded)."""
        if self.is_("gen-no-adapter"):
            return None
        return old if self.is_("graphs-hold-old") and old is not None else handle

    def old_handle(self, old: AdapterHandle, current: AdapterHandle | None) -> AdapterHandle | None:
        """The adapter the replaced version's name serves after the sync (old-name-follows: the new one)."""
        return current if self.is_("old-name-follows") else old

    def generation_prompt_handle(self, handle: AdapterHandle | None) -> AdapterHandle | None:
        """The adapter the sampler scores the generated tokens with (prompt-no-adapter: none)."""
        return None if self.is_("prompt-no-adapter") else handle

    def routes(self, sequences: Sequences, routes: Routes) -> Routes:
        """The engine's routes as they reach the trainer's routers (the route faults: `moe_faults`)."""
        self.first_routes = self.first_routes or routes
        return corrupt_routes(self.name, sequences, routes)

    def handed_tensors(self, tensors: dict[str, RawTensor]) -> dict[str, RawTensor]:
        """The trainer's tensors as they reach the exact sync check (empty-handoff: none)."""
        return {} if self.is_("empty-handoff") else tensors

    def woken_handle(self, handle: AdapterHandle | None, level: int) -> AdapterHandle | None:
        """The adapter the engine applies after a wake at `level` (`sleep_faults`)."""
        return sleep_faults.woken_handle(self.name, handle, level)

    def skips_base_reload(self, level: int) -> bool:
        """The loop skips reloading the base weights after a wake at `level` (`sleep_faults`)."""
        return sleep_faults.skips_base_reload(self.name, level)

    def after_wake(self, sampler: object) -> None:
        """What the loop does once the engine is awake, before it serves (`sleep_faults`)."""
        sleep_faults.after_wake(self.name, sampler)

    def mixed_scores(self, scores: list[Scores]) -> list[Scores]:
        """A mixed batch's scores per route (mixed-one-route: every route gets the first route's)."""
        return [scores[0] for _ in scores] if self.is_("mixed-one-route") else scores

    def sampler_scores(self, scores: Scores) -> Scores:
        """Scoring-path faults, applied to every sampler scoring (base-changed: every one from the sync on)."""
        if self.is_("base-changed") and self.synced:
            return [[x - BASE_SHIFT * (1.0 + math.sin(0.7 * t + s)) for t, x in enumerate(seq)]
                    for s, seq in enumerate(scores)]
        if self.is_("one-token"):
            return [[x - self.one_token_offset if (s, t) == (0, 3) else x for t, x in enumerate(seq)]
                    for s, seq in enumerate(scores)]
        if self.is_("misalign"):
            return [seq[1:] + seq[-1:] for seq in scores]
        if self.is_("nan"):
            return [[math.nan if (s, t) == (0, 5) else x for t, x in enumerate(seq)] for s, seq in enumerate(scores)]
        return scores
