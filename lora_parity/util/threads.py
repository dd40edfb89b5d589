"""OpenMP's wait policy, chosen before a backend's libraries load their OpenMP runtime.

torch on the CPU (the HF trainer, and vLLM's CPU build in the same process) runs each op on an
OpenMP team of one thread per core. By default a thread that reaches a barrier first spins for a
while before it sleeps. On a machine whose cores other processes also use, the thread it waits for
is often descheduled, and the spinning takes the very core that thread needs: each of the hundreds
of barriers in a forward pass then costs a scheduler time slice. Measured on the 2-core development
machine (SmolLM2-135M fp32, HF+PEFT, the two probe sequences of one scoring pass): with one other
process busy, 5 to 30 s a pass spinning, 1.2 s with `OMP_WAIT_POLICY=PASSIVE` (threads sleep at
once); on the idle machine 0.47 s spinning, about 0.6 s passive (every barrier then pays a wake-up).

So the policy follows the machine at start: PASSIVE when other processes keep its cores busy (on
average at least BUSY_THREADS runnable threads besides this one, sampled from /proc/loadavg before
torch loads), OpenMP's default otherwise. The numbers computed do not change, only how idle threads
wait. A value the user set wins (`OMP_WAIT_POLICY=ACTIVE` or `PASSIVE` forces one).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

WAIT_POLICY = "PASSIVE"
"""The OpenMP wait policy set on a busy machine unless the user chose one."""
BUSY_THREADS = 0.5
"""Mean number of other runnable threads from which the machine counts as busy."""
SAMPLES = 5
"""Samples of /proc/loadavg's runnable count ..."""
INTERVAL_S = 0.01
"""... this far apart."""


def _runnable() -> int | None:
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def other_runnable(read: Callable[[], int | None] = _runnable, samples: int = SAMPLES,
                   interval: float = INTERVAL_S) -> float | None:
    """Mean number of runnable threads besides the one reading (the kernel's count in /proc/loadavg,
    sampled `samples` times); None where it cannot be read (not Linux)."""
    counts: list[int] = []
    for i in range(samples):
        count = read()
        if count is None:
            return None
        counts.append(count - 1)
        if i < samples - 1:
            time.sleep(interval)
    return sum(counts) / len(counts)


def set_wait_policy(busy: Callable[[], float | None] | None = None) -> str | None:
    """Choose `OMP_WAIT_POLICY` before torch loads: the user's value if set, else WAIT_POLICY when
    `busy()` (other runnable threads; default `other_runnable`) is at least BUSY_THREADS. Returns the
    policy set, or None for OpenMP's default, or when torch is already imported (its OpenMP runtime
    read the environment when it loaded: a value set now would not apply, so none is set)."""
    if "torch" in sys.modules:
        return None
    if "OMP_WAIT_POLICY" in os.environ:
        return os.environ["OMP_WAIT_POLICY"]
    others = (busy or other_runnable)()
    if others is None or others < BUSY_THREADS:
        return None
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return WAIT_POLICY
