"""HF transformers + PEFT: the `hf` trainer, and the `hf` sampler (an independent load, as a reference)."""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from lora_parity.backends import hf_graphs, hf_step, layer_subset, native_ops
from lora_parity.backends.adapter_export import AdapterWriter
from lora_parity.backends.base import (
    AdapterHandle,
    BackendTraits,
    RouteTable,
    SamplerBackend,
    Scores,
    Sequences,
    TrainerBackend,
    groups,
    routes_experts,
)
from lora_parity.backends.grouping import forward_description
from lora_parity.backends.hf_generate import generate_one
from lora_parity.backends.moe import REPLAYED_WEIGHTS, Routes, forced_routes, hf_router_topk, recorded_routes, routers
from lora_parity.backends.processed import processed_logprobs
from lora_parity.backends.raw_tensors import to_raw_all
from lora_parity.evidence.receipt import BackendInfo, Perturbation, sha256_json
from lora_parity.models.adapter_spec import peft_config
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import UnitNoise, add_noise, is_lora_b, target_kind
from lora_parity.util.errors import PhaseError, ScoreError


def pick_device() -> torch.device:
    """CUDA when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_name(device: torch.device) -> str:
    """Human name of a device, e.g. 'NVIDIA H200' or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def load_base(cfg: ModelConfig, model_dir: Path, device: torch.device, dtype: str | None = None) -> Any:
    """The base model from a local HF checkpoint (the config's dtype unless `dtype`), safetensors only, eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype or cfg.model.dtype), use_safetensors=True,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    return model.to(device).eval()  # type: ignore[arg-type]


def pack_tokens(cfg: ModelConfig, model: Any) -> int:
    """The trainer's tokens per forward (`scoring.pack_tokens`); 0 (`scoring.batch_size` sequences) for an MoE."""
    config = getattr(model, "config", None)
    return 0 if routes_experts(config.to_dict() if config is not None else {}) else cfg.scoring.pack_tokens


@torch.inference_mode()
@native_ops.plain_kernels()  # beside an in-process engine: PyTorch's kernels and settings, not the engine's mode
def score_sequences(model: Any, sequences: Sequences, device: torch.device, batch_size: int = 1, pack: int = 0,
                    tempered: tuple[list[int], float, int, float] | None = None,
                    graphs: hf_graphs.Graphs | None = None) -> Scores:
    """One forward per group (`groups`: `batch_size` sequences, or `pack` tokens), right-padded (causal attention never
    looks at the padding), eager with LoRA layers adding exactly zero left out (`zero_lora`: the same values) or
    replayed from `graphs`; log-softmax in fp32; aligned by the rule in backends/base.py. The token logprobs stay on
    the device until every forward is done, then come to the host in one transfer (a GPU waits once, not per row).
    `tempered` (prompt lengths, T, top-k, top-p): the positions that predict a drawn token as vLLM's processed
    logprobs (`processed.processed_logprobs`; `tempering`)."""
    gathered: list[torch.Tensor] = []
    with hf_graphs.forwards(model, graphs) as forward:
        for part in groups(sequences, batch_size, pack):
            group = sequences[part]
            width = max(len(seq) for seq in group)
            ids, mask = torch.zeros((2, len(group), width), dtype=torch.long)  # on the host, then one copy each
            for i, seq in enumerate(group):
                ids[i, :len(seq)] = torch.tensor(seq)
                mask[i, :len(seq)] = 1
            ids, mask = ids.to(device), mask.to(device)
            logits = forward(ids, mask if len(group) > 1 else None, tuple(len(seq) for seq in group))
            for i, seq in enumerate(group):
                n, row = len(seq), torch.log_softmax(logits[i, :len(seq) - 1].float(), dim=-1)
                if tempered is not None:
                    drawn = tempered[0][part.start + i] - 1
                    row[drawn:] = processed_logprobs(logits[i, drawn:n - 1], *tempered[1:], keep=ids[i, drawn + 1:n])
                gathered.append(row.gather(1, ids[i, 1:n, None])[:, 0])
            del logits
    flat = torch.cat(gathered).cpu().tolist() if gathered else []
    out: Scores = []
    at = 0
    for seq in sequences:
        out.append(flat[at:at + len(seq) - 1])
        at += len(seq) - 1
    return out


def fp32_reference(cfg: ModelConfig, model_dir: Path, adapter: Path | None = None,
                   base: Any = None) -> Callable[[Sequences, RouteTable | None], Scores]:
    """A scorer of the start point in fp32: the base model (at zero-init both sides equal it), or the base model
    with the user's start adapter (`--adapter`, its safetensors loaded by PEFT), which both sides then approximate;
    with routes, replaying them (`forced_routes`). Without a start adapter, the run's shared load (`base`, a
    `reference_base.ReferenceBase`, kept for the later points where it fits); else a load of its own, freed after."""

    def score(sequences: Sequences, routes: RouteTable | None = None) -> Scores:
        held = base if adapter is None else None
        device = held.device if held is not None else pick_device()
        model = held.model() if held is not None else load_base(cfg, model_dir, device, dtype="float32")
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=False).to(device).eval()
        try:
            with forced_routes(model, routes) if routes is not None else contextlib.nullcontext():
                return score_sequences(model, sequences, device, cfg.scoring.batch_size, pack_tokens(cfg, model))
        finally:
            del model
            if held is not None:
                held.settle()
            elif device.type == "cuda":
                torch.cuda.empty_cache()

    return score


def versions() -> dict[str, str]:
    """Package versions that change HF numbers."""
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


class HFTrainer(TrainerBackend):
    """transformers + PEFT LoRA: A seeded (PEFT's init under `torch.manual_seed(seed)`), B zero,
    dropout 0, eval mode; or a user's adapter (`load_start_adapter`)."""

    traits = BackendTraits(start_adapter_unavailable=None, at_checkpoint_precision=True)

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, timings: dict[str, float]) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.device = pick_device()
        start = time.perf_counter()
        base = load_base(cfg, model_dir, self.device)
        torch.manual_seed(seed)
        self.model = peft.get_peft_model(base, peft_config(cfg.adapter)).to(self.device).eval()
        self.pack = pack_tokens(cfg, base)  # tokens per scoring forward (0: `scoring.batch_size` sequences)
        self.graphs = hf_graphs.Graphs(self.model, self.device, dense=not routes_experts(base.config.to_dict()))
        self.start_b: dict[str, torch.Tensor] | None = None
        """The starting adapter's B tensors (`load_start_adapter`); None: zero-init."""
        self.start_a = self._copy_a()
        """Every A at the start point (a step moves A; `zero_b` puts it back)."""
        self.gradients = hf_step.GradientCache()  # the loss's gradient at the start point, per sequences and kind
        self.noise, self.writer = UnitNoise(), AdapterWriter()  # B's draws kept across a search's perturbs; exports
        self._b_lists: dict[tuple[str | None, frozenset[int] | None], list[tuple[str, torch.nn.Parameter]]] = {}
        timings["trainer.load"] = time.perf_counter() - start

    @torch.no_grad()
    def load_start_adapter(self, folder: Path) -> None:
        """Load a PEFT adapter's A and B (safetensors) into the LoRA tensors; every one must be there."""
        from safetensors.torch import load_file

        state = load_file(str(Path(folder) / "adapter_model.safetensors"))
        expected = {n.replace(".default.weight", ".weight") for n, _ in self._named if "lora_" in n}
        if set(state) != expected:
            odd = sorted(set(state) ^ expected)
            raise PhaseError(f"the adapter's tensors do not match its config's LoRA layers ({len(odd)} differ, "
                             f"e.g. {odd[0]})")
        params = dict(self._named)
        for name, tensor in state.items():
            param = params[name.replace(".weight", ".default.weight")]
            if param.shape != tensor.shape:
                raise PhaseError(f"the adapter's {name} has shape {list(tensor.shape)}, the model needs "
                                 f"{list(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        self.start_b = {n: p.detach().clone() for n, p in self._lora_b()}
        self.start_a = self._copy_a()
        self.gradients.clear()  # a new start point

    @functools.cached_property
    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters by name, listed once (fixed after the load; a walk per perturb costs: issue 47)."""
        return list(self.model.named_parameters())

    def _copy_a(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self._named if "lora_A" in n}

    def score(self, sequences: Sequences) -> Scores:
        return score_sequences(self.model, sequences, self.device, self.cfg.scoring.batch_size, self.pack,
                               graphs=self.graphs)

    def settled_settings(self) -> dict[str, str]:
        """`served.SettlingTrainer`: on a GPU, how the scoring forwards ran (`hf_graphs.Graphs.describe`)."""
        used = self.device.type == "cuda" and any(self.graphs.counts.values())
        return {"forward_graphs": self.graphs.describe()} if used else {}

    def score_tempered(self, sequences: Sequences, temperature: float, prompt_lengths: list[int], top_k: int = 0,
                       top_p: float = 1.0) -> Scores:
        """`tempering.TemperingTrainer`."""
        return score_sequences(self.model, sequences, self.device, self.cfg.scoring.batch_size, self.pack,
                               (prompt_lengths, temperature, top_k, top_p))

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """Each token's top-k experts per MoE layer under the current adapter (None: dense model)."""
        return hf_router_topk(self.model, sequences, self.device)

    replay_key = ""
    """A digest of the routes `replaying` forces now ('' : none), so a cached gradient is one of the same routes."""

    def moe_layers(self) -> int:
        return len(routers(self.model))

    def replayed_weights(self) -> str:
        kinds = sorted({f"{type(r).__name__} norm_topk_prob={r.norm_topk_prob}" for r in routers(self.model)})
        return f"{REPLAYED_WEIGHTS}; this model: {', '.join(kinds)}"

    @contextlib.contextmanager
    def replaying(self, routes: RouteTable) -> Iterator[None]:
        """Every forward within routes the tokens of `routes`' sequences as given (`moe.forced_routes`)."""
        self.replay_key = sha256_json(sorted([list(k), v] for k, v in routes.items()))
        try:
            with forced_routes(self.model, routes):
                yield
        finally:
            self.replay_key = ""

    layers_only: frozenset[int] | None = None
    """Per-layer coverage: the perturbation touches these decoder layers only (`restricted_to`)."""

    def layers(self) -> list[int]:
        return layer_subset.layer_indices(n for n, _ in self._lora_b())

    def restricted_to(self, layers: Collection[int]) -> AbstractContextManager[None]:
        return layer_subset.restricted(self, layers)

    def _lora_b(self, only: str | None = None) -> list[tuple[str, torch.nn.Parameter]]:
        """Every LoRA B, or target kind `only`'s (in the layers of `restricted_to` where one is in force); each list
        found once (the parameters are fixed after the load, as `_named`: a search's perturbs walked them each)."""
        key = (only, self.layers_only if only is not None else None)
        if key not in self._b_lists:
            self._b_lists[key] = [(n, p) for n, p in self._named if is_lora_b(n) and (
                only is None or (target_kind(n) == only and layer_subset.keeps(self.layers_only, n)))]
        return self._b_lists[key]

    @torch.no_grad()
    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        trainable = [n for n, p in self._named if p.requires_grad and "lora_" not in n]
        if trainable:
            raise PhaseError(f"refusing to perturb: non-adapter parameter {trainable[0]} is trainable")
        params = self._lora_b(only)
        if not params:
            raise PhaseError(f"no LoRA B tensors{' of ' + only if only else ''} to perturb")
        # One host sync for the check and one copy per device and dtype for the noise: on a GPU shared with
        # other processes every sync waits its turn (per tensor, a calibration's perturbs took 1.6 s each).
        moved = ([(p != self.start_b[name]).any() for name, p in params] if self.start_b is not None else
                 list(torch.stack(torch._foreach_norm([p for _, p in params], float("inf"))).ne(0)))  # fused: issue 47
        if bool(torch.stack(moved).any()):
            name = next(n for (n, _), m in zip(params, moved, strict=True) if bool(m))
            raise PhaseError(f"refusing to perturb: {name} is non-zero before the update "
                             "(relative to the starting adapter's B)")
        add_noise([(p, self.noise.scaled(name, p.shape, seed, std)) for name, p in params])
        return Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=len(params),
                            num_elements=sum(p.numel() for _, p in params), tensors=[n for n, _ in params])

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> Perturbation:
        """One `torch.optim.AdamW` step (betas 0.9/0.999, eps 1e-8, weight decay 0, fresh state) on every
        lora_A and lora_B (or target kind `only`'s), autograd through PEFT, loss = −mean logprob of
        `sequences` (every scored position, one sequence per forward, fp32 log-softmax); dropout is 0. The
        gradient at the start point is computed once per sequences and kind (`hf_step`). Refuses unless every
        LoRA tensor is at the start point, or if a non-adapter parameter is trainable."""
        return hf_step.step(self.model, sequences, learning_rate, seed, only, self.device, self.start_a, self.start_b,
                            self.gradients, self.replay_key)

    @torch.no_grad()
    def zero_b(self) -> None:
        """Every LoRA tensor back to the start point: B to the starting adapter's (zero at zero-init),
        A as initialized or loaded (a step moves it)."""
        b = self._lora_b()  # each kind of write as one fused call (issue 47: a search's perturbs zero B each time)
        if self.start_b is None:
            torch._foreach_zero_([p for _, p in b])
        else:
            torch._foreach_copy_([p for _, p in b], [self.start_b[name] for name, _ in b])
        a = [(p, self.start_a[name]) for name, p in self._named if name in self.start_a]
        torch._foreach_copy_([p for p, _ in a], [start for _, start in a])

    def lora_tensors(self) -> dict[str, RawTensor]:
        """Every lora_A and lora_B parameter as the model holds it, under PEFT's saved name."""
        return to_raw_all((n.replace(".default.weight", ".weight"), p) for n, p in self._named if "lora_" in n)

    def export_adapter(self, directory: Path) -> Path:
        """PEFT's adapter folder, byte for byte (`adapter_export`: PEFT's save at the first, the same files after)."""
        return self.writer.write(self.model, self._named, Path(directory))

    @torch.no_grad()
    def merged_tensors(self) -> dict[str, torch.Tensor]:
        """The base weights with alpha/r·BA merged into every LoRA target, under the base model's HF
        names; the merge is computed in fp32 and cast back. The trainer itself stays unmerged."""
        base = self.model.get_base_model()
        deltas = {f"{name}.base_layer.weight": module.get_delta_weight("default")  # type: ignore[attr-defined]
                  for name, module in base.named_modules()
                  if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.lora_A}
        merged = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            if key in deltas:
                value = (value.float() + deltas[key].float()).to(value.dtype)
            merged[key.replace(".base_layer.", ".")] = value.detach().clone().contiguous()
        return merged

    def export_merged(self, directory: Path) -> Path:
        """Write the merged weights as an HF checkpoint folder (config.json + model.safetensors)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True)
        save_file({k: v.cpu() for k, v in self.merged_tensors().items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copy(self.model_dir / "config.json", directory / "config.json")
        return directory

    def info(self) -> BackendInfo:
        return BackendInfo(backend="hf", versions=versions(), settings={
            "dtype": self.cfg.model.dtype, "device": device_name(self.device), "rank": self.cfg.adapter.rank,
            "alpha": self.cfg.adapter.alpha, "targets": list(self.cfg.adapter.targets), "dropout": 0.0,
            "forward": forward_description(self.cfg, self.pack),
            **({"target_parameters": list(self.cfg.adapter.target_parameters)}
               if self.cfg.adapter.target_parameters else {}),
        })

    def close(self) -> None:
        del self.model


class HFSampler(SamplerBackend):
    """An independent HF + PEFT load that serves adapters by id like an engine: a known id is not
    reloaded unless `inplace`."""

    traits = BackendTraits(at_checkpoint_precision=True)

    def __init__(self, cfg: ModelConfig, model_dir: Path, timings: dict[str, float], lora: bool = True) -> None:
        self.cfg = cfg
        self.device = pick_device()
        start, self.model_dir = time.perf_counter(), Path(model_dir)
        self.model: Any = load_base(cfg, model_dir, self.device)
        self.names: dict[int, str] = {}
        timings["sampler.load"] = time.perf_counter() - start

    @contextlib.contextmanager
    def _serving(self, adapter: AdapterHandle | None) -> Iterator[None]:
        """The model with `adapter` active, or without any (None)."""
        if adapter is not None:
            self.model.set_adapter(self.names[adapter.adapter_id])
            yield
        elif not self.names:
            yield
        else:
            with self.model.disable_adapter():
                yield

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        with self._serving(adapter):
            return score_sequences(self.model, sequences, self.device, self.cfg.scoring.batch_size)

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`score`, and the experts its own forwards routed each token to (`moe.recorded_routes`)."""
        with self._serving(adapter), recorded_routes(self.model) as routes:
            scores = score_sequences(self.model, sequences, self.device, self.cfg.scoring.batch_size)
        return scores, routes

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """One prompt at a time, incremental decoding with a KV cache (see `generate_one`)."""
        with self._serving(adapter):
            pairs = [generate_one(self.model, p, max_tokens, seed + i, self.device) for i, p in enumerate(prompts)]
        return [seq for seq, _ in pairs], [lps for _, lps in pairs]

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """Each token's top-k experts per MoE layer of the base model (None: dense model)."""
        if not self.names:
            return hf_router_topk(self.model, sequences, self.device)
        with self.model.disable_adapter():
            return hf_router_topk(self.model, sequences, self.device)

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        if adapter_id in self.names and not inplace:
            return AdapterHandle(name, adapter_id, Path(directory))
        internal = f"a{adapter_id}_{len(self.names)}_{time.monotonic_ns()}"
        if not self.names:
            self.model = peft.PeftModel.from_pretrained(self.model, str(directory), adapter_name=internal)
        else:
            self.model.load_adapter(str(directory), adapter_name=internal)
        old = self.names.get(adapter_id)
        self.names[adapter_id] = internal
        if old is not None:
            self.model.set_adapter(internal)
            self.model.delete_adapter(old)
        self.model.eval()
        return AdapterHandle(name, adapter_id, Path(directory))

    @torch.no_grad()
    def reload_base(self, folder: Path | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Replace the base weights in place: every one from an HF checkpoint folder, or those given as tensors (a
        bucket of them, `models.buckets`: the rest kept)."""
        if tensors is None:
            from safetensors.torch import load_file

            assert folder is not None
            self.model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
            return
        unknown = self.model.load_state_dict(tensors, strict=False).unexpected_keys
        if unknown:
            raise ScoreError(f"hf sampler: no weight named {unknown[0]!r} to reload")

    def reset_base(self) -> None:
        """Reload the checkpoint's own base weights."""
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        self.model.load_state_dict(tensors, strict=False)

    def retire(self, handle: AdapterHandle) -> None:
        name = self.names.get(handle.adapter_id)
        if name is not None and len(self.names) > 1:
            self.model.set_adapter(next(v for v in self.names.values() if v != name))
            self.model.delete_adapter(name)
            del self.names[handle.adapter_id]

    def info(self) -> BackendInfo:
        return BackendInfo(backend="hf", versions=versions(), settings={
            "dtype": self.cfg.model.dtype, "device": device_name(self.device),
            "forward": forward_description(self.cfg),
        })

    def close(self) -> None:
        del self.model
