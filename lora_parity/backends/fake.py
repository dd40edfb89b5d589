"""Fake trainer and sampler behind the real Protocols, for unit tests: pure Python, milliseconds.

The fake model's logprob of token `tok` after `prev` at position t is a fixed base value plus,
for each target kind K, (alpha/r) · Σ_layers (B_K,l · A_K,l) · feature_K(prev, tok, t) over
`NUM_LAYERS` layers. It is linear in B (and in A), like a LoRA's first-order effect, so deltas,
per-target coverage, an optimizer step on A and B (`step`, exact gradients) and every fault behave
as on the real backends. Adapters travel as real PEFT folders (see `adapter_files`), and the fake sampler keeps
what it loaded under an id unless asked to reload in place, as vLLM does.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

from lora_parity.backends.base import AdapterHandle, BackendTraits, SamplerBackend, Scores, Sequences, TrainerBackend
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


def _score(sequences: Sequences, coefficients: dict[str, float], kinds: list[str]) -> Scores:
    out: Scores = []
    for seq in sequences:
        row = []
        for t in range(len(seq) - 1):
            prev, tok = seq[t], seq[t + 1]
            value = _base_logprob(prev, tok)
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
        return _score(sequences, self._coefficients(), self.kinds)

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


class FakeSampler(SamplerBackend):
    """A sampler that scores with the coefficients of the adapter folders it loaded, by id."""

    traits = BackendTraits(needs_checkpoint=False)
    noise: float = 0.0
    """Std of the bf16-like noise added to every score (`_with_noise`); 0: exact. Unit tests set it."""

    mirrored: bool = False
    """Unit tests set it: `exact_scorer` then mirrors this sampler (the exact reference, E)."""
    reported_weight_version: str | None = None
    """Unit tests set it: the weight version this engine reports (None: none, as most engines)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], lora: bool = True) -> None:
        self.kinds = list(cfg.adapter.targets)
        self.scale = cfg.adapter.alpha / cfg.adapter.rank
        self.base: dict[str, float] = {}
        self.loaded: dict[int, dict[str, float]] = {}
        self.reloads_without_inplace = 0

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        coefficients = self.loaded[adapter.adapter_id] if adapter else self.base
        scores = _score(sequences, coefficients, self.kinds)
        return _with_noise(scores, sequences, coefficients, self.noise) if self.noise else scores

    def weight_version(self) -> str | None:
        return self.reported_weight_version

    def exact_scorer(self) -> Callable[[Sequences, list[Mapping[str, RawTensor]]], list[Scores]]:
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
                scores = _score(sequences, coefficients, self.kinds)
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
        return sequences, _score(sequences, coefficients, self.kinds)

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        if adapter_id not in self.loaded or inplace:
            config, tensors = af.read_adapter(directory)
            self.loaded[adapter_id] = _coefficients(config, tensors)
        return AdapterHandle(name, adapter_id, Path(directory))

    def reload_base(self, folder: Path | None = None, tensors: dict[str, float] | None = None) -> None:
        if tensors is None:
            assert folder is not None
            tensors = json.loads((Path(folder) / "merged.json").read_text())
        self.base = dict(tensors)

    def reset_base(self) -> None:
        self.base = {}

    def retire(self, handle: AdapterHandle) -> None:
        self.loaded.pop(handle.adapter_id, None)

    def info(self) -> BackendInfo:
        return BackendInfo(backend="fake", versions={}, settings={})

    def close(self) -> None:
        pass
