"""Numbers read from the environment: a bad value is one line naming the variable, never a traceback."""

from __future__ import annotations

import math
from collections.abc import Mapping

from lora_parity.util.errors import ConfigError


def seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """Variable `name` of `environ` as a positive, finite number of seconds (unset or blank: `default`)."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={raw[:40]!r}: not a positive number of seconds")
    return value
