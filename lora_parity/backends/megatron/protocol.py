"""The driver ↔ rank 0 protocol, pure (no torch): one JSON line per command and per reply.

The driver writes {"method", "args"} to rank 0's pipe; rank 0 broadcasts it to every rank, every
rank runs it, and rank 0 answers {"ok": result} or {"error": message, "class": name}. A rank
process started with `PIPE_ENV` set is rank 0 of a driven group; `SPAWNED_ENV` marks ranks spawned
on this host (which open their own rendezvous store) rather than started by torchrun.

A rank that stops answering (its node died) is found by heartbeats (`liveness`): after
`RANK_TIMEOUT_ENV` seconds without one, rank 0 answers the driver with an error naming it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from typing import Any

from lora_parity.util import env, errors

PIPE_ENV = "LORA_PARITY_MEGATRON_PIPE"
SPAWNED_ENV = "LORA_PARITY_MEGATRON_SPAWNED"
RANK_MODULE = "lora_parity.backends.megatron.serve"
"""The module each spawned rank process runs (`python -m`)."""
METHODS = ("init", "score", "perturb", "step", "zero_b", "export", "lora_tensors", "load_start_adapter", "replay",
           "router_topk", "close")
CLOSE = b'{"method": "close", "args": {}}\n'
# Rank processes wait for rank 0's next command while the sampler works; a long wait is not an error.
CONTROL_TIMEOUT = dt.timedelta(hours=6)
RANK_TIMEOUT_ENV = "LORA_PARITY_RANK_TIMEOUT"
"""Seconds without a heartbeat after which a rank counts as lost (its node died or hangs)."""
DEFAULT_RANK_TIMEOUT = 60.0
"""Long enough for a rank that is busy (the heartbeat runs in its own thread), short enough not to
leave a run hanging: a lost rank ends the phase within about this many seconds."""


def request(method: str, args: dict[str, Any]) -> bytes:
    """One command line for rank 0."""
    return json.dumps({"method": method, "args": args}).encode() + b"\n"


def error_reply(e: Exception) -> dict[str, Any]:
    """The reply for a command that raised: the project's errors keep their message and class."""
    message = str(e) if isinstance(e, errors.LoraParityError) else f"{type(e).__name__}: {e}"
    return {"error": message, "class": type(e).__name__}


def result(reply: dict[str, Any]) -> Any:
    """A reply's result, or its error raised here (as its own class when it is one of the project's)."""
    if "error" in reply:
        cls = getattr(errors, str(reply.get("class")), None)
        if isinstance(cls, type) and issubclass(cls, errors.LoraParityError):
            raise cls(reply["error"])
        raise errors.PhaseError(f"megatron rank 0: {reply['error']}")
    return reply["ok"]


def is_rank_process(environ: dict[str, str]) -> bool:
    """Whether a process started with `environ` is a trainer rank (not torchrun's rank 0, which runs the CLI)."""
    return bool(environ.get(PIPE_ENV)) or int(environ.get("RANK", "0")) != 0


def rank_timeout(environ: Mapping[str, str]) -> float:
    """`RANK_TIMEOUT_ENV` in seconds (default `DEFAULT_RANK_TIMEOUT`); not a positive number: `ConfigError`."""
    return env.seconds(environ, RANK_TIMEOUT_ENV, DEFAULT_RANK_TIMEOUT)


def lost_error(ranks: list[int], nodes: Mapping[int, str], seconds: float, after_failure: bool) -> dict[str, Any]:
    """The reply that ends the current command when `ranks` stopped sending heartbeats: for
    `seconds` after a collective failed (`after_failure`), or for the whole `RANK_TIMEOUT_ENV`."""
    names = ", ".join(f"rank {r}" + (f" (node {nodes[r]})" if r in nodes else "") for r in ranks)
    why = (f"a collective failed and no heartbeat came in the next {seconds:g} s" if after_failure
           else f"no heartbeat for {seconds:g} s ({RANK_TIMEOUT_ENV})")
    return {"error": f"megatron {names} lost: {why}; its process or node died or hangs", "class": "PhaseError"}
