"""Keep optional libraries that a run never uses from being imported.

vLLM imports OpenTelemetry at engine import for request tracing, and falls back cleanly when it is
missing (`vllm.tracing.otel` catches the ImportError). lora-parity never traces requests, and the
import (the SDK and its gRPC and HTTP exporters) takes about a second of a run's start on two CPU
cores. Marking it absent in `sys.modules` makes that import fail fast. Anyone who configures tracing
(an OTEL_* variable) keeps it.
"""

from __future__ import annotations

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
