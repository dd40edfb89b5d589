"""stacks: RL frameworks checked through their own sync and engine (`trl`), each a `Stack` found by name (`--stack`):
built in, or an installed plugin's entry point in the group `lora_parity.stacks`, imported only when resolved.
May import util/, evidence/, verdict/, models/, backends/, run/ and api/; nothing but cli/ may import it.

A stack plugin wraps a framework's trainer, engine and sync as `lora_parity.api`'s protocols and runs
`lora_parity.api.check` inside the framework's own training script (a callback), where its objects live. Its
`Stack` record says what it needs and where its Python API is; `lora-parity run --stack NAME` refuses, in one
line naming those, where the stack cannot run from the command line (none can yet: docs/trl.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lora_parity.evidence.tracebacks import one_line
from lora_parity.util.errors import ConfigError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoints

PLUGIN_GROUP = "lora_parity.stacks"
"""The entry-point group an installed package registers a stack in: entry name = stack name, value =
"module:attribute" naming its `Stack` (`[project.entry-points."lora_parity.stacks"]` in its pyproject.toml)."""
STACKS: dict[str, str] = {"trl": "lora_parity.stacks.trl:STACK"}
"""Built-in stacks: name -> "module:attribute" of its `Stack` (the module imports no framework)."""
PLUGINS: dict[str, str] = {}
"""Stack name -> the distribution that provides it ("name version"), for each plugin looked up so far."""


@dataclass(frozen=True)
class Stack:
    """What a stack plugin is: its name, what it checks, what it needs to run, and its Python API."""

    name: str
    summary: str
    """One line: the framework objects it checks, through what."""
    needs: str
    """What it needs to run (hardware, the framework's pip extra)."""
    api: str
    """Where its Python API is (module, names, doc page)."""
    extra: str | None = None
    """The pip extra that installs the framework, if lora-parity ships one."""

    def refusal(self) -> str:
        """Why `lora-parity run --stack NAME` does not run it: one line, naming what it needs and its API."""
        return (f"--stack {self.name}: {self.summary}; it runs inside your training script, not from "
                f"`lora-parity run`: it needs {self.needs}; use {self.api}")


def _entry_points() -> EntryPoints:
    from importlib import metadata  # only for a name that is not built in: `--help` never scans installed packages

    return metadata.entry_points(group=PLUGIN_GROUP)


def find(name: str) -> bool:
    """Whether `name` is a stack: built in, else an installed plugin's entry point (then registered by its
    "module:attribute"; nothing is imported here)."""
    if name in STACKS:
        return True
    for entry in _entry_points().select(name=name):
        STACKS[name] = entry.value
        dist = entry.dist
        PLUGINS[name] = f"{dist.name} {dist.version}" if dist is not None else "an unnamed distribution"
        return True
    return False


def resolve(name: str) -> Stack:
    """The `Stack` registered as `name`; `ConfigError` (one line) for an unknown name (listing the built-in and
    installed ones) or a plugin that fails to import or names no `Stack`."""
    if not find(name):
        choices = sorted({*STACKS, *(entry.name for entry in _entry_points())})
        raise ConfigError(f"unknown stack {name!r}; choose from {', '.join(choices)}")
    module_name, _, attribute = STACKS[name].partition(":")
    where = f"stack plugin {name!r} ({PLUGINS[name]})" if name in PLUGINS else f"stack {name!r}"
    try:
        stack = getattr(importlib.import_module(module_name), attribute)
    except Exception as e:  # a plugin that is broken or missing a dependency: one line, never a traceback
        raise ConfigError(f"{where} failed to import {STACKS[name]}: {one_line(e)}") from None
    if not isinstance(stack, Stack):
        raise ConfigError(f"{where}: {STACKS[name]} is a {type(stack).__name__}, not a lora_parity.stacks.Stack")
    return stack


def refuse_cli(name: str) -> None:
    """`lora-parity run --stack NAME`: no stack runs from the command line yet, so `ConfigError` with its refusal
    line (or the unknown-name line)."""
    raise ConfigError(resolve(name).refusal())
