"""The user's loop between a sync and the next scoring, as `sampler.loop` says (`models.loop`; issue 44): the
prefix-cache reset after the sync (`after_sync`), recorded in the sampler's settings (`with_loop`), and the fault
of the reset lost (`prefix-reset-dropped`). The wake around the sync is the sleep phases' (`run.sleep_wake`); the sync
in buckets is the merged mode's (`models.buckets`, `sync.MergedSync`), with its fault `bucket-lost`.

Where the loop resets, fault `warm-prefix-cache` (an in-place reload under the same name and path, nothing reset)
is not the user's loop and is left out; where it does not, `prefix-reset-dropped` has no reset to drop (`off`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models.loop import LoopSpec
from lora_parity.run.fault_spec import ADAPTER_MODES, FaultSpec
from lora_parity.run.serving_faults import WarmPrefixCache
from lora_parity.run.sync import MergedSync, SyncContext, SyncWrapper
from lora_parity.util.errors import ConfigError


class BucketLost(SyncWrapper):
    """bucket-lost: the sync step hands the update over in the user's buckets, all but the middle one."""

    def sync(self, ctx: SyncContext) -> None:
        """Publish version 1 as the merged mode does, one bucket lost."""
        assert isinstance(self.inner, MergedSync), self.inner
        self.inner.publish(ctx, version=1, lose_one=True)


LOOP_FAULTS = (
    # prime-rl #2270 ("KL would go crazy after a few hundred steps"), NeMo-RL #4018: KV of the old adapter served
    # after the sync. Planted where the user's loop resets the cache: the update reloaded in place under the same name
    # and path (as warm-prefix-cache), and the loop's reset after it lost.
    FaultSpec("prefix-reset-dropped", "the loop's prefix-cache reset after the sync is lost: the update reloaded in "
              "place under the same name and path, the old adapter's blocks warm (prime-rl #2270, NeMo-RL #4018)",
              ("P.parity.mean",), "fail", must_pass=("C.parity.mean",), modes=ADAPTER_MODES, sync=WarmPrefixCache,
              reads_reloaded_cache=True),
    # verl #7327, #6454: an update spanning several transfer buckets, a shared IPC buffer reused before the engine
    # read it. One bucket's tensors never reach the engine, which keeps the old weights there and answers as usual.
    FaultSpec("bucket-lost", "one bucket of the sync (the middle one) never reaches the engine, silently: its "
              "tensors keep the old weights (an update spanning several buckets; verl #7327, #6454)",
              ("X.sync.identical|C.parity.mean|C.slope|C.delta.cosine",), "fail", modes=("memory",),
              sync=BucketLost),
)


@runtime_checkable
class PrefixResetting(Protocol):
    """A sampler whose prefix cache lora-parity clears as the user's loop does."""

    def reset_prefix_cache(self) -> None:
        """Clear the engine's prefix cache (an error where the engine could not)."""
        ...


def off(spec: LoopSpec) -> dict[str, str]:
    """The faults this loop leaves out, with why."""
    out = {} if spec.bucket_mb is not None else {
        "bucket-lost": "it loses one bucket of the sync, and this loop hands the weights over at once (--loop "
                       "bucket_mb=N with --sync memory)"}
    if spec.reset_prefix_cache:
        return {**out, "warm-prefix-cache": "the user's loop resets the prefix cache after the sync (--loop "
                                            "reset_prefix_cache=true), which clears the old blocks; "
                                            "prefix-reset-dropped plants the reset lost"}
    return {**out, "prefix-reset-dropped": "it drops the loop's prefix-cache reset, and this loop resets nothing "
                                           "(--loop reset_prefix_cache=true)"}


def require(spec: LoopSpec, sampler_cls: type, name: str, sync: str = "new-id") -> None:
    """`ConfigError` where the user's loop resets the prefix cache and this sampler cannot (vllm, vllm-server can), or
    syncs in buckets otherwise than with the merged weights in memory (`--sync memory`)."""
    if spec.reset_prefix_cache and not issubclass(sampler_cls, PrefixResetting):
        raise ConfigError(f"--loop reset_prefix_cache=true: the {name} sampler has no prefix-cache reset here "
                          "(built for vllm and vllm-server)")
    if spec.bucket_mb is not None and sync != "memory":
        raise ConfigError(f"--loop bucket_mb: buckets hand over the merged weights in memory (--sync memory); --sync "
                          f"{sync} hands over a folder or an adapter whole")


def after_sync(run: Any) -> None:
    """The user's reset after the sync, where the loop resets and the sampler has a prefix cache to reset (not where
    prefix-reset-dropped loses it)."""
    if run.cfg.sampler.loop.reset_prefix_cache and not run.faults.is_("prefix-reset-dropped") and isinstance(
            run.sampler, PrefixResetting):
        run.sampler.reset_prefix_cache()


def with_loop(info: BackendInfo, spec: LoopSpec) -> BackendInfo:
    """The sampler's settings with how the sync hands the weights over (`sync_buckets`) and the user's loop (`loop`),
    where it is not lora-parity's own."""
    settings = {**info.settings, "sync_buckets": spec.buckets()}
    return info.model_copy(update={"settings": settings if spec.default else {**settings, "loop": spec.describe()}})
