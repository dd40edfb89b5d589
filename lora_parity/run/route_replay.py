"""Route replay (R3) in the sequence, on an MoE model (docs/moe.md): the engine returns the experts each of its
scoring passes routed every token to (`RouteReturningSampler`), and the trainer's routers replay them
(`RouteReplayingTrainer`), so that A, B, C and T judge the forward an MoE RL stack trains with: the trainer's
zero-init scores with the zero pass's routes, its updated scores with the updated pass's, each per-target point
with that point's pass; the update's search and step (std auto, `--update step`) and the fp32 reference replay
the routes of the point they are made at.

`--route-replay on|off|auto` (or the config's `route_replay`; default auto): auto replays where both sides can
and otherwise records why not and goes on; on refuses a run where a side cannot (at preflight, by the backends'
classes); off never replays. A dense model records nothing.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from lora_parity.backends.base import (
    AdapterHandle,
    RouteReplayingTrainer,
    RouteReturningSampler,
    Routes,
    Sampler,
    SamplerBackend,
    Scores,
    Sequences,
    Trainer,
    TrainerBackend,
    routes_experts,
)
from lora_parity.backends.moe import route_table
from lora_parity.evidence.receipt import RouteReplay
from lora_parity.models.config import ModelConfig
from lora_parity.models.hub import hub_checkpoint
from lora_parity.run.moe_faults import REPLAY_FAULTS
from lora_parity.run.options import RunOptions
from lora_parity.util.errors import ConfigError, PhaseError
from lora_parity.verdict import routes as route_stats

MODES = ("on", "off", "auto")
ZERO = "zero"
NO_ROUTES = "the sampler does not return the routes of its scoring passes"
NO_REPLAY = "the trainer cannot replay routes"
SOURCES = {"trainer_zero": ZERO, "trainer_zero_repeat": ZERO, "reference_fp32": ZERO, "calibrate": ZERO,
           "perturb": ZERO, "trainer_updated": "updated", "trainer_updated_alt": "updated",
           "reference_fp32_updated": "updated", route_stats.SEARCH_KEY: ZERO}
"""Trainer-side pass (a score key, or a phase whose forwards are not recorded) -> the engine pass it replays.
Per-target points: `target.T.trainer` and `target.T.reference` replay `target.T.sampler`, and the target's
std search (`target.T.calibrate`) the zero pass."""


def mode_of(opts_mode: str | None, cfg: ModelConfig) -> str:
    """The run's mode: the option, else the config's, else auto; a `ConfigError` for anything else."""
    mode = opts_mode or cfg.route_replay or "auto"
    if mode not in MODES:
        raise ConfigError(f"--route-replay {mode!r}: choose from {', '.join(MODES)}")
    return mode


def is_moe(cfg: ModelConfig, model_dir: Path | None) -> bool:
    """Whether the model routes tokens to experts: a synthetic MoE shape, or a checkpoint whose config.json names
    experts (`routes_experts`)."""
    if cfg.model.synthetic is not None:
        return cfg.model.synthetic.moe is not None
    config = Path(model_dir) / "config.json" if model_dir is not None else None
    return config is not None and config.is_file() and routes_experts(json.loads(config.read_text()))


def _moe_before_loading(cfg: ModelConfig) -> bool:
    """`is_moe` before anything is built: the config's folder or the cached hub snapshot where there is one; a hub
    model not in the cache counts as MoE (its run stops at preflight anyway), a GGUF model as dense."""
    if cfg.model.synthetic is not None or cfg.model.path is not None:
        return is_moe(cfg, Path(cfg.model.path) if cfg.model.path is not None else None)
    if cfg.model.hf_id is not None:
        folder = hub_checkpoint(cfg.model.hf_id)
        return folder is None or is_moe(cfg, folder)
    return False


def _is(backend: object, protocol: type) -> bool:
    return issubclass(backend, protocol) if isinstance(backend, type) else isinstance(backend, protocol)


def unavailable(trainer: type[TrainerBackend] | Trainer, sampler: type[SamplerBackend] | Sampler) -> str | None:
    """Why these backends (classes or instances) cannot replay routes, or None where they can."""
    if not _is(trainer, RouteReplayingTrainer):
        return NO_REPLAY
    if sampler.traits.routing_unavailable:
        return sampler.traits.routing_unavailable
    return None if _is(sampler, RouteReturningSampler) else NO_ROUTES


def preflight(opts: RunOptions, cfg: ModelConfig, trainer: type[TrainerBackend], sampler: type[SamplerBackend]) -> bool:
    """Whether this run will replay routes, as far as the config (`_moe_before_loading`) and the backends' classes
    tell. `ConfigError`: `on` where a side cannot, or a fault that needs replay (`REPLAY_FAULTS`) injected into a run
    that does not replay."""
    mode = mode_of(opts.route_replay, cfg)
    moe = _moe_before_loading(cfg)
    why = unavailable(trainer, sampler) if moe else "the model is dense: there are no routes to replay"
    if mode == "on" and why is not None:
        side = opts.sampler if why != NO_REPLAY else "the trainer"
        raise ConfigError(f"--route-replay on: {side + ': ' if moe else ''}{why}")
    replays = mode != "off" and why is None
    fault = (opts.inject or "").partition("=")[0]
    if fault in REPLAY_FAULTS and not replays:
        raise ConfigError(f"fault {fault!r} {REPLAY_FAULTS[fault]}: it needs route replay (an MoE "
                          f"model, --route-replay on or auto, backends that can); here: {why or '--route-replay off'}")
    return replays


def as_given(sequences: Sequences, routes: Routes) -> Routes:
    """The routes handed to the trainer as the engine returned them (no fault)."""
    return routes


@dataclass
class Replay:
    """The run's route replay: what was decided, the routes of the engine's passes, and what each trainer-side
    pass replayed. `corrupt` is the injected fault's change of the routes on their way to the trainer."""

    mode: str = "auto"
    status: str = "off"
    reason: str = "a dense model"
    weights: str | None = None
    corrupt: Callable[[Sequences, Routes], Routes] = as_given
    routes: dict[str, Routes] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    moe: bool = False

    @property
    def on(self) -> bool:
        return self.status == "replayed"

    def score(self, sampler: Sampler, key: str, sequences: Sequences, handle: AdapterHandle | None) -> Scores:
        """The sampler's pass `key`, its routes kept where a trainer-side pass replays them (zero, stale, updated,
        each per-target point)."""
        if not (self.on and (key in (ZERO, "stale", "updated") or key.startswith("target."))):
            return sampler.score(sequences, handle)
        assert isinstance(sampler, RouteReturningSampler)
        scores, routes = sampler.score_with_routes(sequences, handle)
        self.routes[key] = routes
        return scores

    def table(self, key: str, sequences: Sequences, source: str | None = None,
              trainer: bool = True) -> dict[tuple[int, ...], list]:
        """The routes trainer-side pass `key` replays: those of engine pass `source` (default `source_of(key)`),
        as the injected fault hands them to the `trainer` (the fp32 reference, lora-parity's own, gets them as the
        engine returned them); recorded in `sources`."""
        source = source or source_of(key)
        if source not in self.routes:
            raise PhaseError(f"route replay: {key} needs the routes of the engine's {source} pass, which did not run")
        self.sources[key] = source
        routes = self.routes[source]
        return route_table(sequences, self.corrupt(sequences, routes) if trainer else routes)

    def replaying(self, trainer: Trainer, key: str, sequences: Sequences,
                  source: str | None = None) -> AbstractContextManager[None]:
        """Within: the trainer replays `table(key, ...)` (nothing changes where the run does not replay)."""
        if not self.on:
            return contextlib.nullcontext()
        assert isinstance(trainer, RouteReplayingTrainer)
        return trainer.replaying(self.table(key, sequences, source))

    def searched(self, point: str) -> str:
        """The score key of per-target point `point`'s search at its chosen std (`routes.TARGET_SEARCH_SUFFIX`),
        recorded as replaying the zero pass."""
        key = point + route_stats.TARGET_SEARCH_SUFFIX
        self.sources[key] = ZERO
        return key

    def record(self) -> RouteReplay | None:
        """The receipt's record (None: a dense model)."""
        if not self.moe:
            return None
        return RouteReplay(mode=self.mode, status=self.status, reason=self.reason, weights=self.weights,  # type: ignore[arg-type]
                           sources=dict(self.sources), routes=dict(self.routes),
                           changes=route_stats.changes(self.routes))


def source_of(key: str) -> str:
    """The engine pass trainer-side pass `key` replays (`SOURCES`, and per-target points)."""
    if key in SOURCES:
        return SOURCES[key]
    if key.startswith("target.") and key.endswith((".trainer", ".reference")):
        return key.rsplit(".", 1)[0] + ".sampler"
    if key.startswith("target.") and key.endswith(".calibrate"):
        return ZERO
    raise PhaseError(f"route replay: no engine pass for {key}")


def start(mode: str, moe: bool, trainer: Trainer, sampler: Sampler, sampler_name: str,
          corrupt: Callable[[Sequences, Routes], Routes] = as_given) -> Replay:
    """The run's decision, from the loaded backends: replayed, off, or not available (with the side's reason);
    `on` where a side cannot after all (an instance that found so at start-up) is a `ConfigError`."""
    replay = Replay(mode=mode, moe=moe, corrupt=corrupt)
    if not moe:
        return replay
    why = unavailable(trainer, sampler)
    if why is None and isinstance(trainer, RouteReplayingTrainer) and trainer.moe_layers() == 0:
        why = "the trainer's model has no MoE routers"
    if mode == "off":
        replay.reason = "--route-replay off"
    elif why is not None:
        if mode == "on":
            raise ConfigError(f"--route-replay on: {sampler_name if why != NO_REPLAY else 'the trainer'}: {why}")
        replay.status, replay.reason = "not_available", f"{sampler_name}: {why}" if why != NO_REPLAY else why
    else:
        assert isinstance(trainer, RouteReplayingTrainer)
        replay.status, replay.weights = "replayed", trainer.replayed_weights()
        replay.reason = (f"the trainer's routers took the experts of the engine's pass at each point ({mode}); the "
                         "routing weights stayed the trainer's own")
    return replay
