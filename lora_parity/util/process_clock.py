"""How long this process has been running (Linux `/proc`), for the receipt's timings: where a run's wall time goes
before the run starts (interpreter start, the CLI's imports) and after it ends (exit, teardown) is the wall time less
what the run itself timed (issue 47, `make bench`)."""

from __future__ import annotations

import os
from pathlib import Path


def age() -> float | None:
    """Seconds since this process started (10 ms resolution), or None where `/proc` cannot tell."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)


def stamp(key: str) -> dict[str, float]:
    """`{key: age()}`, or nothing where the age cannot be told (for a receipt's timings)."""
    now = age()
    return {} if now is None else {key: now}
