"""YAML as a config is read: the safe loader, less what a stranger's file can abuse. Aliases are refused before
anything is built (a few KB of nested aliases expand to billions of nodes: "billion laughs"), and so are
duplicate keys (the later one would silently win)."""

from __future__ import annotations

from typing import Any

import yaml

from lora_parity.util.errors import ConfigError


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases while composing (before any node is expanded) and duplicate keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise _Refused("aliases (*name) are refused", self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise _Refused(f"duplicate key {key!r}", key_node.start_mark)
                    seen.add(key)
        return super().construct_mapping(node, deep)


def load(text: str, label: str) -> Any:
    """The YAML document `text` (named `label` in errors) as Python data; ConfigError in one line naming the
    line where it is malformed, or where an alias or a duplicate key was refused."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except (yaml.YAMLError, RecursionError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = f": {e.problem}" if isinstance(e, _Refused) else ""
        raise ConfigError(f"{label}: malformed YAML{where}{problem}") from None
