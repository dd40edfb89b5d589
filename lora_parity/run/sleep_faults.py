"""The sleep faults (issue 44; docs/faults.md): what the field's RL loops got wrong around a sleep and a wake, planted
at the seams of the sleep phases (`run.sleep_wake`). Their specs are registered in `lora_parity.run.faults.FAULTS`;
the hooks `Faults.woken_handle`, `skips_base_reload` and `after_wake` call the functions here. Each applies only where
the run exercises its sleep level (`--sleep-levels`) on a sampler that sleeps, and each must fail the W check of that
level's first phase (`verdict.sleep_wake`) while C, judged before any sleep, passes."""

from __future__ import annotations

from collections.abc import Sequence

from lora_parity.backends.base import AdapterHandle
from lora_parity.run.fault_spec import ADAPTER_MODES, FaultSpec
from lora_parity.run.sync import reloading
from lora_parity.util.errors import ConfigError

SLEEP_FAULTS = (
    # vLLM's level-1 sleep keeps the adapter's buffers; vllm #53888 reports a wake after which it silently stops
    # applying. Planted as the engine serving the base model where the adapter is asked for, after a level-1 wake.
    FaultSpec("wake-drops-adapter", "after a level-1 wake the adapter stops applying: the engine serves the base model "
              "where the synced adapter is asked for (vllm #53888)", ("W.sleep_wake.level1",), "fail",
              must_pass=("C.parity.mean",), modes=ADAPTER_MODES, needs_sleep=(1,)),
    # TRL #5312: after the wake the loop reloads the checkpoint's weights over what the sync pushed. In the merged
    # modes the sync pushed merged weights, which are lost; an adapter sync leaves the base as the checkpoint's, so a
    # reload of it changes nothing there (no fault: the adapter modes are left out).
    FaultSpec("wake-reloads-base", "after each wake the loop reloads the base weights from the checkpoint over the "
              "merged weights the sync pushed (TRL #5312)", ("W.sleep_wake.level1|W.sleep_wake.level2",), "fail",
              must_pass=("C.parity.mean",), modes=("merged", "memory"), needs_sleep=(1, 2)),
    # verl #7289, #7304: after a level-2 sleep, which discards the weights, an adapter-only sync loads the adapter and
    # never the base weights.
    FaultSpec("level2-base-lost", "after a level-2 sleep the loop syncs the adapter only and never reloads the base "
              "weights the sleep discarded (verl #7289, #7304)", ("W.sleep_wake.level2",), "fail",
              must_pass=("C.parity.mean",), modes=ADAPTER_MODES, needs_sleep=(2,)),
)
SLEEP_FAULT_NAMES = tuple(spec.name for spec in SLEEP_FAULTS)


def require_levels(inject: str | None, levels: Sequence[int]) -> None:
    """`ConfigError` where the injected fault breaks a sleep level the run does not exercise (`--sleep-levels`)."""
    name = (inject or "").partition("=")[0]
    spec = next((s for s in SLEEP_FAULTS if s.name == name), None)
    if spec is not None and not set(spec.needs_sleep) & set(levels):
        wanted = " or ".join(str(level) for level in spec.needs_sleep)
        raise ConfigError(f"fault {name!r} breaks a sleep at level {wanted}: it needs --sleep-levels {wanted} "
                          "(sampler.sleep_levels)")


def woken_handle(name: str | None, handle: AdapterHandle | None, level: int) -> AdapterHandle | None:
    """The adapter the engine applies after a wake at `level` (wake-drops-adapter at level 1: none)."""
    return None if name == "wake-drops-adapter" and level == 1 else handle


def skips_base_reload(name: str | None, level: int) -> bool:
    """Whether the loop skips reloading the base weights after a wake at `level` (level2-base-lost at level 2)."""
    return name == "level2-base-lost" and level == 2


def after_wake(name: str | None, sampler: object) -> None:
    """What the loop does once the engine is awake, before it serves (wake-reloads-base: the checkpoint's weights
    reloaded over the synced ones)."""
    if name == "wake-reloads-base":
        reloading(sampler).reset_base()
