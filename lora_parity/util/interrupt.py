"""SIGINT and SIGTERM end a run the same way: the phase in progress stops, a receipt with verdict
`error` is written, the work dir is removed, and the child processes the run started (the vLLM engine,
Megatron rank processes, torch's compile workers) are ended. `lora-parity run` installs the handlers
with `handle_signals`; the runner asks `received()` and calls `end_children()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (a KeyboardInterrupt, so code that lets Ctrl-C through lets it through)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def received() -> int | None:
    """The signal that interrupted this process, or None."""
    return _received[0] if _received else None


def describe(exc: BaseException | None = None) -> str:
    """'interrupted by SIGTERM' (or SIGINT: a plain KeyboardInterrupt is Ctrl-C)."""
    signum = received() or (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
    return f"interrupted by {signal.Signals(signum).name}"


def exit_code() -> int:
    """128 + the signal number, as a shell reports a process ended by that signal."""
    return 128 + (received() or signal.SIGINT)


def _raise(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    # Further signals while the receipt is written and children are ended are ignored: the
    # cleanup is short, and a second Ctrl-C must not leave a half-written receipt behind.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Interrupted` in the main thread while the block runs."""
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _received.clear()
    for s in SIGNALS:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _children_proc() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc (Linux)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields after it follow the last ')'.
        ppid = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int | None = None) -> list[int]:
    """Every process below `pid` (default: this one), children first."""
    root = os.getpid() if pid is None else pid
    try:
        tree = _children_proc()
    except OSError:
        try:
            import psutil

            return [p.pid for p in psutil.Process(root).children(recursive=True)]
        except Exception:
            return []
    found, todo = [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is gone for our purpose; reap it if it is our child
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def end_children(grace: float = 3.0) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL those still alive after `grace` seconds;
    return their pids."""
    pids = descendants()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return pids
