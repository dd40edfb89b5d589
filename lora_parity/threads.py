"""OpenMP's wait policy, set before a backend's libraries load their OpenMP runtime.

torch on the CPU (the HF trainer, and vLLM's CPU build in the same process) runs each op on an
OpenMP team of one thread per core. By default a thread that reaches a barrier first spins for a
while before it sleeps. On a machine whose cores other processes also use, the thread it waits for
is often descheduled, and the spinning takes the very core that thread needs: each of the thousands
of barriers in a forward pass then costs a scheduler time slice. Measured on the 2-core development
machine (SmolLM2-135M fp32, HF+PEFT, the two probe sequences of one scoring pass, one other process
busy): 5 to 30 s a pass with the default, 1.2 s with `OMP_WAIT_POLICY=PASSIVE` (0.5 s on the idle
machine). PASSIVE makes waiting threads sleep at once; the numbers computed do not change, only how
idle threads wait. A value the user set wins (`OMP_WAIT_POLICY=ACTIVE` restores spinning).
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "PASSIVE"
"""The OpenMP wait policy set unless the user chose one."""


def set_wait_policy() -> str | None:
    """Set `OMP_WAIT_POLICY` to WAIT_POLICY unless it is set already; the policy that applies, or
    None when torch is already imported (its OpenMP runtime read the environment when it loaded, so a
    value set now would not apply and is not set)."""
    if "torch" in sys.modules:
        return None
    return os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
