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
        return _live_in_group(str(pid)) if os.path.isdir("/proc/self") else True


def _live_in_group(pid: str, pgid: int | None = None) -> bool:
    """Whether /proc/`pid` is a process (of group `pgid`, where given) that is neither a zombie nor dead."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:  # exited meanwhile
        return False
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = stat.rpartition(")")[2].split()
    return len(fields) >= 3 and (pgid is None or fields[2] == str(pgid)) and fields[0] not in ("Z", "X")


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that has not exited (read from /proc where there
    is one; elsewhere any member, zombies included, counts). A zombie holds nothing: vLLM's
    multiprocessing resource tracker, orphaned when its server exits, waits for PID 1 to reap it."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    return any(_live_in_group(entry.name, pgid) for entry in os.scandir("/proc") if entry.name.isdigit())


def _own_groups(pids: list[int]) -> set[int]:
    """The process groups that processes among `pids` lead (a server started in a session of its own),
    other than this process's: a member forked after `pids` was read is in one of them."""
    mine = os.getpgrp()
    groups = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid != mine:
                groups.add(pid)
    return groups


def _signal_all(pids: list[int], groups: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)


def _wait_gone(pids: list[int], groups: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if not any(_alive(p) for p in pids) and not any(group_alive(g) for g in groups):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def end_children(grace: float = 3.0, kill_wait: float = 10.0) -> list[int]:
    """SIGTERM every descendant of this process and every process group one of them leads (a vLLM
    server's: its engine core may be forked after the descendants were read), SIGKILL what is still
    alive after `grace` seconds, and return once all of it is gone (at most `kill_wait` seconds
    more: a process with gigabytes to unmap takes a moment to die); return the descendants' pids."""
    pids = descendants()
    groups = _own_groups(pids)
    _signal_all(pids, groups, signal.SIGTERM)
    if not _wait_gone(pids, groups, grace):
        _signal_all([p for p in pids if _alive(p)], groups, signal.SIGKILL)
        _wait_gone(pids, groups, kill_wait)
    return pids
