"""The references' base model, one load per run (issue 47), and plain LoRA on it.

`ReferenceBase` holds the checkpoint read anew in fp32, apart from the trainer's copy: the fp32 reference scores it
at the start point (`hf.fp32_reference`, without a start adapter), then at each point the trainer moved to
(`fp32_points`), and the exact reference casts its weights to the model's dtype (`exact.exact_points`), where it
would load the checkpoint again. It is kept after the start point only while the device has as much free again as
it holds; otherwise each reference loads its own as before.

`plain_lora` adds a set of the trainer's LoRA tensors to that model without PEFT's modules (PEFT's wrap of 210
layers cost each reference about as much as its forwards on the GPU): a forward hook on each targeted linear
layer adds `lora_B(lora_A(x)) * scaling`, the very operations of PEFT's LoRA linear, so the scores equal a PEFT
wrap's bit for bit; a layer whose B is all zero gets none, as `zero_lora` skips it. Configurations beyond plain
LoRA on `nn.Linear` layers (expert parameters, `all-linear`) keep PEFT's wrap (`plain_targets` answers None).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lora_parity.backends.raw_tensors import views_on
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.util.errors import ConfigError

PREFIX = "base_model.model."
"""PEFT's saved names: this, the layer's path in the causal LM, then `.lora_A.weight` or `.lora_B.weight`."""


class ReferenceBase:
    """The checkpoint in fp32 on `device`, loaded at the first `model()` and kept until `release` (or `settle` finds
    too little free beside it)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path, device: torch.device) -> None:
        self.cfg, self.model_dir, self.device = cfg, Path(model_dir), device
        self._model: Any = None
        self.loads = 0
        """How many times the checkpoint was read (a test's and a reader's count)."""

    @property
    def held(self) -> bool:
        return self._model is not None

    def model(self) -> Any:
        """The fp32 base model (eval mode, no adapter), loaded now if it is not held."""
        if self._model is None:
            from lora_parity.backends.hf import load_base

            self._model = load_base(self.cfg, self.model_dir, self.device, dtype="float32")
            self.loads += 1
        return self._model

    def settle(self) -> None:
        """After the start point: keep the model for the later points only where as much again is free."""
        if self._model is not None and free_bytes(self.device) < model_bytes(self._model):
            self.release()

    def release(self) -> None:
        if self._model is None:
            return
        self._model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_bytes(device: torch.device) -> int:
    """Free memory where `device` keeps tensors: the GPU's, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_host_bytes()


def available_host_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plain_targets(cfg: ModelConfig, model: Any) -> dict[str, torch.nn.Linear] | None:
    """The layers PEFT's config for `cfg.adapter` targets in `model` (a causal LM), by path, where every one is a plain
    `nn.Linear` and nothing else is targeted; None where PEFT's own wrap is needed."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from lora_parity.models.adapter_spec import peft_config

    spec = cfg.adapter
    if spec.target_parameters or "all-linear" in spec.targets:
        return None
    config = peft_config(spec)
    out: dict[str, torch.nn.Linear] = {}
    for name, module in model.named_modules():
        if name and check_target_module_exists(config, name):
            if type(module) is not torch.nn.Linear:
                return None
            out[name] = module
    return out or None


def scaling(cfg: ModelConfig) -> float:
    """alpha / r, PEFT's scaling for the config's adapter (no rsLoRA)."""
    return cfg.adapter.alpha / cfg.adapter.rank


Pairs = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""One point's LoRA tensors: (A, B) by target layer path (`lora_pairs`)."""


def lora_pairs(state: Mapping[str, RawTensor], targets: Mapping[str, torch.nn.Linear], what: str,
               device: torch.device, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of each target layer from the trainer's tensors `state` (PEFT's saved names), on `device` in `dtype`,
    in one transfer and one cast per stored dtype (views of it); a missing tensor or one of another shape than the
    layer needs is refused."""
    names: dict[str, tuple[int, ...]] = {}
    for path, layer in targets.items():
        names[f"{PREFIX}{path}.lora_A.weight"] = (-1, layer.in_features)
        names[f"{PREFIX}{path}.lora_B.weight"] = (layer.out_features, -1)
    rank = None
    for name, (rows, cols) in names.items():
        if name not in state:
            raise ConfigError(f"{what}: the trainer's tensors have no {name}")
        shape = list(state[name][1])
        rank = rank or (shape[0] if rows == -1 else shape[-1])
        want = [rank, cols] if rows == -1 else [rows, rank]
        if shape != want:
            raise ConfigError(f"{what}: {name} is {shape}, expected {want}")
    params = views_on(state, list(names), device, dtype)
    return {path: (params[f"{PREFIX}{path}.lora_A.weight"], params[f"{PREFIX}{path}.lora_B.weight"])
            for path in targets}


def nonzero_b(points: Sequence[Pairs], paths: list[str]) -> list[list[bool]]:
    """For each point, whether each layer's B (of `paths`) holds a non-zero: each tensor's max |x| (no squares to
    underflow; a NaN is not zero), all points' in one host sync."""
    if not paths or not points:
        return [[] for _ in points]
    norms = torch._foreach_norm([point[p][1] for point in points for p in paths], float("inf"))
    flat = torch.stack(list(norms)).ne(0).tolist()
    return [flat[i * len(paths):(i + 1) * len(paths)] for i in range(len(points))]


@contextlib.contextmanager
def plain_lora(targets: Mapping[str, torch.nn.Linear], points: Sequence[Pairs], scale: float,
               rows: int = 0) -> Iterator[int]:
    """Within: each target layer adds `lora_B(lora_A(x)) * scale` to its output, as PEFT's LoRA linear does, for each
    of `points` (sets of LoRA tensors): one point to the whole batch, several each to its own `rows` rows of it, in
    order. Not where B is all zero (every point's checked in one host sync); yields how many (layer, point) pairs
    carry one. The hooks go on exit."""
    paths = list(targets)
    if not paths or not points:
        yield 0
        return
    nonzero = nonzero_b(points, paths)
    handles, count = [], 0
    try:
        for j, path in enumerate(paths):
            live = [(i, *point[path]) for i, point in enumerate(points) if nonzero[i][j]]
            if live:
                count += len(live)
                handles.append(targets[path].register_forward_hook(_adds(live, scale, rows if len(points) > 1 else 0)))
        yield count
    finally:
        for handle in handles:
            handle.remove()


def _adds(live: list[tuple[int, torch.Tensor, torch.Tensor]], scale: float, rows: int) -> Any:
    def hook(module: Any, args: tuple[Any, ...], result: torch.Tensor) -> torch.Tensor:
        if not rows:
            ((_, a, b),) = live
            return result + F.linear(F.linear(args[0], a), b) * scale
        for i, a, b in live:  # each point's rows alone: its LoRA's matmuls as one point's forward makes them
            part = slice(i * rows, (i + 1) * rows)
            result[part] = result[part] + F.linear(F.linear(args[0][part], a), b) * scale
        return result

    return hook
