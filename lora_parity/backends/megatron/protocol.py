"""The driver ↔ rank 0 protocol, pure (no torch): one JSON line per command and per reply.

The driver writes {"method", "args"} to rank 0's pipe; rank 0 broadcasts it to every rank, every
rank runs it, and rank 0 answers {"ok": result} or {"error": message, "class": name}. A rank
process started with `PIPE_ENV` set is rank 0 of a driven group; `SPAWNED_ENV` marks ranks spawned
on this host (which open their own rendezvous store) rather than started by torchrun.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from lora_parity import errors

PIPE_ENV = "LORA_PARITY_MEGATRON_PIPE"
SPAWNED_ENV = "LORA_PARITY_MEGATRON_SPAWNED"
RANK_MODULE = "lora_parity.backends.megatron.serve"
"""The module each spawned rank process runs (`python -m`)."""
METHODS = ("init", "score", "perturb", "zero_b", "export", "close")
CLOSE = b'{"method": "close", "args": {}}\n'
# Rank processes wait for rank 0's next command while the sampler works; a long wait is not an error.
CONTROL_TIMEOUT = dt.timedelta(hours=6)


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
