"""The user's loop between a sync and the next scoring, as `sampler.loop` says (`models.loop`; issue 44): the
prefix-cache reset after the sync (`after_sync`), recorded in the sampler's settings (`with_loop`), and the fault
of the reset lost (`prefix-reset-dropped`). The wake around the sync is the sleep phases' (`run.sleep_wake`).

Where the loop resets, fault `warm-prefix-cache` (an in-place reload under the same name and path, nothing reset)
is not the user's loop and is left out; where it does not, `prefix-reset-dropped` has no reset to drop (`off`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models.loop import LoopSpec
from lora_parity.run.fault_spec import ADAPTER_MODES, FaultSpec
from lora_parity.run.serving_faults import WarmPrefixCache
from lora_parity.util.errors import ConfigError

LOOP_FAULTS = (
    # prime-rl #2270 ("KL would go crazy after a few hundred steps"), NeMo-RL #4018: KV of the old adapter served
    # after the sync. Planted where the user's loop resets the cache: the update reloaded in place under the same name
    # and path (as warm-prefix-cache), and the loop's reset after it lost.
    FaultSpec("prefix-reset-dropped", "the loop's prefix-cache reset after the sync is lost: the update reloaded in "
              "place under the same name and path, the old adapter's blocks warm (prime-rl #2270, NeMo-RL #4018)",
              ("P.parity.mean",), "fail", must_pass=("C.parity.mean",), modes=ADAPTER_MODES, sync=WarmPrefixCache,
              reads_reloaded_cache=True),
)


@runtime_checkable
class PrefixResetting(Protocol):
    """A sampler whose prefix cache lora-parity clears as the user's loop does."""

    def reset_prefix_cache(self) -> None:
        """Clear the engine's prefix cache (an error where the engine could not)."""
        ...


def off(spec: LoopSpec) -> dict[str, str]:
    """The faults this loop leaves out, with why."""
    if spec.reset_prefix_cache:
        return {"warm-prefix-cache": "the user's loop resets the prefix cache after the sync (--loop "
                                     "reset_prefix_cache=true), which clears the old blocks; prefix-reset-dropped "
                                     "plants the reset lost"}
    return {"prefix-reset-dropped": "it drops the loop's prefix-cache reset, and this loop resets nothing (--loop "
                                    "reset_prefix_cache=true)"}


def require(spec: LoopSpec, sampler_cls: type, name: str) -> None:
    """`ConfigError` where the user's loop resets the prefix cache and this sampler cannot (vllm, vllm-server can)."""
    if spec.reset_prefix_cache and not issubclass(sampler_cls, PrefixResetting):
        raise ConfigError(f"--loop reset_prefix_cache=true: the {name} sampler has no prefix-cache reset here "
                          "(built for vllm and vllm-server)")


def after_sync(run: Any) -> None:
    """The user's reset after the sync, where the loop resets and the sampler has a prefix cache to reset (not where
    prefix-reset-dropped loses it)."""
    if run.cfg.sampler.loop.reset_prefix_cache and not run.faults.is_("prefix-reset-dropped") and isinstance(
            run.sampler, PrefixResetting):
        run.sampler.reset_prefix_cache()


def with_loop(info: BackendInfo, spec: LoopSpec) -> BackendInfo:
    """The sampler's settings with the user's loop (`loop`), where it is not lora-parity's own."""
    if spec.default:
        return info
    return info.model_copy(update={"settings": {**info.settings, "loop": spec.describe()}})
