"""`KEY=VALUE` options over a config section (`--sampling`, `--loop`): parsed, then merged over the section and
validated by its pydantic model, every error one line. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from lora_parity.util.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def parse(items: Iterable[str], option: str, keys: str) -> dict[str, Any]:
    """`KEY=VALUE` strings as a mapping (values checked by `merged`); a malformed item is a `ConfigError` naming
    `option` and its `keys`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ConfigError(f"{option} {item!r}: expected KEY=VALUE ({keys})")
        out[key] = value.strip()
    return out


def merged(spec: M, given: Mapping[str, Any], option: str) -> M:
    """`spec` with `given` over it, validated by its model; an unknown key or a bad value is a one-line
    `ConfigError`."""
    if not given:
        return spec
    try:
        return type(spec).model_validate({**spec.model_dump(), **given})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or option.lstrip("-")
        raise ConfigError(f"{option} {where}: {err['msg']}") from None
