"""How the trainer's weights reach the sampler (`--sync`): one strategy object per mode.

Each mode says what it requires of the two backends (checked at preflight, before anything is
loaded), how it publishes a version, what it does at the sync step, and how it retires what it
left on the sampler. `MODES` are the `--sync` modes; `CallerSync` is the caller's own sync (the
Python API). Faults that break a sync (`lora_parity.run.faults`) wrap a mode in a `SyncWrapper`;
the sequence (`lora_parity.run.phases`) only calls the mode it was given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_parity.backends.base import (
    AdapterHandle,
    BaseReloadingSampler,
    MergingTrainer,
    Sampler,
    TensorAdapterSampler,
    Trainer,
    WeightVersionSampler,
)
from lora_parity.evidence.receipt import AdapterVersion
from lora_parity.models import buckets
from lora_parity.util.errors import ConfigError


class SyncContext(Protocol):
    """What a sync mode works on: the run's backends, its folder, and what was published so far."""

    trainer: Trainer
    sampler: Sampler
    workdir: Path
    first_adapter_id: int
    handle: AdapterHandle | None
    kept: AdapterHandle | None
    adapters: list[AdapterVersion]
    timings: dict[str, float]
    base_restored: bool

    @property
    def bucket_bytes(self) -> int | None:
        """The user's sync in buckets of this many bytes (`--loop bucket_mb`: the merged weights in memory); None: the
        weights at once."""
        ...

    def exported(self, version: int, folder: Path) -> None:
        """Called with every adapter folder the trainer exported, before the sampler loads it."""
        ...


class SyncMode:
    """A way weights reach the sampler. Subclasses define `publish`."""

    name: str = ""
    sampler_lora: bool = True
    """Whether the sampler runs with LoRA enabled."""
    keeps_versions: bool = False
    """Each version gets a name and id of its own: the previous one stays loaded through the sync, so that it can
    be scored after the newer one is live (`old_after_sync`), and is retired then."""
    reloads_base: bool = False
    """The sync reloads the sampler's base weights (the merged modes): `restore_base` gives it its checkpoint's back,
    before the run's last phase scores the base route (`base_after_restore`), and `retire` where that phase did not."""

    def require(self, trainer_cls: type, sampler_cls: type, trainer: str, sampler: str) -> None:
        """Preflight: raise `ConfigError` if these backend classes cannot sync this way."""

    def publish(self, ctx: SyncContext, version: int, label: str = "") -> None:
        """Put the trainer's current weights on the sampler as `version`."""
        raise NotImplementedError

    def sync(self, ctx: SyncContext) -> None:
        """The sync step: publish the updated weights (version 1)."""
        self.publish(ctx, version=1)

    def before_stale(self, ctx: SyncContext) -> None:
        """Called after the update, before the stale phase: a correct sync does nothing here."""

    def overwrite(self, ctx: SyncContext) -> None:
        """Put the trainer's current weights behind what the sampler serves now, without a new
        version (what a leak does)."""
        raise NotImplementedError

    def restore_base(self, ctx: SyncContext) -> None:
        """Give the sampler its checkpoint's base weights back (`reloads_base`); a mode that leaves them alone has
        nothing to restore."""

    def restore(self, ctx: SyncContext) -> None:
        """Put the current version back, as it was published and with no new version, on an engine whose weights a
        level-2 sleep discarded (its base already reloaded from the checkpoint): an RL loop's restore after the wake
        (`run.sleep_wake`)."""
        raise NotImplementedError

    def retire(self, ctx: SyncContext) -> None:
        """Unload the adapter this run left on the sampler."""
        if ctx.handle is not None:
            ctx.sampler.retire(ctx.handle)
            ctx.handle = None


def _record(ctx: SyncContext, version: int, name: str, adapter_id: int, mode: str, start: float,
            sent: tuple[list[int], list[str]] | None = None) -> None:
    seconds = time.perf_counter() - start
    weights = ctx.sampler.weight_version() if isinstance(ctx.sampler, WeightVersionSampler) else None
    ctx.adapters.append(AdapterVersion(version=version, name=name, adapter_id=adapter_id, mode=mode, seconds=seconds,
                                       weight_version=weights, buckets=sent[0] if sent else None,
                                       split_modules=sent[1] if sent else None))
    ctx.timings[f"publish.v{version}"] = seconds


@dataclass(frozen=True)
class AdapterSync(SyncMode):
    """Export a PEFT folder and load it on the sampler: under a new name and id per version
    (`new-id`; the old one is retired), the same ones reloaded in place (`inplace`), or a new name
    per version with the folder's tensors sent in memory rather than read by the sampler (`tensors`)."""

    name: str = "new-id"
    same_id: bool = False
    """Republish under the name and id of the version the sampler has."""
    load_inplace: bool = False
    """Ask the sampler to replace what it has under that id."""
    from_tensors: bool = False
    """Send the folder's tensors to the sampler (`TensorAdapterSampler`) instead of its path."""

    def require(self, trainer_cls: type, sampler_cls: type, trainer: str, sampler: str) -> None:
        """`tensors`: a sampler that loads adapters from tensors."""
        if self.from_tensors and not issubclass(sampler_cls, TensorAdapterSampler):
            raise ConfigError(f"--sync {self.name} needs a sampler that loads adapters from tensors in memory "
                              f"(sglang); {sampler!r} cannot")

    def load(self, ctx: SyncContext, folder: Path, name: str, adapter_id: int, inplace: bool) -> AdapterHandle:
        """Put the adapter folder on the sampler under `name` the way this mode does (path or tensors)."""
        if self.from_tensors:
            return tensor_loading(ctx.sampler).publish_tensors(folder, name, adapter_id, inplace=inplace)
        return ctx.sampler.publish(folder, name, adapter_id, inplace=inplace)

    def publish(self, ctx: SyncContext, version: int, label: str = "") -> None:
        """Export to `adapter-v{version}{label}` and load it; retire the previous id if it changed."""
        start = time.perf_counter()
        folder = ctx.trainer.export_adapter(ctx.workdir / f"adapter-v{version}{label}")
        ctx.exported(version, folder)
        previous, handle = self._load_version(ctx, version, folder, start)
        # The version the sync replaces stays loaded until `old_after_sync` has scored it (`keeps_versions`; a
        # sampler on the trainer's own service has phases of its own for that).
        if previous is not None and previous.adapter_id != handle.adapter_id:
            if version == 1 and self.keeps_versions and not ctx.sampler.traits.shares_trainer_state:
                ctx.kept = previous
            else:
                ctx.sampler.retire(previous)

    @property
    def keeps_versions(self) -> bool:  # type: ignore[override]
        """A new name and id per version (`new-id`, `tensors`)."""
        return not self.same_id

    def restore(self, ctx: SyncContext) -> None:
        """Load the current version's folder again (its values were lost): in the modes that keep a name per version
        (`new-id`, `tensors`) under a new name and id, as those loops load every adapter they publish (verl: a new
        `lora_int_id` per load); in `inplace` in place under its own. On vLLM 0.26 the in-place reload after a level-2
        sleep left the engine serving the base (BENCHMARKS.md, seventeenth session): a finding of that mode."""
        assert ctx.handle is not None
        if not self.keeps_versions:
            self.load(ctx, ctx.handle.path, ctx.handle.name, ctx.handle.adapter_id, True)
            return
        previous, _ = self._load_version(ctx, len(ctx.adapters), ctx.handle.path, time.perf_counter(), "-restore")
        if previous is not None:
            ctx.sampler.retire(previous)

    def _load_version(self, ctx: SyncContext, version: int, folder: Path, start: float,
                      suffix: str = "") -> tuple[AdapterHandle | None, AdapterHandle]:
        """Load `folder` as version `version` (under the current name and id where the mode keeps one, else a new
        pair), recorded; it becomes the current handle. Returns (the handle it replaced, the new one)."""
        if self.same_id and ctx.handle is not None:
            name, adapter_id = ctx.handle.name, ctx.handle.adapter_id
        else:
            adapter_id = ctx.first_adapter_id + version
            name = f"lora-parity-{adapter_id}-v{version}{suffix}"
        handle = self.load(ctx, folder, name, adapter_id, self.load_inplace)
        _record(ctx, version, name, adapter_id, self.name, start)
        previous, ctx.handle = ctx.handle, handle
        return previous, handle

    def overwrite(self, ctx: SyncContext) -> None:
        """Reload the current adapter's id in place with the trainer's current weights."""
        assert ctx.handle is not None
        folder = ctx.trainer.export_adapter(ctx.workdir / "adapter-leak")
        self.load(ctx, folder, ctx.handle.name, ctx.handle.adapter_id, True)


def merging(trainer: object) -> MergingTrainer:
    """`trainer` as a `MergingTrainer` (preflight checked it; this guards direct callers)."""
    if not isinstance(trainer, MergingTrainer):
        raise ConfigError(f"{type(trainer).__name__} cannot merge its adapter")
    return trainer


def tensor_loading(sampler: object) -> TensorAdapterSampler:
    """`sampler` as a `TensorAdapterSampler` (preflight checked it; this guards direct callers)."""
    if not isinstance(sampler, TensorAdapterSampler):
        raise ConfigError(f"{type(sampler).__name__} cannot load adapters from tensors")
    return sampler


def reloading(sampler: object) -> BaseReloadingSampler:
    """`sampler` as a `BaseReloadingSampler` (preflight checked it; this guards direct callers)."""
    if not isinstance(sampler, BaseReloadingSampler):
        raise ConfigError(f"{type(sampler).__name__} cannot reload its base weights")
    return sampler


@dataclass(frozen=True)
class MergedSync(SyncMode):
    """The trainer merges alpha/r·BA into the base weights; the sampler, without LoRA, reloads its
    base weights in place: from a checkpoint folder (`merged`) or from tensors in memory (`memory`).
    After the run the sampler gets its own base weights back."""

    name: str = "merged"
    in_memory: bool = False
    sampler_lora: bool = False
    reloads_base: bool = True

    def require(self, trainer_cls: type, sampler_cls: type, trainer: str, sampler: str) -> None:
        """A trainer that merges and a sampler that reloads its base weights."""
        if not issubclass(trainer_cls, MergingTrainer):
            raise ConfigError(f"--sync {self.name} needs a trainer that can merge its adapter; {trainer!r} cannot")
        if not issubclass(sampler_cls, BaseReloadingSampler):
            raise ConfigError(f"--sync {self.name} needs a sampler that reloads base weights; {sampler!r} cannot")

    def publish(self, ctx: SyncContext, version: int, label: str = "", lose_one: bool = False) -> None:
        """Reload the sampler's base weights with the adapter merged in (recorded with id 0); in memory, in the
        user's buckets where the loop has them (`models.buckets`; `lose_one`: fault bucket-lost)."""
        start = time.perf_counter()
        folder = ctx.workdir / f"merged-v{version}{label}"
        trainer, sampler = merging(ctx.trainer), reloading(ctx.sampler)
        ctx.base_restored = False
        sent = None
        if self.in_memory:
            sent = buckets.deliver(sampler, trainer.merged_tensors(), ctx.bucket_bytes, lose_one)
        else:
            sampler.reload_base(folder=trainer.export_merged(folder))
        _record(ctx, version, folder.name, 0, self.name, start, sent)

    def restore(self, ctx: SyncContext) -> None:
        """Reload the last merged version: its folder (`merged`), or the trainer's merged tensors again (`memory`)."""
        sampler = reloading(ctx.sampler)
        ctx.base_restored = False
        if self.in_memory:
            buckets.deliver(sampler, merging(ctx.trainer).merged_tensors(), ctx.bucket_bytes)
        else:
            sampler.reload_base(folder=ctx.workdir / ctx.adapters[-1].name)

    def overwrite(self, ctx: SyncContext) -> None:
        """Reload the merged current weights (recorded as a `-leak` version)."""
        self.publish(ctx, version=len(ctx.adapters), label="-leak")

    def restore_base(self, ctx: SyncContext) -> None:
        """Reload the checkpoint's own base weights on the sampler."""
        reloading(ctx.sampler).reset_base()
        ctx.base_restored = True

    def retire(self, ctx: SyncContext) -> None:
        """Give the sampler its checkpoint's base weights back, unless the run's restore phase did (once is enough:
        a reload of every weight costs seconds on a real model)."""
        if ctx.adapters and not ctx.base_restored:
            self.restore_base(ctx)
        super().retire(ctx)


MODES: dict[str, SyncMode] = {
    "new-id": AdapterSync("new-id"),
    "inplace": AdapterSync("inplace", same_id=True, load_inplace=True),
    "merged": MergedSync("merged"),
    "memory": MergedSync("memory", in_memory=True),
    "tensors": AdapterSync("tensors", from_tensors=True),
}


def mode(name: str | SyncMode) -> SyncMode:
    """The sync mode called `name` (a mode given as an object is that mode: `CallerSync`); `ConfigError` for an
    unknown name."""
    if isinstance(name, SyncMode):
        return name
    if name not in MODES:
        raise ConfigError(f"unknown sync mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


class CallerSync(SyncMode):
    """The caller's own sync (`user`; the Python API, `lora_parity.api.check`): a callable that moves the trainer's
    current adapter into the engine the way the caller's stack does. lora-parity exports and loads nothing: each
    version is whatever that callable delivered. The engine serves one adapter, the last one synced, so every
    version has the same adapter id (as `inplace`; its name says which version it is) and none is kept to be
    scored after the next."""

    name = "user"

    def __init__(self, deliver: Callable[[], None]) -> None:
        self.deliver = deliver

    def publish(self, ctx: SyncContext, version: int, label: str = "") -> None:
        """Call the caller's sync; the engine's current adapter is then `version` (its handle names no folder)."""
        start = time.perf_counter()
        self.deliver()
        name = f"user-sync-v{version}{label}"
        adapter_id = ctx.first_adapter_id
        _record(ctx, version, name, adapter_id, self.name, start)
        ctx.handle = AdapterHandle(name, adapter_id, ctx.workdir / name)

    def overwrite(self, ctx: SyncContext) -> None:
        """The caller's sync, recorded as no new version (what a leak does)."""
        self.deliver()

    def restore(self, ctx: SyncContext) -> None:
        """The caller's sync again, recorded as no new version."""
        self.deliver()


class SyncWrapper(SyncMode):
    """A sync mode changed by a fault: everything the subclass does not override goes to `inner`."""

    def __init__(self, inner: SyncMode) -> None:
        self.inner = inner
        self.name = inner.name
        self.sampler_lora = inner.sampler_lora
        self.keeps_versions = inner.keeps_versions
        self.reloads_base = inner.reloads_base

    def require(self, trainer_cls: type, sampler_cls: type, trainer: str, sampler: str) -> None:
        """As the inner mode."""
        self.inner.require(trainer_cls, sampler_cls, trainer, sampler)

    def publish(self, ctx: SyncContext, version: int, label: str = "") -> None:
        """As the inner mode."""
        self.inner.publish(ctx, version, label)

    def sync(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.sync(ctx)

    def before_stale(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.before_stale(ctx)

    def overwrite(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.overwrite(ctx)

    def restore_base(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.restore_base(ctx)

    def restore(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.restore(ctx)

    def retire(self, ctx: SyncContext) -> None:
        """As the inner mode."""
        self.inner.retire(ctx)
