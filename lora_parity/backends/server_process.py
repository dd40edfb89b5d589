"""A server process owned by lora-parity (`vllm serve`, SGLang's `launch_server`): started on
127.0.0.1 and a free port in a process group of its own, ready once `/health` answers, and stopped
(the whole group, by pid) on close, on error, at exit and on SIGTERM (by the run's own handler where
it has one, see `_install_handlers`). SIGINT reaches Python as KeyboardInterrupt, whose unwinding
closes it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from lora_parity.util import interrupt
from lora_parity.util.errors import BackendUnavailableError

LOG_TAIL_LINES = 20
_RUNNING: dict[int, ServerProcess] = {}
_exit_hook_registered = False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port` right now (the connections of a server that exited,
    left in TIME_WAIT, do not count: servers bind with SO_REUSEADDR, and so does this probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop_all() -> None:
    """Stop every server this process started and has not stopped (at exit, on SIGTERM, and before
    an exit that skips the exit hooks: `os._exit`)."""
    for server in list(_RUNNING.values()):
        server.stop()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    stop_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    """Stop the servers at exit, and on SIGTERM where nothing else handles it. Where a handler is
    installed (`lora-parity run`'s, `interrupt.handle_signals`: it writes the error receipt, then ends
    every child process, the server's group included), it is left in place: replacing it would end
    the run with no receipt, no line, and its work dir and lock left behind."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(stop_all)
        _exit_hook_registered = True
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


class ServerProcess:
    """One server process; `start` returns once it is healthy (or `launch` now and `wait_healthy`
    when it is needed, so the caller works meanwhile), `stop` is idempotent."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], port: int, start_timeout_s: float,
                 name: str = "vllm serve") -> None:
        self.argv, self.env, self.port, self.start_timeout_s = list(argv), env, port, start_timeout_s
        self.name = name
        """What the server is, in its error messages (`vllm serve`, `sglang.launch_server`)."""
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self._new_log()
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched_at: float | None = None
        """When `launch` started the process (`time.perf_counter()`)."""
        self.healthy_at: float | None = None
        """When `/health` first answered (`time.perf_counter()`)."""
        self._port_was_free = True

    def _new_log(self) -> Path:
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return Path(tempfile.mkstemp(prefix=f"lora-parity-{slug}-", suffix=".log")[1])

    def returncode(self, wait_s: float = 0.0) -> int | None:
        """The exit code of a launched server that has exited since, waiting up to `wait_s` for it to
        (a server dying as a call fails closes its socket a moment before it has exited); None: it
        runs, or was never launched, or was stopped."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def restart(self) -> None:
        """Launch the same command again on the same port after the server exited (a fault, or an
        adapter it was given, killed it): what is left of its process group is stopped first, and a
        new log started. Returns at once; `wait_healthy` (or the sampler's next call) waits for it."""
        self.stop()
        self.log_path = self._new_log()
        self.healthy_at = None
        self.launch()

    @property
    def pid(self) -> int | None:
        """The server's pid, which is also its process group id (None before start)."""
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start the server and wait for `/health`; on failure stop it and raise with its log's tail."""
        self.launch()
        self.wait_healthy()

    def launch(self) -> None:
        """Start the server process and return at once (`wait_healthy` waits for it); the launch
        time is `launched_at` (`time.perf_counter()`)."""
        _install_handlers()
        # Another server on the port would answer /health for ours: then ours can only fail (and its
        # log says why), never be taken as ready.
        self._port_was_free = port_free(self.port)
        self.launched_at = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        _RUNNING[self.proc.pid] = self

    def wait_healthy(self) -> None:
        """Return once the launched server answers `/health` (at once if it did before), setting
        `healthy_at`; on failure or an interrupt stop it and raise with its log's tail."""
        if self.healthy_at is not None:
            return
        if self.proc is None:
            raise BackendUnavailableError(f"{self.name} on port {self.port} was not launched or was stopped")
        try:
            self._wait_healthy(self.proc, self._port_was_free)
        except BaseException:  # an interrupt while waiting too: nothing is left running
            self.stop()
            raise
        self.healthy_at = time.perf_counter()

    def _wait_healthy(self, proc: subprocess.Popen[bytes], port_was_free: bool) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                taken = "" if port_was_free else f" (port {self.port} was taken)"
                self._fail(f"exited with code {proc.returncode} before it was ready{taken}")
            if port_was_free and self.healthy():
                return
            time.sleep(0.5)
        self._fail(f"not healthy within {self.start_timeout_s:g} s")

    def healthy(self) -> bool:
        """Whether `/health` answers 200 now (within 2 s)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # loopback http only
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _fail(self, what: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise BackendUnavailableError(f"{self.name} on port {self.port} {what}; last lines of its log:\n{tail}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group (the engine core and its worker are in it too), SIGKILL
        what is left after `grace_s`, and return once no process of the group is alive (an exited one
        that waits to be reaped, a zombie, holds nothing); remove the log."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        _RUNNING.pop(proc.pid, None)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            if _group_gone(proc, wait_s):
                break
        self.log_path.unlink(missing_ok=True)


def _group_gone(proc: subprocess.Popen[bytes], wait_s: float) -> bool:
    """Wait up to `wait_s` for every process of `proc`'s group to exit (reaping the leader). A
    member that has exited but not been reaped (a zombie: vLLM's multiprocessing resource tracker,
    orphaned when the API server exits, waits for PID 1) holds nothing and counts as gone."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        proc.poll()
        if not interrupt.group_alive(proc.pid):
            return True
        time.sleep(0.05)
    return False
