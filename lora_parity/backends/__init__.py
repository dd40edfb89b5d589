"""backends: the trainers and samplers (hf, exact, vllm, vllm-server, sglang, megatron, tinker, fake), each
registered by name as "module:Class" and imported only when asked for (torch and vLLM live here).
May import util/, evidence/ and models/ only; never run/, verdict/, report/ or cli/.

A new backend registers with `register("trainer" | "sampler", name, "module:Class")` (or the class
itself); its class derives from `base.TrainerBackend` or `base.SamplerBackend`. An installed package
registers one without editing lora-parity: an entry point `NAME = "module:Class"` in the group
`lora_parity.trainers` or `lora_parity.samplers` (`PLUGIN_GROUPS`), looked up only for a name that is not
built in or registered, and imported only when that backend is resolved (docs/api.md, "Plugins").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal, overload

from lora_parity.backends.base import SamplerBackend, TrainerBackend
from lora_parity.evidence.tracebacks import one_line
from lora_parity.util import threads
from lora_parity.util.errors import BackendUnavailableError, ConfigError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoints

Kind = Literal["trainer", "sampler"]

TRAINERS: dict[str, object] = {
    "hf": "lora_parity.backends.hf:HFTrainer",
    "fake": "lora_parity.backends.fake:FakeTrainer",
    "tinker": "lora_parity.backends.tinker:TinkerTrainer",
    "megatron": "lora_parity.backends.megatron.trainer:MegatronTrainer",
    "exact": "lora_parity.backends.exact:ExactTrainer",
}
SAMPLERS: dict[str, object] = {
    "vllm": "lora_parity.backends.vllm:VLLMSampler",
    "vllm-server": "lora_parity.backends.vllm_server:VLLMServerSampler",
    "sglang": "lora_parity.backends.sglang:SGLangSampler",
    "hf": "lora_parity.backends.hf:HFSampler",
    "fake": "lora_parity.backends.fake:FakeSampler",
    "tinker": "lora_parity.backends.tinker:TinkerSampler",
}
MIRRORS = {"exact": "vllm"}
"""Trainers that compute what one sampler computes, as a LoRA (`--trainer exact`: vLLM's own operations): with
another sampler or a merged sync mode they are refused by name, before any import."""
PAIRED = frozenset({"tinker"})
"""Backends that are both roles of one service: named for one role, they must be named for the other
too (checked by name, before any import)."""
# The pip extra that provides each backend's packages.
VLLM_EXTRA = "cpu' (vLLM's CPU build) or 'lora-parity[gpu]"
EXTRAS: dict[str, str] = {"hf": "hf", "vllm": VLLM_EXTRA, "vllm-server": VLLM_EXTRA, "tinker": "tinker",
                         "megatron": "megatron",
                         "exact": "gpu"}


PLUGIN_GROUPS: dict[Kind, str] = {"trainer": "lora_parity.trainers", "sampler": "lora_parity.samplers"}
"""The entry-point groups an installed package registers backends in: entry name = backend name, value =
"module:Class" (`[project.entry-points."lora_parity.trainers"]` in its pyproject.toml)."""
PLUGINS: dict[str, str] = {}
"""'kind:name' -> the distribution that provides it ("name version"), for each plugin looked up so far."""


def _table(kind: Kind) -> dict[str, object]:
    return TRAINERS if kind == "trainer" else SAMPLERS


def register(kind: Kind, name: str, target: object, extra: str | None = None) -> None:
    """Register a backend under `name`: `target` is "module:Class" (imported when first resolved) or
    the class itself; `extra` names the pip extra that provides its packages."""
    _table(kind)[name] = target
    PLUGINS.pop(f"{kind}:{name}", None)
    if extra is not None:
        EXTRAS[name] = extra


def _entry_points(kind: Kind) -> EntryPoints:
    from importlib import metadata  # only for a name that is not built in: `--help` never scans the installed packages

    return metadata.entry_points(group=PLUGIN_GROUPS[kind])


def find(kind: Kind, name: str) -> bool:
    """Whether `name` is a `kind` backend: built in or registered, else an installed plugin's entry point in
    `PLUGIN_GROUPS[kind]`, which is then registered as its "module:Class" (nothing is imported here)."""
    if name in _table(kind):
        return True
    for entry in _entry_points(kind).select(name=name):
        register(kind, name, entry.value)
        dist = entry.dist
        PLUGINS[f"{kind}:{name}"] = f"{dist.name} {dist.version}" if dist is not None else "an unnamed distribution"
        return True
    return False


def require_known(kind: Kind, name: str) -> None:
    """`ConfigError` unless `find(kind, name)`; the message names every built-in and installed choice."""
    if not find(kind, name):
        choices = sorted({*_table(kind), *(entry.name for entry in _entry_points(kind))})
        raise ConfigError(f"unknown {kind} backend {name!r}; choose from {', '.join(choices)}")


def _import_target(kind: Kind, name: str, target: str) -> object:
    """The class `target` ("module:Class") names; a built-in backend's missing package names its pip extra, a
    plugin that fails to import (for any reason) is one line naming the plugin and its distribution."""
    module_name, _, qualname = target.partition(":")
    threads.set_wait_policy()  # before the backend's libraries load their OpenMP runtime
    plugin = PLUGINS.get(f"{kind}:{name}")
    try:
        return getattr(importlib.import_module(module_name), qualname)
    except ImportError as e:
        if plugin is None:
            extra = EXTRAS.get(name, name)
            raise BackendUnavailableError(
                f"{kind} backend {name!r} needs {e.name or 'a missing package'}: pip install 'lora-parity[{extra}]'"
            ) from None
        raise ConfigError(f"{kind} plugin {name!r} ({plugin}) failed to import {target}: {one_line(e)}") from None
    except Exception as e:  # a plugin's module that raises while it is imported, or lacks the class
        if plugin is None:  # a built-in's: a bug, with its traceback
            raise
        raise ConfigError(f"{kind} plugin {name!r} ({plugin}) failed to import {target}: {one_line(e)}") from None


@overload
def resolve(kind: Literal["trainer"], name: str) -> type[TrainerBackend]: ...
@overload
def resolve(kind: Literal["sampler"], name: str) -> type[SamplerBackend]: ...
def resolve(kind: Kind, name: str) -> type[TrainerBackend] | type[SamplerBackend]:
    """The backend class registered as `name` for `kind` ('trainer' or 'sampler'), or an installed plugin's."""
    require_known(kind, name)
    target = _table(kind)[name]
    cls = _import_target(kind, name, target) if isinstance(target, str) else target
    base = TrainerBackend if kind == "trainer" else SamplerBackend
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{kind} backend {name!r} is not a {base.__name__} subclass")
    return cls
