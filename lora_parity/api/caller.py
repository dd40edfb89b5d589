"""The caller's trainer and engine (`protocols`) as a lora-parity trainer and sampler backend, so that the runner
runs them exactly as it runs its own: the same phases, noise model, checks and receipt.

The trainer backend makes lora-parity's update through the caller's tensors: seeded noise on every lora_B (or
one target kind's, or some layers'), drawn by `perturb.PYTHON_RECIPE`; its start point is the caller's A with
B zero. The sampler backend scores through the caller's engine, whichever adapter it serves (the caller's sync
put it there: `run.sync.CallerSync`); its only `publish` is lora-parity's fresh load of the trainer's tensors
(the exact sync check, X), for an engine that can take them (`TensorLoadingEngine`), undone when retired.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from lora_parity import __version__
from lora_parity.api import tensors as tn
from lora_parity.api.protocols import (
    BaseScoringEngine,
    CachedScoringEngine,
    Described,
    Engine,
    TensorLoadingEngine,
    Trainer,
)
from lora_parity.backends.base import AdapterHandle, BackendTraits, SamplerBackend, Scores, Sequences, TrainerBackend
from lora_parity.evidence.receipt import BackendInfo, Perturbation
from lora_parity.models import adapter_files
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import PYTHON_RECIPE, is_lora_b, python_noise, target_kind
from lora_parity.util.errors import PhaseError, ScoreError

BACKEND = "api"
"""The backend name both sides record (`BackendInfo.backend`); `settings.object` names the caller's class."""
NO_BASE = "the caller's engine has no score_base (lora_parity.api.BaseScoringEngine)"
"""Why the base phases are skipped for an engine that cannot score the base model alone."""


def _scores(value: Any, who: str) -> Scores:
    """The caller's scores as lists of floats (anything with `.tolist()` is read through it)."""
    raw = value.tolist() if hasattr(value, "tolist") else value
    try:
        return [[float(x) for x in (row.tolist() if hasattr(row, "tolist") else row)] for row in raw]
    except (TypeError, ValueError) as e:
        raise ScoreError(f"{who}.score returned no list of logprob lists ({e})") from None


def _info(obj: object, **settings: Any) -> BackendInfo:
    cls = type(obj)
    described = dict(obj.describe()) if isinstance(obj, Described) else {}
    return BackendInfo(backend=BACKEND, versions={"lora-parity": __version__},
                       settings={"object": f"{cls.__module__}.{cls.__qualname__}", "device": "unknown", **described,
                                 **settings})


class CallerTrainer(TrainerBackend):
    """The caller's `Trainer`, updated through its tensors. Its `start` is the caller's tensors as `check` found
    them; the start point of the run is their A with B zero, and `restore` puts `start` back."""

    traits = BackendTraits(needs_checkpoint=False, releases_nothing_at_exit=True,
                           start_adapter_unavailable="the Python API starts from the caller's A with B zero")

    def __init__(self, trainer: Trainer, start: Mapping[str, tn.Flat]) -> None:
        self.trainer = trainer
        self.start = dict(start)
        self.only_layers: frozenset[int] | None = None
        self._layers = tn.layout(self.start).layers

    def _read(self) -> dict[str, tn.Flat]:
        state = tn.read_state(self.trainer.lora_state_dict(), "trainer")
        if state.keys() != self.start.keys():
            raise PhaseError("the trainer's LoRA tensor names changed during the run")
        return state

    def _write(self, state: Mapping[str, tn.Flat]) -> None:
        self.trainer.load_lora_state_dict(tn.nested_state(state))

    def score(self, sequences: Sequences) -> Scores:
        return _scores(self.trainer.score(sequences), "trainer")

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        state = self._read()
        names = [n for n in state if is_lora_b(n) and (only is None or target_kind(n) == only)
                 and (self.only_layers is None or tn.layer_of(n) in self.only_layers)]
        for name in names:
            if any(state[name].values):
                raise PhaseError(f"refusing to perturb: {name} is non-zero before the update")
            flat = state[name]
            state[name] = tn.Flat(flat.shape, tuple(python_noise(name, seed, std, len(flat.values))))
        self._write(state)
        return Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=len(names),
                            num_elements=sum(len(state[n].values) for n in names), tensors=names,
                            recipe=PYTHON_RECIPE)

    def zero_b(self) -> None:
        """Every tensor back to the start point: A as `check` found it, B zero."""
        self._write({n: flat.zeros() if is_lora_b(n) else flat for n, flat in self.start.items()})

    def restore(self) -> None:
        """The caller's tensors back as `check` found them."""
        self._write(self.start)

    def layers(self) -> list[int]:
        """The decoder layers the tensor names carry (`LayerSubsetTrainer`; none where a name carries none)."""
        return list(self._layers)

    @contextlib.contextmanager
    def restricted_to(self, layers: Collection[int]) -> Iterator[None]:
        """Within: `perturb` moves only those layers' tensors."""
        self.only_layers = frozenset(layers)
        try:
            yield
        finally:
            self.only_layers = None

    def export_adapter(self, directory: Path) -> Path:
        raise PhaseError("the Python API exports nothing: the caller's sync moves the adapter")

    def info(self) -> BackendInfo:
        return _info(self.trainer, lora_tensors=len(self.start))

    def close(self) -> None:
        """The caller's trainer is the caller's to free."""


class CallerTensorTrainer(CallerTrainer):
    """A `CallerTrainer` whose tensors lora-parity may hand the engine directly (`TensorReadingTrainer`): chosen
    where the engine can load them (`TensorLoadingEngine`), so that the exact sync check runs."""

    def lora_tensors(self) -> dict[str, RawTensor]:
        """The caller's tensors now, as float64 (the values `lora_state_dict` gave, exactly)."""
        return {name: ("F64", list(flat.shape), struct.pack(f"<{len(flat.values)}d", *flat.values))
                for name, flat in self._read().items()}


class CallerEngine(SamplerBackend):
    """The caller's `Engine`: scores whatever adapter it serves; the base model where it can
    (`BaseScoringEngine`); a fresh load of the trainer's tensors where it can take them (`TensorLoadingEngine`)."""

    traits = BackendTraits(needs_checkpoint=False, releases_nothing_at_exit=True)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        if not isinstance(engine, BaseScoringEngine):
            self.traits = dataclasses.replace(type(self).traits, base_unavailable=NO_BASE)
        self.fresh: AdapterHandle | None = None
        self._served: dict[str, tn.Flat] | None = None
        """What the engine served before the fresh load, given back when it is retired."""

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        if adapter is None:
            if not isinstance(self.engine, BaseScoringEngine):
                raise PhaseError(f"asked for the base model: {NO_BASE}")
            return _scores(self.engine.score_base(sequences), "engine.score_base")
        return _scores(self.engine.score(sequences), "engine")

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """The fresh load: the PEFT folder's tensors (the trainer's, written by lora-parity) into the engine."""
        engine = self.engine
        if not isinstance(engine, TensorLoadingEngine):
            raise PhaseError("the caller's engine cannot load tensors (lora_parity.api.TensorLoadingEngine)")
        _, tensors = adapter_files.read_adapter(directory)
        served = tn.read_state(engine.lora_state_dict(), "engine")
        differ = sorted(set(served) ^ set(tensors))
        if differ:
            raise PhaseError(f"engine.lora_state_dict() and the trainer's differ in names (first: {differ[0]}); a "
                             "TensorLoadingEngine takes the trainer's names")
        self._served = served
        engine.load_lora_state_dict({n: tn.Flat(tuple(t.shape), tuple(t.to_floats())).nested()
                                     for n, t in tensors.items()})
        self.fresh = AdapterHandle(name, adapter_id, Path(directory))
        return self.fresh

    def retire(self, handle: AdapterHandle) -> None:
        """After the fresh load: the engine serves what it served before. Nothing else is ever unloaded (the
        caller's adapter stays)."""
        if handle == self.fresh and self._served is not None and isinstance(self.engine, TensorLoadingEngine):
            self.engine.load_lora_state_dict(tn.nested_state(self._served))
            self.fresh, self._served = None, None

    def info(self) -> BackendInfo:
        return _info(self.engine, base_model="scored" if isinstance(self.engine, BaseScoringEngine) else NO_BASE)

    def close(self) -> None:
        """The caller's engine is the caller's to shut down."""


class CallerCachedEngine(CallerEngine):
    """A `CallerEngine` that also scores through its prefix cache (`CachedScoringSampler`): chosen where the
    caller's engine can (`CachedScoringEngine`), so that the stale and synced engine are read that way too (P.*)."""

    traits = dataclasses.replace(CallerEngine.traits, reads_prefix_cache=True)

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """The caller's engine read through its prefix cache, under the adapter it serves now."""
        engine = self.engine
        if adapter is None or not isinstance(engine, CachedScoringEngine):
            raise PhaseError("cached scoring of the base model, or of an engine without score_cached")
        return _scores(engine.score_cached(sequences), "engine.score_cached")
