"""The references' scorers, built by the runner: the fp32 reference at the start point (`start_scorer`: the base
model with the start adapter, scored once per probe set and start point), the fp32 reference of the trainer's
tensors at the points it moved to (`points_scorer`), and the exact reference (`exact_scorer`: the sampler's own
arithmetic with the trainer's tensors, at the start point too), for `reference_points`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lora_parity.backends.base import MirroredSampler, TensorReadingTrainer
from lora_parity.evidence.receipt import Reference, sha256_json
from lora_parity.models.config import ModelConfig
from lora_parity.run import preflight, start_adapter
from lora_parity.run.options import RunOptions
from lora_parity.run.sync import SyncMode
from lora_parity.util.errors import ConfigError


class Plan(Protocol):
    """What the scorers read of `runner.Plan`."""

    opts: RunOptions
    cfg: ModelConfig
    sync: SyncMode


class Backends(Protocol):
    """What the scorers read and keep in `runner.Backends`."""

    model_dir: Path | None
    reference: Reference | None
    reference_scores: dict[str, Any]
    exact_reference: Reference | None
    sampler: Any
    trainer: Any


def shared_base(plan: Plan, loaded: Backends) -> Any:
    """The run's one fp32 load for its references (`reference_base.ReferenceBase`, loaded at its first use); None
    without a checkpoint. The runner releases it at the run's end."""
    if loaded.model_dir is None:
        return None
    from lora_parity.backends.hf import pick_device
    from lora_parity.backends.reference_base import ReferenceBase

    return ReferenceBase(plan.cfg, loaded.model_dir, pick_device())


def start_scorer(plan: Plan, loaded: Backends, warm_folder: Path | None, base: Any = None) -> Callable[..., Any] | None:
    """The start point's fp32 scorer where `reference_decision` says to score it (kept in `loaded.reference`);
    it carries the start adapter: the user's, or the warm start the sequence writes (`warm_folder`); called with
    the sequences and the routes it replays (None: its own routing). Without a start adapter it scores the run's
    shared load (`base`)."""
    model_dir = loaded.model_dir

    def measure() -> tuple[int, int]:
        from lora_parity.backends.fp32_points import fp32_reference_memory

        assert model_dir is not None
        return fp32_reference_memory(model_dir)

    loaded.reference = preflight.reference_decision(plan.opts.reference, model_dir is not None,
                                                    plan.cfg.model.dtype, measure)
    if loaded.reference.status != "scored" or model_dir is None:
        return None
    from lora_parity.backends.hf import fp32_reference

    adapter = plan.opts.adapter or warm_folder
    score = fp32_reference(plan.cfg, model_dir, adapter, base)

    def once_per_probe_set(sequences: list[list[int]], routes: Any = None) -> Any:
        # The reference depends on the checkpoint, the start adapter, the tokens and the routes it replays only:
        # every run of a selftest on one load scores each probe set from each start point once (it loads the
        # fp32 model).
        replayed = sorted([list(k), v] for k, v in routes.items()) if routes is not None else None
        key = sha256_json([sequences, start_adapter.digest(adapter) if adapter is not None else None, replayed])
        if key not in loaded.reference_scores:
            loaded.reference_scores[key] = score(sequences, routes)
        return loaded.reference_scores[key]

    return once_per_probe_set


def points_scorer(plan: Plan, loaded: Backends, base: Any = None) -> Callable[..., Any] | None:
    """The fp32 scorer of the trainer's tensors (`fp32_points`, on the run's shared load `base`) wherever the start
    point's reference is scored."""
    if loaded.reference is None or loaded.reference.status != "scored" or loaded.model_dir is None:
        return None
    from lora_parity.backends.fp32_points import fp32_points

    return fp32_points(plan.cfg, loaded.model_dir, base)


EXACT_SCORED = ("the sampler's own operations with the trainer's tensors in memory, at the start, updated and every "
                "per-target point: the engine must equal it bit for bit (checks E.*)")


def exact_scorer(plan: Plan, loaded: Backends, base: Any = None) -> Callable[..., Any] | None:
    """The exact reference's scorer where the sampler can be mirrored here (`MirroredSampler`), the trainer's
    tensors read, and the sync publishes a LoRA adapter; the decision and its reason kept in
    `loaded.exact_reference`."""
    sampler, why = loaded.sampler, None
    if not plan.opts.exact_reference:
        why = "--no-exact-reference"
    elif not isinstance(sampler, MirroredSampler):
        why = "this sampler's arithmetic has no mirror here (the in-process vllm sampler on CUDA has)"
    elif not isinstance(loaded.trainer, TensorReadingTrainer):
        why = "the trainer's tensors cannot be read as they are"
    elif not plan.sync.sampler_lora:
        why = f"--sync {plan.opts.sync} publishes merged weights, not a LoRA adapter"
    scorer = None
    if why is None:
        try:
            scorer = sampler.exact_scorer(base)
        except ConfigError as e:
            why = str(e)
    loaded.exact_reference = Reference(status="scored" if why is None else "skipped", reason=why or EXACT_SCORED)
    return scorer


@dataclass
class Scorers:
    """A run's three reference scorers (each None where it is not scored) and their shared fp32 load."""

    start: Callable[..., Any] | None
    points: Callable[..., Any] | None
    exact: Callable[..., Any] | None
    base: Any

    @classmethod
    def build(cls, plan: Plan, loaded: Backends, warm_folder: Path | None) -> Scorers:
        base = shared_base(plan, loaded)
        return cls(start_scorer(plan, loaded, warm_folder, base), points_scorer(plan, loaded, base),
                   exact_scorer(plan, loaded, base), base)

    def release(self) -> None:
        """Free the shared load (at the run's end)."""
        if self.base is not None:
            self.base.release()
