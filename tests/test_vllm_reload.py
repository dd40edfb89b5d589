"""The base reloaded into a LoRA-wrapped vLLM engine (backends.vllm_reload): the checkpoint's names reconciled to the
wrapped layers where the engine's wrapper loads nothing itself (vLLM 0.26, vllm #39934), the engine's own route
elsewhere. A torch stand-in of vLLM 0.26's module tree and name resolution shows the failure and the fix; the CPU
engine (vLLM 0.32) takes its own route, which the merged-mode tests run end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lora_parity.backends import vllm_reload

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}


class Wrapped(nn.Module):
    """vLLM 0.26's BaseLayerWithLoRA as far as names go: the original layer one level down, no load_weights."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.base_layer = inner


def engine_model(wrap: set[str]) -> nn.Module:
    """One decoder layer named as vLLM's Llama (packed qkv_proj and gate_up_proj), the layers in `wrap` wrapped."""
    def layer(name: str, n_in: int, n_out: int) -> nn.Module:
        inner = nn.Linear(n_in, n_out, bias=False)
        return Wrapped(inner) if name in wrap else inner

    block = nn.Module()
    block.self_attn = nn.Module()
    block.self_attn.qkv_proj = layer("qkv_proj", 4, 12)
    block.self_attn.o_proj = layer("o_proj", 4, 4)
    block.mlp = nn.Module()
    block.mlp.gate_up_proj = layer("gate_up_proj", 4, 16)
    block.mlp.down_proj = layer("down_proj", 8, 4)
    block.input_layernorm = nn.LayerNorm(4)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([block])
    model.packed_modules_mapping = PACKED
    return model


def load_as_vllm_026(model: nn.Module, weights: Any) -> set[str]:
    """vLLM 0.26's loading as far as names go: the stacked names mapped by substring (q_proj -> qkv_proj), then
    every name must be a parameter of the live tree (AutoWeightsLoader: 'There is no module or parameter named')."""
    loaded = set()
    for name, _ in weights:
        for old, new in STACKED.items():
            name = name.replace(old, new)
        try:
            model.get_parameter(name)
        except AttributeError as e:
            raise ValueError(f"There is no module or parameter named {name!r}") from e
        loaded.add(name)
    return loaded


CHECKPOINT = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.0.input_layernorm.bias"]


def test_plain_names_fail_on_wrapped_layers_and_reconciled_names_load_every_parameter() -> None:
    model = engine_model({"qkv_proj", "down_proj"})
    with pytest.raises(ValueError, match=r"qkv_proj\.weight"):  # the failure measured on vLLM 0.26 (sixteenth session)
        load_as_vllm_026(model, [(n, None) for n in CHECKPOINT])
    wrapped = vllm_reload.wrapped_layers(n for n, _ in model.named_modules())
    assert wrapped == {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"}
    names = [vllm_reload.reconcile(n, wrapped, PACKED) for n in CHECKPOINT]
    assert names[0] == "model.layers.0.self_attn.q_proj.base_layer.weight"  # stacked into a wrapped layer
    assert names[3] == "model.layers.0.self_attn.o_proj.weight"  # not wrapped: as it is
    assert names[6] == "model.layers.0.mlp.down_proj.base_layer.weight"
    assert names[7:] == CHECKPOINT[7:]  # a norm: never touched
    assert load_as_vllm_026(model, [(n, None) for n in names]) == {n for n, _ in model.named_parameters()}


def test_reconcile_leaves_names_already_reconciled_and_top_level_names() -> None:
    wrapped = {"lm_head", "model.layers.0.mlp.down_proj"}
    assert vllm_reload.reconcile("lm_head.weight", wrapped, PACKED) == "lm_head.base_layer.weight"
    assert vllm_reload.reconcile("lm_head.weight", set(), PACKED) == "lm_head.weight"
    done = "model.layers.0.mlp.down_proj.base_layer.weight"
    assert vllm_reload.reconcile(done, wrapped, PACKED) == done
    assert vllm_reload.reconcile("scale", wrapped, PACKED) == "scale"


class Worker:
    """A stand-in engine worker: its model, and what `reload_weights` was called with."""

    def __init__(self, model: nn.Module) -> None:
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model})()
        self.model = model
        self.calls: list[dict[str, Any]] = []

    def reload_weights(self, **kwargs: Any) -> None:
        if "weights_iterator" in kwargs:
            kwargs["weights_iterator"] = load_as_vllm_026(self.model, kwargs["weights_iterator"])
        self.calls.append(kwargs)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({n: torch.zeros(2) for n in CHECKPOINT}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_reload_from_folder_reconciles_only_where_the_wrapper_loads_nothing(checkpoint: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.layers import BaseLayerWithLoRA

    worker = Worker(engine_model({"qkv_proj", "gate_up_proj", "down_proj", "o_proj"}))
    # vLLM 0.32 (installed): its wrapper loads weights itself, so the engine's own route, from the folder
    assert callable(getattr(BaseLayerWithLoRA, "load_weights", None))
    assert vllm_reload.reload_from_folder(worker, str(checkpoint)) == "reload_weights"
    assert worker.calls == [{"weights_path": str(checkpoint)}]
    # vLLM 0.26's wrapper had none: the checkpoint's tensors with reconciled names, every parameter loaded
    monkeypatch.delattr(BaseLayerWithLoRA, "load_weights")
    route = vllm_reload.reload_from_folder(worker, str(checkpoint))
    assert "reconciled" in route
    assert worker.calls[-1]["weights_iterator"] == {n for n, _ in worker.model.named_parameters()}
    # no layer wrapped (LoRA off, the merged modes): the engine's own route
    plain = Worker(engine_model(set()))
    assert vllm_reload.reload_from_folder(plain, str(checkpoint)) == "reload_weights"


def test_the_worker_extension_is_found_by_its_name_and_reloads_the_worker_it_is_mixed_into(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started to sleep names `vllm_server_state.EXTENSION`; vLLM resolves it and adds it to its worker's
    bases (`WorkerWrapperBase.init_worker`, which refuses one whose attribute the worker already has), and
    `/collective_rpc` calls its method by name on that worker."""
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from lora_parity.backends.vllm_server_state import EXTENSION, RELOAD_METHOD

    extension = resolve_obj_by_qualname(EXTENSION)
    assert extension is vllm_reload.WorkerExtension
    assert [a for a in dir(extension) if not a.startswith("__")] == [RELOAD_METHOD]

    class Engine(Worker):  # vLLM's worker class, before the extension is mixed in
        pass

    Engine.__bases__ = (*Engine.__bases__, extension)
    worker = Engine(engine_model({"qkv_proj", "gate_up_proj", "down_proj", "o_proj"}))
    monkeypatch.delattr(BaseLayerWithLoRA, "load_weights")  # vLLM 0.26's wrapper, which loads nothing itself
    route = getattr(worker, RELOAD_METHOD)(str(checkpoint))  # as vLLM's collective_rpc runs a method by name
    assert "reconciled" in route
    assert worker.calls[-1]["weights_iterator"] == {n for n, _ in worker.model.named_parameters()}
