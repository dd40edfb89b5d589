"""The serving-layer faults' sync wrappers (`lora_parity.run.faults` declares them): what a client of an
HTTP-served sampler gets wrong at the sync step. They apply to a sampler served over HTTP only, but warm-prefix-cache,
which applies wherever the run reads the sampler's prefix cache (an in-process vLLM with prefix caching too)."""

from __future__ import annotations

import shutil

from lora_parity.run.sync import AdapterSync, SyncContext, SyncMode, SyncWrapper
from lora_parity.util.errors import ScoreError


def adapter_mode(mode: SyncMode) -> AdapterSync:
    """The adapter sync mode a serving-layer fault wraps (each applies to those modes only)."""
    assert isinstance(mode, AdapterSync), mode
    return mode


class SameNameNoInplace(SyncWrapper):
    """same-name-no-inplace: the update is reloaded under the served name without load_inplace, by a
    client that does not read the reply (a server refuses it and keeps the old adapter)."""

    def sync(self, ctx: SyncContext) -> None:
        """Export, then load under the handle the sampler has; an error answer is ignored."""
        assert ctx.handle is not None
        folder = ctx.trainer.export_adapter(ctx.workdir / "adapter-v1")
        try:
            adapter_mode(self.inner).load(ctx, folder, ctx.handle.name, ctx.handle.adapter_id, False)
        except ScoreError:
            pass  # the reply is what this fault does not read


class WarmPrefixCache(SyncWrapper):
    """warm-prefix-cache: the update overwrites the published folder and is reloaded in place under
    the same name and path, so a prefix cache keyed by (name, path) keeps the old adapter's blocks."""

    def sync(self, ctx: SyncContext) -> None:
        """Export, copy over the published folder, reload it in place."""
        assert ctx.handle is not None
        folder = ctx.trainer.export_adapter(ctx.workdir / "adapter-v1")
        published = ctx.workdir / "adapter-v0"
        shutil.copytree(folder, published, dirs_exist_ok=True)
        adapter_mode(self.inner).load(ctx, published, ctx.handle.name, ctx.handle.adapter_id, True)


class StaleFolder(SyncWrapper):
    """stale-folder: the sync step loads the folder published before the update, under the name the
    update gets (with --sync inplace: in place under the same name). SGLang loads a path it already
    serves under another name with only a warning in its log (sgl-project/sglang#13771; the name must
    be new, the path need not), so the load answers 200 and the old adapter is served."""

    def sync(self, ctx: SyncContext) -> None:
        """Export the update (never loaded), then publish `adapter-v0` as version 1 would be published."""
        assert ctx.handle is not None and isinstance(self.inner, AdapterSync)
        ctx.trainer.export_adapter(ctx.workdir / "adapter-v1")
        if self.inner.same_id:
            name, adapter_id = ctx.handle.name, ctx.handle.adapter_id
        else:
            adapter_id = ctx.first_adapter_id + 1
            name = f"lora-parity-{adapter_id}-v1"
        handle = self.inner.load(ctx, ctx.workdir / "adapter-v0", name, adapter_id, self.inner.load_inplace)
        previous, ctx.handle = ctx.handle, handle
        if previous.adapter_id != handle.adapter_id:
            ctx.sampler.retire(previous)


class UnloadBeforeScore(SyncWrapper):
    """unload-before-score: after the sync, the adapter about to be scored is unloaded."""

    def sync(self, ctx: SyncContext) -> None:
        """Sync as the mode does, then unload the synced adapter."""
        self.inner.sync(ctx)
        assert ctx.handle is not None
        ctx.sampler.retire(ctx.handle)
