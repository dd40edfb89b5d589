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
- `bucket_mb` (default none: one hand-over): the sync hands the merged weights over in buckets of at most this many
  MB, in the trainer's order, a tensor never cut, each bucket its own in-place reload of the engine (verl's
  `update_weights_bucket_megabytes`, NeMo-RL's refit buffer, SkyRL's transfer threshold): `--sync memory` only
  (`models.buckets`; fault `bucket-lost`, `run.loop`).

Recorded as `sampler.settings.loop` where not the default (and `sampler.settings.sync_buckets` always); the config
digest leaves the default out, and `bucket_mb` where unset (older digests hold). Pure: no engine import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lora_parity.evidence.receipt_models import SYNC_AT_ONCE
from lora_parity.models import key_values

KEYS = "reset_prefix_cache, wake, bucket_mb"


class LoopSpec(BaseModel):
    """The user's loop between a sync and the next scoring; the defaults are lora-parity's own loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reset_prefix_cache: bool = False
    wake: Literal["split", "all"] = "split"
    bucket_mb: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @property
    def default(self) -> bool:
        """lora-parity's own loop: no reset after the sync, the weights woken before it and the KV cache after, one
        hand-over."""
        return not self.reset_prefix_cache and self.wake == "split" and self.bucket_mb is None

    @property
    def bucket_bytes(self) -> int | None:
        """The bucket's size in bytes (None: one hand-over)."""
        return None if self.bucket_mb is None else max(1, int(self.bucket_mb * 1_000_000))

    def buckets(self) -> str:
        """How the sync hands the weights over, for the sampler's settings (`sync_buckets`; `verdict.lifecycle`)."""
        if self.bucket_mb is None:
            return SYNC_AT_ONCE
        return f"buckets of at most {self.bucket_mb:g} MB, one engine reload each"

    def describe(self) -> str:
        """One line for the receipt's sampler settings (`loop`)."""
        wake = ("the weights, the sync, then the KV cache" if self.wake == "split"
                else "everything at once, then the sync")
        line = f"prefix cache reset after the sync: {'yes' if self.reset_prefix_cache else 'no'}; wake: {wake}"
        return line if self.bucket_mb is None else f"{line}; sync in buckets of at most {self.bucket_mb:g} MB"


def parse(items: Iterable[str]) -> dict[str, Any]:
    """`--loop KEY=VALUE` strings as a mapping (values checked by `merged`)."""
    return key_values.parse(items, "--loop", KEYS)


def merged(spec: LoopSpec, given: Mapping[str, Any]) -> LoopSpec:
    """`spec` with `given` over it, validated; an unknown key or a bad value is a one-line `ConfigError`."""
    return key_values.merged(spec, given, "--loop")

