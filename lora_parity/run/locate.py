"""`lora-parity locate`: the first divergence of the base forward (issue 45, docs/locate.md).

At the start point of a receipt's run (the base model: both sides at zero-init, where A is judged), the picked
sequences (A's worst) are run through the fp32 reference (HF in fp32), the trainer (HF + PEFT, zero-init, the
checkpoint's dtype) and the engine (the in-process vLLM model, hooked); for an fp32 checkpoint also through HF in fp64,
which measures what fp32 explains. The hidden states at every point (`hidden_states.points`) are compared with the
reference's and judged by `verdict.locate_rule`. The run comes from the receipt through `cli.rerun.options_for` and
`runner.prepare` (the receipt is data: a shipped config it names, or the caller's `--model`), checked to be the
receipt's config, probes and weights.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_parity import __version__
from lora_parity.evidence.locate_models import LocateResult, LocateRule
from lora_parity.evidence.receipt import Receipt
from lora_parity.models import synthetic
from lora_parity.models.checkpoint import weights_digest
from lora_parity.run import locate_moe
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import locate_routes, locate_rule

INJECT = re.compile(r"engine-norm@(\d{1,4})(?:x(1\.\d{1,6}|2))?")
"""`--inject engine-norm@K[xF]`: decoder layer K's input_layernorm weight scaled by F (default `PLANTED_FACTOR`; above
1, at most 2) in the engine's copy only, after load: a divergence planted to show that the report names it."""
PLANTED_FACTOR = 1.01
SUPPORTED = (("hf", "vllm"),)
"""(trainer, sampler) pairs locate hooks: HF + PEFT, and vLLM in this process."""

Progress = Callable[[str, str, float], None]


@dataclass(frozen=True)
class LocateOptions:
    """What the caller of `locate` chooses."""

    sequences: int = 2
    """How many of A's worst sequences to compare."""
    inject: str | None = None
    """A planted fault (`INJECT`), or None."""


def planted_layer(inject: str | None) -> int | None:
    """The layer `--inject engine-norm@K[xF]` names (None without one); `ConfigError` for anything else."""
    planted = _planted(inject)
    return planted[0] if planted is not None else None


def _planted(inject: str | None) -> tuple[int, float] | None:
    if inject is None:
        return None
    match = INJECT.fullmatch(inject)
    factor = float(match.group(2) or PLANTED_FACTOR) if match is not None else 0.0
    if match is None or not 1.0 < factor <= 2.0:
        raise ConfigError(f"--inject {inject!r}: locate plants only engine-norm@K or engine-norm@KxF (layer K's "
                          f"input_layernorm weight x F, 1 < F <= 2, default {PLANTED_FACTOR}, in the engine)")
    return int(match.group(1)), factor


def check_locatable(plan: Any, receipt: Receipt) -> None:
    """`ConfigError` where locate cannot repeat the receipt's start point here: other backends, a start adapter
    (the start point is then not the base model), no zero-init scores, another checkpoint."""
    pair = (plan.opts.trainer, plan.opts.sampler)
    if pair not in SUPPORTED:
        raise ConfigError(f"locate hooks --trainer hf and --sampler vllm (in process); the receipt ran {pair[0]} and "
                          f"{pair[1]}")
    if receipt.start_adapter is not None or plan.cfg.perturbation.update == "step":
        raise ConfigError("the receipt's run started from an adapter (--adapter or --update step): locate compares "
                          "the base model, where a zero-init A is judged")
    if "zero" not in receipt.scores or "trainer_zero" not in receipt.scores:
        raise ConfigError("the receipt has no zero-init scores of both sides (phases zero and trainer_zero): its run "
                          "stopped before A")


def locate(plan: Any, receipt: Receipt, options: LocateOptions, progress: Progress | None = None) -> LocateResult:
    """Compare the hidden states of A's worst sequences on both sides with the fp32 reference's and name the first
    point where a side leaves what its precision explains. `plan` is `runner.prepare`'s for the receipt's run."""
    from lora_parity.backends import hidden_states as hs
    from lora_parity.backends.hf import load_base, pick_device

    say = progress or (lambda phase, status, seconds: None)
    check_locatable(plan, receipt)
    layer, factor = _planted(options.inject) or (None, PLANTED_FACTOR)
    timings: dict[str, float] = {}
    start = last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        timings[name] = round(now - last, 6)
        say(name, "ok", now - last)
        last = now

    cfg = plan.cfg
    picked = locate_rule.pick_sequences(receipt.scores, options.sequences)
    sequences = [plan.probes.sequences[p.index] for p in picked]
    model_dir = synthetic.materialize(cfg)
    if receipt.model.weights_digest is not None and weights_digest(model_dir) != receipt.model.weights_digest:
        raise ConfigError(f"the checkpoint of {cfg.name} is not the receipt's (its weights digest differs)")
    device = pick_device()
    reference_model = load_base(cfg, model_dir, device, dtype="float32")
    gates, moe_unavailable = locate_moe.hf_gates(reference_model)
    reference = hs.hf_states(reference_model, sequences, device, gates)
    del reference_model
    names = [n for n in reference[0] if not n.startswith(hs.ROUTER)]
    captures: dict[str, tuple[list[Any], list[Any]]] = {"reference": (reference, gates)}
    lap("reference.fp32")
    fp64 = None
    if cfg.model.dtype == "float32":
        fp64_model = load_base(cfg, model_dir, device, dtype="float64")
        hs.eager_experts(fp64_model)
        fp64_gates = locate_moe.hf_gates(fp64_model)[0] if gates else []
        captures["fp64"] = (hs.hf_states(fp64_model, sequences, device, fp64_gates), fp64_gates)
        fp64 = hs.distances(reference, captures["fp64"][0], names)
        lap("reference.fp64")
    trainer = plan.trainer_cls.create(cfg, model_dir, {}, plan.backend_options())
    try:
        trainer.zero_b()
        trainer_gates = locate_moe.hf_gates(trainer.model)[0] if gates else []
        captures["trainer"] = (hs.hf_states(trainer.model, sequences, device, trainer_gates), trainer_gates)
        trainer_d = hs.distances(captures["trainer"][0], reference, names)
    finally:
        trainer.close()
    lap("trainer")
    engine = _engine(plan, model_dir, sequences, reference, names, layer, gates, factor)
    captures["engine"] = (engine.states, engine.gates)
    moe_unavailable = moe_unavailable or engine.moe_unavailable
    lap("engine")
    data = [locate_rule.PointData(name, at, module, trainer_d[name], engine.distances[name],
                                  fp64[name] if fp64 is not None else None) for name, at, module in engine.points]
    noise = cfg.budgets.noise
    rule = LocateRule(tail_alpha=noise.tail_alpha) if noise is not None else LocateRule()
    floor = locate_rule.rounding_floor(hs.machine_eps(cfg.model.dtype), int(reference[0][names[-1]].shape[-1]))
    routed = bool(gates) and moe_unavailable is None
    layers = locate_moe.layer_scores(captures) if routed else []  # every side's router scores, once
    near_ties = locate_routes.near_ties(layers, rule.balance) if routed else None
    points, divergences = locate_rule.judge(data, rule, floor, near_ties)
    moe = None
    if routed:
        moe = locate_moe.routing(captures, picked, receipt.scores, divergences, rule.balance, layers)
        lap("moe")
    planted = engine.planted
    timings["total"] = round(time.perf_counter() - start, 6)
    created = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    injected = f"{options.inject} ({planted} weight x {factor:g}, engine only)" if planted else None
    return LocateResult(tool_version=__version__, created_at=created, receipt_digest=receipt.digest, model=cfg.name,
                        dtype=cfg.model.dtype, trainer=plan.opts.trainer, sampler=plan.opts.sampler,
                        a_failed=locate_rule.failing_a(receipt.checks), sequences=picked, rule=rule,
                        rounding_floor=floor, points=points, divergences=divergences, injected=injected,
                        timings=timings, moe=moe, moe_unavailable=moe_unavailable)


@dataclass(frozen=True)
class _EngineSide:
    distances: dict[str, list[list[float]]]
    """Per point, the engine's per-token distances from the reference."""
    planted: str | None
    """The planted module, if any."""
    points: list[Any]
    """The points in forward order (`hidden_states.PointInfo`)."""
    states: list[Any]
    """Per sequence, its captures (points and `router.I`)."""
    gates: list[Any]
    """The engine's MoE gates ([] for a dense model or where they cannot be compared)."""
    moe_unavailable: str | None
    """Why the engine's gates cannot be compared, if so."""


def _engine(plan: Any, model_dir: Any, sequences: list[list[int]], reference: list[Any], names: list[str],
            layer: int | None, trainer_gates: list[Any], factor: float = PLANTED_FACTOR) -> _EngineSide:
    """The engine's hidden states (and router logits where `trainer_gates` has MoE gates) and their distances."""
    from lora_parity.backends import hidden_states as hs

    sampler = plan.sampler_cls.create(plan.cfg, model_dir, {}, plan.backend_options())
    try:
        try:
            stack = hs.engine_stack(sampler.llm)
            planted = hs.scale_norm(stack, layer, factor) if layer is not None else None
        except ValueError as e:
            raise ConfigError(f"locate: {e}") from None
        engine_points = hs.points(stack)
        if [p[0] for p in engine_points] != names:
            raise ConfigError("the engine's model has other points than the trainer's (another layer layout)")
        gates, why = locate_moe.engine_gates(stack, trainer_gates)

        def score_one(seq: list[int]) -> object:
            sampler.llm.reset_prefix_cache()  # the whole prefill computed, never read from the cache
            return sampler.score([seq], None)

        try:
            states = hs.engine_states(stack, score_one, sequences, gates)
        except ValueError as e:
            raise ConfigError(f"locate: {e}") from None
        return _EngineSide(hs.distances(states, reference, names), planted, engine_points, states, gates, why)
    finally:
        sampler.close()
