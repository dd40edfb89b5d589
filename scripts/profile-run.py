"""`lora-parity` under cProfile (issue 47's where-does-the-time-go), kept through the CLI's fast exit: the CLI leaves
with `os._exit` after a run (cli/app.py, `_exit_fast`), which skips cProfile's own dump, so the dump is taken there.

    python scripts/profile-run.py OUT.prof run --model ... --out r.json
"""

from __future__ import annotations

import cProfile
import os
import runpy
import sys

profile, out = cProfile.Profile(), sys.argv[1]
leave = os._exit


def _dump_and_leave(code: int) -> None:
    profile.disable()
    profile.dump_stats(out)
    leave(code)


os._exit = _dump_and_leave  # type: ignore[assignment]
sys.argv = ["lora-parity", *sys.argv[2:]]
profile.enable()
try:
    runpy.run_module("lora_parity", run_name="__main__")
finally:  # a command that exits normally (SystemExit) dumps here
    profile.disable()
    profile.dump_stats(out)
