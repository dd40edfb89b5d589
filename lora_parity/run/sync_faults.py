"""The sync faults: each wraps the run's sync mode (`lora_parity.run.sync`) in a `SyncWrapper` that changes what
the sync does (their specs: `lora_parity.run.faults`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lora_parity.run.sync import AdapterSync, SyncContext, SyncMode, SyncWrapper, merging, reloading


class SkipSync(SyncWrapper):
    """skip-sync: the sync step does nothing."""

    def sync(self, ctx: SyncContext) -> None:
        """Nothing."""


class ReuseAdapterId(SyncWrapper):
    """reuse-adapter-id: the update is republished under the old name and id, without an in-place reload."""

    def sync(self, ctx: SyncContext) -> None:
        """Export, then load under the handle the sampler already has."""
        assert ctx.handle is not None
        folder = ctx.trainer.export_adapter(ctx.workdir / "adapter-v1")
        ctx.sampler.publish(folder, ctx.handle.name, ctx.handle.adapter_id, inplace=False)


def no_reload_flag(mode: SyncMode) -> SyncMode:
    """no-reload-flag: the in-place mode, without asking the sampler to reload in place."""
    assert isinstance(mode, AdapterSync)
    return replace(mode, load_inplace=False)


class StalePath(SyncWrapper):
    """stale-path: the updated weights are written, but the sampler reloads the zero-init folder."""

    def sync(self, ctx: SyncContext) -> None:
        """Export merged-v1, reload merged-v0."""
        merging(ctx.trainer).export_merged(ctx.workdir / "merged-v1")
        reloading(ctx.sampler).reload_base(folder=ctx.workdir / "merged-v0")


class StaleTensors(SyncWrapper):
    """stale-tensors: the sampler is handed a copy of the weights taken before the update."""

    zero: Any = None

    def publish(self, ctx: SyncContext, version: int, label: str = "") -> None:
        """Keep the zero-init merged weights, then publish as the mode does."""
        if version == 0 and self.zero is None:
            self.zero = merging(ctx.trainer).merged_tensors()
        self.inner.publish(ctx, version, label)

    def sync(self, ctx: SyncContext) -> None:
        """Reload the copy kept at zero-init."""
        reloading(ctx.sampler).reload_base(tensors=self.zero)


class Leak(SyncWrapper):
    """leak: the sampler gets the update before the stale phase."""

    def before_stale(self, ctx: SyncContext) -> None:
        """Overwrite what the sampler serves with the updated weights."""
        self.inner.overwrite(ctx)


class KeepMerged(SyncWrapper):
    """base-not-restored: the restore at the end of the run reloads nothing, and the merged weights stay."""

    def restore_base(self, ctx: SyncContext) -> None:
        """Nothing (`retire` still reloads them, so that the selftest's next run meets the checkpoint's weights)."""
