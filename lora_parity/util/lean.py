"""A run's start made cheaper: optional libraries it never uses are not imported, and the cycle collector
waits while the backends' libraries import and start.

vLLM imports OpenTelemetry at engine import for request tracing, and falls back cleanly when it is
missing (`vllm.tracing.otel` catches the ImportError). lora-parity never traces requests, and the
import (the SDK and its gRPC and HTTP exporters) takes about a second of a run's start on two CPU
cores. Marking it absent in `sys.modules` makes that import fail fast. Anyone who configures tracing
(an OTEL_* variable) keeps it.
"""

from __future__ import annotations

import gc
import os
import sys

SKIPPED = ("opentelemetry",)
NEEDED_BY = {"tinker": ("opentelemetry",)}
"""Backends that import a SKIPPED library themselves (the tinker SDK's HTTP client reports metrics)."""


def skip_unused_imports(*backend_names: str) -> list[str]:
    """Mark the optional libraries in SKIPPED absent for this process, unless an OTEL_* variable is set,
    they are already imported, or one of the run's backends needs them; return the names marked."""
    if any(name.startswith("OTEL_") for name in os.environ):
        return []
    needed = {lib for name in backend_names for lib in NEEDED_BY.get(name, ())}
    marked = [name for name in SKIPPED if name not in sys.modules and name not in needed]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    return marked


_paused = False


def pause_collector() -> None:
    """The cycle collector off until `resume_collector` (the CLI's run and selftest, before any backend import).

    Importing torch, transformers, PEFT and vLLM makes hundreds of thousands of objects, and the collector's
    full collections along the way scan every object made so far: 1.1-1.5 s of a 7-9 s import on two CPU
    cores (issue 47). Those imports leave about 13,000 objects in cycles (12 MB): kept, not freed."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """Once the backends have started: what exists is frozen (never scanned again, as vLLM's engine freezes
    its own heap) and the collector is on again, where `pause_collector` turned it off; else nothing (a
    caller of the Python API keeps its collector as it set it)."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
