"""The base weights reloaded in place into a vLLM engine whose layers LoRA wraps.

With LoRA on, vLLM replaces each linear layer it can adapt by a `BaseLayerWithLoRA` that holds the original as
`base_layer`, so `q_proj.weight` of the checkpoint lives at `qkv_proj.base_layer.weight` in the engine. Up to vLLM
0.26 the wrapper has no `load_weights` of its own, and `reload_weights` from the checkpoint fails on the first wrapped
layer ("There is no module or parameter named 'layers.0.mlp.down_proj.weight'"; vllm #39934, measured on vLLM 0.26:
BENCHMARKS.md, sixteenth session); a level-2 sleep, which discards the weights, then cannot be undone. vLLM 0.32's
wrapper forwards `load_weights` to its `base_layer` and needs nothing. Where it is needed, the checkpoint's names are
reconciled to the live model as RL stacks do it on those versions (verl #7327, #7376): one `.base_layer` segment
inserted for each name whose layer (or the packed layer it is stacked into, `packed_modules_mapping`) is wrapped,
every other name as it is, then the engine's own `reload_weights` from that iterator (its stacking, sharding and
post-processing unchanged).

`reload_from_folder` runs in the engine's worker (`LLM.collective_rpc` with a callable; a server's `/collective_rpc`
takes a worker method's name instead, which `WorkerExtension` gives it); the naming is plain functions, tested on the
CPU."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

BASE = "base_layer"


def wrapped_layers(module_names: Iterable[str]) -> set[str]:
    """The qualified names of the layers that hold a `base_layer` child (LoRA-wrapped), from `named_modules()`."""
    suffix = f".{BASE}"
    return {name[: -len(suffix)] for name in module_names if name.endswith(suffix)}


def reconcile(name: str, wrapped: set[str], packed: Mapping[str, Sequence[str]]) -> str:
    """A checkpoint name as the LoRA-wrapped engine holds it: `<layer>.base_layer.<param>` where `<layer>`, or the
    packed layer its last segment is stacked into (q_proj -> qkv_proj), is wrapped; else unchanged."""
    layer, _, param = name.rpartition(".")
    parent, _, leaf = layer.rpartition(".")
    if not layer or BASE in layer.split("."):
        return name
    into = [leaf] + [packed_name for packed_name, parts in packed.items() if leaf in parts]
    if any((f"{parent}.{candidate}" if parent else candidate) in wrapped for candidate in into):
        return f"{layer}.{BASE}.{param}"
    return name


def wrapper_loads_weights() -> bool:
    """Whether vLLM's LoRA wrapper loads its `base_layer`'s weights itself (vLLM 0.32; not up to 0.26)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    return callable(getattr(BaseLayerWithLoRA, "load_weights", None))


def checkpoint_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint's safetensors files, name by name (never a pickle)."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def reload_from_folder(worker: Any, folder: str) -> str:
    """In the engine's worker: reload the base weights from the checkpoint `folder` in place, by the engine's own
    route where it can, else with the names reconciled to its LoRA-wrapped layers. Returns the route taken."""
    model = worker.model_runner.get_model()
    wrapped = wrapped_layers(name for name, _ in model.named_modules())
    if not wrapped or wrapper_loads_weights():
        worker.reload_weights(weights_path=folder)
        return "reload_weights"
    packed = getattr(model, "packed_modules_mapping", None) or {}
    weights = ((reconcile(name, wrapped, packed), tensor) for name, tensor in checkpoint_tensors(Path(folder)))
    worker.reload_weights(weights_iterator=weights)
    return "reload_weights, names reconciled to the LoRA-wrapped layers (.base_layer)"


class WorkerExtension:
    """Mixed into vLLM's worker class by a server started with `--worker-extension-cls` (`backends.vllm_server_state`):
    over HTTP `/collective_rpc` calls a worker method by its name with string arguments only, so the in-process
    sampler's callable cannot cross; this method is its name. vLLM adds the class to the worker's bases, so `self` is
    the worker."""

    def lora_parity_reload_from_folder(self, folder: str) -> str:
        """`reload_from_folder` on this worker, from the checkpoint `folder`: the route taken."""
        return reload_from_folder(self, folder)
