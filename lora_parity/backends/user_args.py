"""The user's engine arguments checked for the run's sampler (issue 44): vLLM's (`engine_args`) for vllm and
vllm-server, SGLang's server arguments (`sglang_args`) for sglang; none for another sampler. Pure: no engine import."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.backends import engine_args, sglang_args
from lora_parity.util.errors import ConfigError


def check_for(sampler: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """`args` checked for `sampler` (`engine_args.check` or `sglang_args.check`); any for a sampler without an engine
    to take them is a `ConfigError`."""
    if not args:
        return {}
    if sampler == "sglang":
        return sglang_args.check(args)
    if sampler not in ("vllm", "vllm-server"):
        raise ConfigError(f"engine arguments are the engine's (--sampler vllm, vllm-server or sglang), not "
                          f"{sampler!r}'s")
    return engine_args.check(args)
