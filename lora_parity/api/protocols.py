"""What a caller hands `lora_parity.api.check`: a trainer, an engine and a sync, its own objects, none of
lora-parity's backends. Each is a `typing.Protocol`: any object with these methods will do, no base class.

Token alignment, as everywhere in lora-parity ("the alignment rule in backends/base.py"): for a sequence of
n token ids, `score` returns n - 1 logprobs, and entry t is log p(tokens[t+1] | tokens[:t+1]). There is no
value for the first token.

Tensors cross the boundary by name. A LoRA tensor's name holds `lora_A` or `lora_B` right after the name of
the module it adapts, its target kind (PEFT's names do: `base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight`; `layers.0.q_proj.lora_A` will do too); A has the shape [rank, in], B [out, rank]; a decoder
layer's tensors carry its index as the first all-digit part of the name (`layers.3.`), which per-layer
coverage reads. lora-parity reads tensors as anything with `.tolist()` (a numpy array, a CPU torch tensor) or
as nested lists of numbers, and hands them back as nested lists of Python floats in the same shape: convert
with `torch.tensor(values, dtype=param.dtype)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

Sequences = list[list[int]]
"""Token id sequences."""
Scores = list[list[float]]
"""Per sequence, its n - 1 logprobs (the alignment rule above)."""
NestedFloats = list[Any]
"""A tensor as nested lists of Python floats, row-major, in its shape."""
Sync = Callable[[], None]
"""The caller's own sync: move the trainer's current LoRA tensors into the engine, the way the caller's stack
does (the code under test). lora-parity calls it once per adapter version, and once more at the end."""


@runtime_checkable
class Trainer(Protocol):
    """The trainer side: the model being trained, with its LoRA adapter."""

    def score(self, sequences: Sequences) -> Scores:
        """Logprobs of the model with its current adapter, per the alignment rule, from the logits in fp32."""
        ...

    def lora_state_dict(self) -> Mapping[str, Any]:
        """Every LoRA A and B tensor the model holds now, by name (see the module docstring), as they are:
        read from the model, not from a saved file."""
        ...

    def load_lora_state_dict(self, tensors: Mapping[str, NestedFloats]) -> None:
        """Set every named tensor to the given values (the names and shapes `lora_state_dict` gave). lora-parity's
        update (seeded noise on B), its return to the start point and the final restore go through here."""
        ...


@runtime_checkable
class Engine(Protocol):
    """The engine side: the inference engine that serves the adapter the caller's sync delivered."""

    def score(self, sequences: Sequences) -> Scores:
        """Prompt logprobs under the adapter it serves now (the last one the sync delivered), per the alignment
        rule; the route rollouts take (the same request path, the same adapter name)."""
        ...


@runtime_checkable
class BaseScoringEngine(Protocol):
    """An engine that can also score the base model alone. Without it the run skips the base phases (the
    receipt says why) and A's zero-adapter check."""

    def score_base(self, sequences: Sequences) -> Scores:
        """Prompt logprobs of the base model, no adapter, per the alignment rule."""
        ...


@runtime_checkable
class CachedScoringEngine(Protocol):
    """An engine with a prefix cache that rollouts read: it can also score the way they read it. The run then
    scores the stale engine through the cache (warming it with the old weights) and the synced one again, which
    must match the trainer as C does (checks P.*): a sync that keeps the cache serves KV blocks computed with the
    old weights. Without it the prefix cache is not checked."""

    def score_cached(self, sequences: Sequences) -> Scores:
        """The same values as `score` (the alignment rule), read the way a rollout reads the prefix cache: each
        sequence once whole (filling the cache), then each position as a request for the next token, whose
        prefix comes from the cache where it holds it."""
        ...


@runtime_checkable
class TensorLoadingEngine(Protocol):
    """An engine whose LoRA tensors lora-parity can load directly, bypassing the caller's sync: the trainer's
    tensors loaded fresh must score exactly as the synced adapter (the exact sync check, X). Without it X is
    not run."""

    def lora_state_dict(self) -> Mapping[str, Any]:
        """The LoRA tensors the engine serves now, under the trainer's names."""
        ...

    def load_lora_state_dict(self, tensors: Mapping[str, NestedFloats]) -> None:
        """Serve these tensors (the trainer's names and shapes) from now on, as a fresh load would."""
        ...


@runtime_checkable
class Described(Protocol):
    """A trainer or engine that says what the receipt should record about it (its stack, versions, mode, a fault
    planted on purpose): `settings` of the receipt's trainer or sampler, beside `object`."""

    def describe(self) -> Mapping[str, Any]:
        """JSON-serialisable facts about this object, by name."""
        ...
