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


def skip_unused_imports() -> list[str]:
    """Mark the optional libraries in SKIPPED absent for this process, unless an OTEL_* variable is set or
    they are already imported; return the names marked."""
    if any(name.startswith("OTEL_") for name in os.environ):
        return []
    marked = [name for name in SKIPPED if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    return marked
