"""What the user's RL loop does between a sync and the next scoring (issue 44, the lifecycle section):
`--loop KEY=VALUE` (repeatable) over the config's `sampler.loop`.

- `reset_prefix_cache` (default false): the loop clears the engine's prefix cache after each sync (TRL's
  `sync_weights` ends with it; vLLM's `LLM.reset_prefix_cache`, a server's `POST /reset_prefix_cache`). lora-parity
  then does the same after its sync, before the cached phase reads the same prefixes again, so P checks that the
  reset took (fault `prefix-reset-dropped`: the reset lost). Without it lora-parity's loop resets nothing, the
  stricter case: P checks that the engine itself serves no old adapter's blocks (fault `warm-prefix-cache`).
- `wake` ("split", the default, or "all"): how the sleep phases (`run.sleep_wake`) wake the engine around the sync:
  "split" wakes the weights, syncs, then wakes the KV cache (vLLM's tags, verl's rollout wake-up); "all" wakes
  everything at once, then syncs (TRL's colocate loop where the weights slept).

Recorded as `sampler.settings.loop` where not the default; the config digest leaves the default out (older digests
hold). Pure: no engine import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lora_parity.models import key_values

KEYS = "reset_prefix_cache, wake"


class LoopSpec(BaseModel):
    """The user's loop between a sync and the next scoring; the defaults are lora-parity's own loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reset_prefix_cache: bool = False
    wake: Literal["split", "all"] = "split"

    @property
    def default(self) -> bool:
        """lora-parity's own loop: no reset after the sync, the weights woken before it and the KV cache after."""
        return not self.reset_prefix_cache and self.wake == "split"

    def describe(self) -> str:
        """One line for the receipt's sampler settings (`loop`)."""
        wake = ("the weights, the sync, then the KV cache" if self.wake == "split"
                else "everything at once, then the sync")
        return f"prefix cache reset after the sync: {'yes' if self.reset_prefix_cache else 'no'}; wake: {wake}"


def parse(items: Iterable[str]) -> dict[str, Any]:
    """`--loop KEY=VALUE` strings as a mapping (values checked by `merged`)."""
    return key_values.parse(items, "--loop", KEYS)


def merged(spec: LoopSpec, given: Mapping[str, Any]) -> LoopSpec:
    """`spec` with `given` over it, validated; an unknown key or a bad value is a one-line `ConfigError`."""
    return key_values.merged(spec, given, "--loop")

