"""Fake trainer and sampler behind the real Protocols, for unit tests: pure Python, milliseconds.

The fake model's logprob of token `tok` after `prev` at position t is a fixed base value plus,
for each target kind K, (alpha/r) · Σ_layers (B_K,l · A_K,l) · feature_K(prev, tok, t) over
`NUM_LAYERS` layers. It is linear in B (and in A), like a LoRA's first-order effect, so deltas,
per-target coverage, an optimizer step on A and B (`step`, exact gradients) and every fault behave
as on the real backends. With a config of an MoE model (`model.synthetic.moe`) the fake routes too: each
token goes to the top-k of `_route_logit` over the config's experts in each of its layers, and each chosen
expert adds its own term to the token's score (`_expert_term`), so routes given to the trainer (route replay)
move its scores as an MoE model's would. Adapters travel as real PEFT folders (see `adapter_files`), and the fake
sampler keeps what it loaded under an id unless asked to reload in place, and sleeps and wakes, as vLLM does.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_parity.backends import sleep as sleep_mode
from lora_parity.backends.base import (
    AdapterHandle,
    BackendTraits,
    Routes,
    RouteTable,
    SamplerBackend,
    Scores,
    Sequences,
    TrainerBackend,
)
from lora_parity.evidence.receipt import BackendInfo, Perturbation
from lora_parity.models import adapter_files as af
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import is_lora_b, noise_seed, target_kind
from lora_parity.models.update_step import OBJECTIVE, OPTIMIZER, tensor_changes
from lora_parity.util.errors import ConfigError, PhaseError

_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


NUM_LAYERS = 2
"""Layers of the fake model: more than one, so that faults of some layers (partial-export) exist."""


def _module_path(kind: str, layer: int = 0) -> str:
    block = "self_attn" if kind in _ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{kind}"


def _module_of(name: str) -> str:
    """The module a LoRA tensor belongs to (its name before `.lora_A` / `.lora_B`)."""
    return name.split(".lora_")[0]


def _base_logprob(prev: int, tok: int) -> float:
    return -3.0 - ((tok * 31 + prev * 17) % 97) / 16.0


def _feature(k: int, prev: int, tok: int, t: int) -> float:
    return 3.0 * math.sin(1.3 * (k + 1) + 0.7 * prev + 0.11 * tok + 0.05 * t)


@dataclass(frozen=True)
class Experts:
    """The fake's MoE shape, from the config's `model.synthetic.moe`."""

    num_experts: int
    top_k: int


def _experts_of(cfg: ModelConfig) -> Experts | None:
    moe = cfg.model.synthetic.moe if cfg.model.synthetic is not None else None
    return Experts(moe.num_experts, moe.num_experts_per_tok) if moe is not None else None


EXPERT_SCALE = 0.3
"""Each routed expert's term in a token's score: a wrong expert moves it by tenths of a nat."""
ROUTE_GAIN = 0.0
"""How far the adapter (the sum of its coefficients) moves the router logits; 0: routing ignores the adapter.
Unit tests set it, so that an update changes some routes."""


def _route_logit(layer: int, expert: int, token: int, t: int, shift: float) -> float:
    return (math.sin(1.7 * (expert + 1) * (layer + 1) + 0.61 * token + 0.023 * (expert + 1) * t)
            + shift * math.sin(2.9 * expert + 0.37 * token + layer))


def _routes(sequences: Sequences, experts: Experts, coefficients: dict[str, float], noise: float = 0.0) -> Routes:
    """Each token's top-k experts in each of the `NUM_LAYERS` MoE layers ([sequence][token][layer], ascending);
    `noise` moves the logits (a side whose routers compute a little otherwise)."""
    shift = ROUTE_GAIN * math.fsum(coefficients.values())
    out: Routes = []
    for seq in sequences:
        rows = []
        for t, token in enumerate(seq):
            layers = []
            for layer in range(NUM_LAYERS):
                logits = [_route_logit(layer, e, token, t, shift) + noise * math.sin(5.3 * e + 1.1 * token + 0.7 * t)
                          for e in range(experts.num_experts)]
                layers.append(sorted(sorted(range(experts.num_experts), key=lambda e: -logits[e])[:experts.top_k]))
            rows.append(layers)
        out.append(rows)
    return out


def _expert_term(chosen: list[list[int]], prev: int, tok: int) -> float:
    """What the experts a token is routed to (`chosen`, per layer) add to its score; every one weighs the same."""
    return EXPERT_SCALE * math.fsum(math.sin(0.9 * (e + 1) + 0.31 * tok + 0.13 * prev + 0.5 * layer)
                                    for layer, experts in enumerate(chosen) for e in experts)


def _score(sequences: Sequences, coefficients: dict[str, float], kinds: list[str],
           routes: Routes | None = None) -> Scores:
    out: Scores = []
    for s, seq in enumerate(sequences):
        row = []
        for t in range(len(seq) - 1):
            prev, tok = seq[t], seq[t + 1]
            value = _base_logprob(prev, tok) + (_expert_term(routes[s][t], prev, tok) if routes is not None else 0.0)
            for k, kind in enumerate(kinds):
                value += coefficients.get(kind, 0.0) * _feature(k, prev, tok, t)
            row.append(min(value, 0.0))  # a logprob: a search for a huge update (A broken) must not leave the domain
        out.append(row)
    return out


def _coefficients(config: dict, tensors: dict[str, af.Tensor]) -> dict[str, float]:
    """(alpha/r) · B·A per target kind, from a PEFT adapter's files."""
    scale = float(config["lora_alpha"]) / float(config["r"])
    a: dict[str, list[float]] = {}
    b: dict[str, list[float]] = {}
    for name, tensor in tensors.items():
        (b if is_lora_b(name) else a)[_module_of(name)] = tensor.to_floats()
    out: dict[str, float] = {}
    for module in sorted(set(a) & set(b)):
        kind = target_kind(module + ".lora_A")
        out[kind] = out.get(kind, 0.0) + scale * math.fsum(x * y for x, y in zip(a[module], b[module], strict=True))
    return out


def _score_at(prev: int, tok: int, t: int, coefficients: dict[str, float], kinds: list[str]) -> float:
    return _base_logprob(prev, tok) + sum(coefficients.get(kind, 0.0) * _feature(k, prev, tok, t)
                                          for k, kind in enumerate(kinds))


def _sample(prev: int, t: int, coefficients: dict[str, float], kinds: list[str], rng: random.Random) -> int:
    """One token after `prev` at position t, drawn with weights exp(`_score`) over the first
    `GENERATION_VOCAB` ids (the fake's generation logprobs are its prompt scores, by construction)."""
    values = [_score_at(prev, tok, t, coefficients, kinds) for tok in range(GENERATION_VOCAB)]
    top = max(values)
    return rng.choices(range(GENERATION_VOCAB), weights=[math.exp(v - top) for v in values])[0]


GENERATION_VOCAB = 64
"""The fake sampler generates ids below this."""


class FakeTrainer(TrainerBackend):
    """A trainer whose model is `_score` over the adapter's B·A per target kind."""

    traits = BackendTraits(needs_checkpoint=False, start_adapter_unavailable=None,
                           rounding_unresolved="its 16 values per module, rounded to fp16, move its scores by about "
                                               "the fp32 budget (1e-4): caught in some seeds only")

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, seed: int, timings: dict[str, float]) -> None:
        self.cfg = cfg
        self.kinds = list(cfg.adapter.targets)
        r = cfg.adapter.rank
        rng = random.Random(seed)
        self.params: dict[str, list[float]] = {}
        for layer in range(NUM_LAYERS):
            for kind in self.kinds:
                module = _module_path(kind, layer)
                self.params[f"{module}.lora_A.default.weight"] = [rng.uniform(-1, 1) for _ in range(r)]
                self.params[f"{module}.lora_B.default.weight"] = [0.0] * r
        self.trainable_base = False
        self.start = {name: list(values) for name, values in self.params.items()}
        """Every LoRA tensor at the start point (A as initialized or loaded; B zero or the start adapter's)."""
        self.experts = _experts_of(cfg)
        self.forced: RouteTable | None = None
        """The routes `replaying` forces now; None: the fake's own routing."""

    def load_start_adapter(self, folder: Path) -> None:
        """Take A and B from a PEFT folder of the fake's layout (the config matches it)."""
        _, tensors = af.read_adapter(folder)
        for name, tensor in tensors.items():
            key = name.replace(".weight", ".default.weight")
            if key not in self.params:
                raise PhaseError(f"the adapter has {name}, which the fake trainer does not")
            self.params[key] = tensor.to_floats()
        self.start = {name: list(values) for name, values in self.params.items()}

    def _coefficients(self) -> dict[str, float]:
        scale = self.cfg.adapter.alpha / self.cfg.adapter.rank
        out = {}
        for kind in self.kinds:
            modules = [_module_path(kind, layer) for layer in range(NUM_LAYERS)]
            out[kind] = math.fsum(scale * math.fsum(x * y for x, y in zip(self.params[f"{m}.lora_A.default.weight"],
                                                                           self.params[f"{m}.lora_B.default.weight"],
                                                                           strict=True)) for m in modules)
        return out

    def score(self, sequences: Sequences) -> Scores:
        return _score(sequences, self._coefficients(), self.kinds, self._routes(sequences))

    def _routes(self, sequences: Sequences) -> Routes | None:
        if self.experts is None:
            return None
        if self.forced is None:
            return _routes(sequences, self.experts, self._coefficients())
        missing = next((seq for seq in sequences if tuple(seq) not in self.forced), None)
        if missing is not None:
            raise PhaseError(f"route replay: no routes for this sequence of {len(missing)} tokens")
        return [list(self.forced[tuple(seq)]) for seq in sequences]

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """The fake's own routes under the current adapter (None: a dense config)."""
        return _routes(sequences, self.experts, self._coefficients()) if self.experts is not None else None

    def moe_layers(self) -> int:
        return NUM_LAYERS if self.experts is not None else 0

    def replayed_weights(self) -> str:
        return "the fake's: every routed expert weighs the same (its terms add up)"

    @contextlib.contextmanager
    def replaying(self, routes: RouteTable) -> Iterator[None]:
        self.forced = routes
        try:
            yield
        finally:
            self.forced = None

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        if self.trainable_base:
            raise PhaseError("refusing to perturb: a non-adapter parameter is trainable")
        names = [n for n in self.params if is_lora_b(n) and (only is None or target_kind(n) == only)]
        for name in names:
            if self.params[name] != self.start[name]:
                raise PhaseError(f"refusing to perturb: {name} is non-zero before the update "
                                 "(relative to the starting adapter's B)")
            rng = random.Random(noise_seed(name, seed))
            self.params[name] = [b + rng.gauss(0.0, std) for b in self.params[name]]
        return Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=len(names),
                            num_elements=sum(len(self.params[n]) for n in names), tensors=names)

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> Perturbation:
        """One AdamW step (betas 0.9/0.999, eps 1e-8, no weight decay, fresh state) on every A and B
        (or target kind `only`'s) that raises the mean logprob of `sequences`; exact gradients of
        the fake model. Refuses unless every tensor is at the start point."""
        if self.trainable_base:
            raise PhaseError("refusing to step: a non-adapter parameter is trainable")
        names = [n for n in self.params if only is None or target_kind(n) == only]
        moved = [n for n in names if self.params[n] != self.start[n]]
        if moved:
            raise PhaseError(f"refusing to step: {moved[0]} is not at the start point")
        scale = self.cfg.adapter.alpha / self.cfg.adapter.rank
        features = {kind: 0.0 for kind in self.kinds}
        num_positions = 0
        for seq in sequences:
            for t in range(len(seq) - 1):
                for k, kind in enumerate(self.kinds):
                    features[kind] += _feature(k, seq[t], seq[t + 1], t)
                num_positions += 1
        before = {n: list(self.params[n]) for n in names}
        for name in names:
            other = before[name.replace(".lora_A.", ".lora_X.").replace(".lora_B.", ".lora_A.")
                           .replace(".lora_X.", ".lora_B.")]
            # d(mean logprob)/d(B_i) = scale · A_i · mean feature, and the same with A and B swapped; the loss
            # is its negative. Adam's first step from zero moments: m̂ = g, v̂ = g².
            grads = [-scale * o * features[target_kind(name)] / num_positions for o in other]
            self.params[name] = [w - learning_rate * g / (abs(g) + 1e-8)
                                 for w, g in zip(before[name], grads, strict=True)]
        return Perturbation(kind="optimizer_step", seed=seed, std=0.0, num_tensors=len(names),
                            num_elements=sum(len(self.params[n]) for n in names), tensors=names,
                            learning_rate=learning_rate, optimizer=OPTIMIZER, objective=OBJECTIVE,
                            tensor_changes=tensor_changes(before, self.params))

    def zero_b(self) -> None:
        """Every LoRA tensor back to the start point (A too: a step moves it)."""
        for name in self.params:
            self.params[name] = list(self.start[name])

    def lora_tensors(self) -> dict[str, RawTensor]:
        """The toy model's A and B values as F64 tensors, under PEFT's saved names."""
        r = self.cfg.adapter.rank
        return {name.replace(".default.weight", ".weight"):
                ("F64", [1, r] if is_lora_b(name) else [r, 1], struct.pack(f"<{len(values)}d", *values))
                for name, values in self.params.items()}

    def export_adapter(self, directory: Path) -> Path:
        r = self.cfg.adapter.rank
        tensors = {}
        for name, values in self.params.items():
            file_name = name.replace(".default.weight", ".weight")
            shape = [1, r] if is_lora_b(name) else [r, 1]
            tensors[file_name] = af.Tensor.from_floats("F64", shape, values)
        config = {"r": r, "lora_alpha": self.cfg.adapter.alpha, "target_modules": sorted(self.kinds),
                  "peft_type": "LORA", "lora_dropout": 0.0}
        af.write_adapter(directory, config, tensors)
        return Path(directory)

    def merged_tensors(self) -> dict[str, float]:
        """The fake model's 'merged weights': its coefficient per target kind."""
        return self._coefficients()

    def export_merged(self, directory: Path) -> Path:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "merged.json").write_text(json.dumps(self.merged_tensors()))
        return Path(directory)

    def info(self) -> BackendInfo:
        return BackendInfo(backend="fake", versions={}, settings={"rank": self.cfg.adapter.rank})

    def close(self) -> None:
        pass


def _with_noise(scores: Scores, sequences: Sequences, coefficients: dict[str, float], std: float) -> Scores:
    """Scores plus seeded Gaussian noise of `std` per position, a function of the model state (the non-zero
    coefficients) and the tokens: like bf16 rounding, the same state scores the same twice, any other
    state differs by fresh noise, and a zero adapter scores like the base model."""
    state = repr(sorted((k, round(v, 12)) for k, v in coefficients.items() if v != 0.0))
    out: Scores = []
    for seq, row in zip(sequences, scores, strict=True):
        rng = random.Random(f"{state}|{list(seq)}")
        out.append([min(x + rng.gauss(0.0, std), 0.0) for x in row])
    return out


class FakeSampler(sleep_mode.SleepBookkeeping, SamplerBackend):
    """A sampler that scores with the coefficients of the adapter folders it loaded, by id (and sleeps as vLLM)."""

    traits = BackendTraits(needs_checkpoint=False, mixed_batch_unavailable=None, sleep_unavailable=None)
    adapters_per_batch: int = 2
    """`MixedBatchSampler`: adapters one batch serves (the engine's max_loras)."""
    noise: float = 0.0
    """Std of the bf16-like noise added to every score (`_with_noise`); 0: exact. Unit tests set it."""
    mirrored: bool = False
    """Unit tests set it: `exact_scorer` then mirrors this sampler (the exact reference, E)."""
    reported_weight_version: str | None = None
    """Unit tests set it: the weight version this engine reports (None: none, as most engines)."""
    route_noise: float = 0.0
    """Unit tests set it: how far this sampler's router logits differ from the trainer's (near-ties flip)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], lora: bool = True) -> None:
        self.kinds = list(cfg.adapter.targets)
        self.scale = cfg.adapter.alpha / cfg.adapter.rank
        self.base: dict[str, float] = {}
        self.loaded: dict[int, dict[str, float]] = {}
        self.reloads_without_inplace = 0
        self.experts = _experts_of(cfg)

    def _routes(self, sequences: Sequences, coefficients: dict[str, float]) -> Routes | None:
        return _routes(sequences, self.experts, coefficients, self.route_noise) if self.experts is not None else None

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        return self.score_with_routes(sequences, adapter)[0]

    def score_mixed(self, sequences: Sequences, routes: Sequence[AdapterHandle | None]) -> list[Scores]:
        """`MixedBatchSampler`: each route's scores, as alone (a fake has no batch to mix)."""
        return [self.score(sequences, handle) for handle in routes]

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`score`, and the routes it took (none for a dense config)."""
        self.check_awake("score")
        coefficients = self.loaded[adapter.adapter_id] if adapter else self.base
        routes = self._routes(sequences, coefficients)
        scores = _score(sequences, coefficients, self.kinds, routes)
        if self.base_lost:  # zeroed weights: uniform logits, whatever the adapter
            scores = [[sleep_mode.LOST_LOGPROB] * (len(seq) - 1) for seq in sequences]
        return (_with_noise(scores, sequences, coefficients, self.noise) if self.noise else scores), routes or []

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """The base model's routes (None: a dense config)."""
        return self._routes(sequences, self.base)

    def weight_version(self) -> str | None:
        return self.reported_weight_version

    def exact_scorer(self, base: object = None) -> Callable[[Sequences, list[Mapping[str, RawTensor]]], list[Scores]]:
        """This sampler's arithmetic with each given set of tensors as they are in memory (where `mirrored`)."""
        if not self.mirrored:
            raise ConfigError("exact reference: the fake sampler is mirrored only where a unit test asks")

        def score(sequences: Sequences, states: list[Mapping[str, RawTensor]]) -> list[Scores]:
            out = []
            for state in states:
                values = {n: struct.unpack(f"<{len(raw) // 8}d", raw) for n, (_, _, raw) in state.items()}
                coefficients: dict[str, float] = {}
                for name in sorted(values):  # the order the sampler sums its modules in
                    if is_lora_b(name):
                        a = values[name.replace("lora_B", "lora_A")]
                        kind = target_kind(name)
                        coefficients[kind] = coefficients.get(kind, 0.0) + self.scale * math.fsum(
                            x * y for x, y in zip(a, values[name], strict=True))
                scores = _score(sequences, coefficients, self.kinds, self._routes(sequences, coefficients))
                out.append(_with_noise(scores, sequences, coefficients, self.noise) if self.noise else scores)
            return out

        return score

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """Seeded sampling from the fake model (ids below `GENERATION_VOCAB`); see `GeneratingSampler`."""
        coefficients = self.loaded[adapter.adapter_id] if adapter else self.base
        sequences: Sequences = []
        for i, prompt in enumerate(prompts):
            rng = random.Random(seed + i)
            seq = list(prompt)
            for _ in range(max_tokens):
                seq.append(_sample(seq[-1], len(seq) - 1, coefficients, self.kinds, rng))
            sequences.append(seq)
        return sequences, _score(sequences, coefficients, self.kinds, self._routes(sequences, coefficients))

    def drop_adapters(self) -> None:  # a level-2 sleep: each loaded adapter's values lost (read as zero)
        self.loaded = {adapter_id: {} for adapter_id in self.loaded}

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        self.check_awake("load an adapter", weights_only=True)
        if adapter_id not in self.loaded or inplace:
            config, tensors = af.read_adapter(directory)
            self.loaded[adapter_id] = _coefficients(config, tensors)
        return AdapterHandle(name, adapter_id, Path(directory))

    def reload_base(self, folder: Path | None = None, tensors: dict[str, float] | None = None) -> None:
        self.check_awake("load weights", weights_only=True)
        if tensors is None:  # the merged folder (`export_merged`)
            tensors = json.loads((Path(str(folder)) / "merged.json").read_text())
        self.base, self.base_lost = {**self.base, **tensors}, False  # in place: the weights given, the rest kept

    def reset_base(self) -> None:
        self.check_awake("load weights", weights_only=True)
        self.base, self.base_lost = {}, False

    def retire(self, handle: AdapterHandle) -> None:
        self.loaded.pop(handle.adapter_id, None)

    def info(self) -> BackendInfo:
        return BackendInfo(backend="fake", versions={},
                           settings={"sleep_mode": sleep_mode.setting(None, self.sleep_levels)})

    def close(self) -> None:
        pass
