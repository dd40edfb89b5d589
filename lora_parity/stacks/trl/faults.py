"""Faults planted in TRL's own code paths, each by wrapping the TRL (or PEFT, or vLLM) function TRL's sync calls on
the live objects (an attribute of the instance, removed after), so that TRL's code itself runs broken; each names
the check that must catch it (docs/trl.md, tests/test_trl_stack.py).

- `skip-sync`: `VLLMGeneration.sync_weights` does nothing: the adapter never reaches the engine (FIELD row 1; the
  adapter never sent, verl #7495/#7496). With sleep mode on, the engine that TRL put to sleep gets its weights back
  only from the sync: it scores with whatever its memory holds, caught at the start point (A.zero_adapter_noop).
- `sleep-reload`: after `sync_weights`, the engine reloads its checkpoint from disk (`collective_rpc(
  'reload_weights')`) over the pushed weights: what `VLLMGeneration.generate` did on waking in sleep mode before
  TRL #5313 (TRL #5312).
- `merge-skipped`: the policy's `merge_adapter` / `unmerge_adapter` do nothing inside the sync: TRL pushes the frozen
  base weights without the LoRA (FIELD row 1: only the base synced).
- `prefix-cache-kept`: the `reset_prefix_cache` that ends `sync_weights` (the `LLM`'s in colocate mode, the
  `VLLMClient`'s in server mode) does nothing: rollouts that share a prefix read KV blocks the old weights computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lora_parity.stacks.trl.adapters import generation_of, mode_of
from lora_parity.util.errors import ConfigError


@dataclass(frozen=True)
class TRLFault:
    """A fault in TRL's path: what it wraps, what it does, where it was reported, and the check that must fail."""

    name: str
    wraps: str
    """The function wrapped, as TRL names it."""
    effect: str
    reported: str
    caught_by: str
    """The check that must fail (`Result.failed_checks`)."""
    plant: Callable[[Any], list[tuple[object, str, Any]]]
    """Plants the fault on a trainer: returns (object, attribute, wrapper) triples to set on the live objects."""
    caught_asleep: str | None = None
    """The check that must fail instead under `vllm_enable_sleep_mode` (None: `caught_by` there too)."""

    def check(self, sleep_mode: bool) -> str:
        """The check that must fail on an engine with sleep mode on (`sleep_mode`) or off."""
        return self.caught_asleep if sleep_mode and self.caught_asleep else self.caught_by


def _skip_sync(trainer: Any) -> list[tuple[object, str, Any]]:
    return [(generation_of(trainer), "sync_weights", lambda: None)]


def _sleep_reload(trainer: Any) -> list[tuple[object, str, Any]]:
    generation = generation_of(trainer)
    sync = generation.sync_weights

    def sync_then_reload() -> None:
        sync()
        generation.llm.collective_rpc("reload_weights")  # the checkpoint from disk, over the weights just pushed

    return [(generation, "sync_weights", sync_then_reload)]


def _merge_skipped(trainer: Any) -> list[tuple[object, str, Any]]:
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    return [(model, "merge_adapter", lambda *a, **k: None), (model, "unmerge_adapter", lambda *a, **k: None)]


def _prefix_cache_kept(trainer: Any) -> list[tuple[object, str, Any]]:
    generation = generation_of(trainer)
    engine = generation.vllm_client if mode_of(trainer) == "server" else generation.llm
    return [(engine, "reset_prefix_cache", lambda *a, **k: True)]


FAULTS: dict[str, TRLFault] = {f.name: f for f in (
    TRLFault("skip-sync", "VLLMGeneration.sync_weights", "the sync does nothing: the engine keeps its old weights",
             "FIELD row 1 (verl #7495/#7496: the adapter never sent)", "C.moved.sampler", _skip_sync,
             # asleep, the engine dropped its weights (level 2) and only the sync loads them: it serves what its
             # memory holds from the first score on (on the H100 at 23dc0d9: A's mean 3.4 nats from fp32)
             caught_asleep="A.zero_adapter_noop"),
    TRLFault("sleep-reload", "VLLMGeneration.sync_weights",
             "after the sync the engine reloads its checkpoint from disk over the pushed weights",
             "TRL #5312, fixed by #5313 (generate() woke the engine with collective_rpc('reload_weights'))",
             "C.parity.mean", _sleep_reload),
    TRLFault("merge-skipped", "PeftModel.merge_adapter / unmerge_adapter",
             "the sync pushes the frozen base weights without the LoRA merged in",
             "FIELD row 1 (only the frozen base synced)", "C.moved.sampler", _merge_skipped),
    TRLFault("prefix-cache-kept", "LLM.reset_prefix_cache (colocate) / VLLMClient.reset_prefix_cache (server)",
             "the prefix cache outlives the sync: a shared prefix reads KV blocks of the old weights",
             "the reset that ends VLLMGeneration.sync_weights", "P.parity.mean", _prefix_cache_kept),
)}


@contextlib.contextmanager
def planted(trainer: Any, name: str | None) -> Iterator[TRLFault | None]:
    """Within: the fault `name` planted on `trainer`'s live objects (None: nothing planted); removed after, each
    object as it was. `ConfigError` for an unknown name."""
    if name is None:
        yield None
        return
    if name not in FAULTS:
        raise ConfigError(f"unknown TRL fault {name!r}; choose from {', '.join(FAULTS)}")
    fault = FAULTS[name]
    undo: list[tuple[object, str, bool, Any]] = []
    try:
        for obj, attribute, wrapper in fault.plant(trainer):
            own = vars(obj).get(attribute, _MISSING) if hasattr(obj, "__dict__") else _MISSING
            undo.append((obj, attribute, own is not _MISSING, own))
            object.__setattr__(obj, attribute, wrapper)
        yield fault
    finally:
        for obj, attribute, had_own, own in reversed(undo):
            if had_own:
                object.__setattr__(obj, attribute, own)
            else:
                object.__delattr__(obj, attribute)


_MISSING = object()
