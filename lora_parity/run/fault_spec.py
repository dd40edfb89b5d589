"""What a fault is (`FaultSpec`): its name, the checks that must catch it, and where it applies. The faults
themselves, and the hooks that inject them: `lora_parity.run.faults`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lora_parity.run.sync import SyncMode

ADAPTER_MODES = ("new-id", "inplace", "tensors")
"""The sync modes that publish a LoRA adapter (the others merge it into the base weights)."""


@dataclass(frozen=True)
class FaultSpec:
    """A fault, the check ids that must catch it, and the verdict it must give."""

    name: str
    description: str
    caught_by: tuple[str, ...]
    verdict: str
    must_pass: tuple[str, ...] = ()
    """Checks that must still pass: the fault hides from them, which is the point of the tail checks."""
    modes: tuple[str, ...] = ()
    """Sync modes the fault applies to (empty: all)."""
    sync: Callable[[SyncMode], SyncMode] | None = None
    """How the fault changes the run's sync mode (sync faults), or None."""
    rewrites_files: bool = False
    """Rewrites the exported PEFT folder (`Faults.after_export`): needs a trainer that exports one."""
    skips_update: bool = False
    """The trainer's update is not applied."""
    serving_layer: bool = False
    """A fault of the HTTP serving layer: only for a sampler served over HTTP (`traits.served_over_http`)."""
    reloads_same_name: bool = False
    """Reloads a loaded name without load_inplace and counts on the old adapter being kept silently:
    not for a sampler that refuses that reload with an error (`traits.same_name_reload_refused`)."""
    needs_sampled: bool = False
    """Breaks the generation path after sync, which runs with `--probes sampled` only."""
    caught_by_step: tuple[str, ...] | None = None
    """What must catch it when the run starts from non-zero B (the warm start of `--update step`, or the
    user's `--adapter`), where that differs (None: `caught_by`). Each entry of `caught_by` and this must
    fail; an entry `X|Y` fails when either does (with an fp32 reference, a sampler that starts elsewhere
    widens A's triangulated threshold by its own distance, and the reference check names it instead)."""
    only_rounds: bool = False
    """Changes the adapter's values by rounding alone (a trainer with `traits.rounding_unresolved` skips it)."""
    needs_step: str | None = None
    """Why the noise update cannot reveal the fault (the selftest runs it with `--update step` only), or None."""
    needs_targets: tuple[str, ...] = ()
    """Target kinds the adapter must have for the fault to exist (e.g. gate_proj and up_proj)."""
    counts_on_unload: bool = False
    """Counts on a request that names an unloaded adapter failing: not for a sampler that loads it again
    from its path (`traits.unload_reloads`)."""
    error_says: str = ""
    """For a fault that must end the run in an error: a regular expression the receipt's error must match,
    so that the fault's own error catches it, not any (a server that died refuses every call)."""
    reads_reloaded_cache: bool = False
    """Counts on a reload under the same name and path reading the old adapter's prefix-cache blocks:
    not for a sampler whose every load gets a cache namespace of its own (`traits.reload_gets_fresh_cache`)."""
    needs_base: bool = False
    """Needs the engine's base route scored after the sync: not for a sampler that cannot serve the base model
    (`traits.base_unavailable`)."""
    hands_x: bool = False
    """Changes what the exact sync check (X) is handed: only where X runs, a trainer whose LoRA tensors can be read
    (`TensorReadingTrainer`) and a sync that publishes an adapter (its `modes`); the selftest leaves it out elsewhere
    (`faults.not_applicable_to_trainer` says why)."""
    needs_versions: bool = False
    """Needs the replaced version scored after the sync: not for a sampler on the trainer's own service
    (`traits.shares_trainer_state`), which has phases of its own."""
    needs_replay: bool = False
    """Changes the expert routes the trainer replays: only where the run replays routes (an MoE model with
    `--route-replay` on or auto, and backends that can: `lora_parity.run.route_replay`)."""
    needs_mixed: bool = False
    """Changes what a batch mixing the base model and adapter versions serves: only for a sampler that mixes them
    (`traits.mixed_batch_unavailable` None) in a sync mode that serves adapters (`run.mixed_batch`)."""
    needs_sleep: tuple[int, ...] = ()
    """Breaks sleep and wake: only where the run exercises one of these sleep levels (`run.sleep_wake`,
    `--sleep-levels`) on a sampler that sleeps (`traits.sleep_unavailable` None)."""
