"""While the backends work: third-party output goes to a log file, and a terminal shows one live line.

Engines write to the terminal from everywhere: Python warnings, `logging` handlers bound to
sys.stdout or sys.stderr, tqdm bars, C++ code writing to fd 2, and child processes (vLLM's engine
core) that inherit fds 1 and 2. Only redirecting the file descriptors themselves catches all of
them, so `Session` points fds 1 and 2 at the log file for the duration, and lora-parity's own
progress goes to a duplicate of the terminal's stderr taken before.

Modes: "verbose" (nothing redirected; one line per finished phase, as the engines print), "normal"
(redirected; a live line with the phase and the elapsed time on a terminal, nothing when piped),
"quiet" (redirected; nothing until the closing line).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from rich.live import Live
from rich.spinner import Spinner

from lora_parity.cli import output
from lora_parity.evidence.receipt_io import umask_mode
from lora_parity.util.errors import LoraParityError
from lora_parity.util.escape import rich as escape

MODES = ("verbose", "normal", "quiet")


class _Ticker:
    """The live line: a spinner, what is happening, and the seconds since the start (re-rendered ~4x a second)."""

    def __init__(self, text: str) -> None:
        self.start = time.perf_counter()
        self.text = text
        self.spinner = Spinner("dots")

    def __rich__(self) -> Spinner:
        self.spinner.update(text=f"{escape(self.text)} · {time.perf_counter() - self.start:.1f} s")
        return self.spinner


class Session:
    """Context manager around backend work: redirects fds 1 and 2 to a log file (unless verbose) and
    shows progress; `progress` is the phase callback the runner takes; `note` prints one line above
    the live line."""

    def __init__(self, mode: str, first_line: str, phase_lines: bool = False) -> None:
        self.mode = mode
        self.phase_lines = phase_lines
        """Where no live line can be drawn (output to a file or pipe), print a plain line per phase:
        a CI log of `run` still shows how far a run got."""
        self.first_line = first_line
        fd, name = tempfile.mkstemp(prefix="lora-parity-", suffix=".log")
        os.fchmod(fd, umask_mode())  # kept beside the receipt: readable as the receipt is, not mkstemp's 0600
        os.close(fd)
        self.log: Path | None = None if mode == "verbose" else Path(name)
        if self.log is None:
            os.unlink(name)
        self._saved: tuple[int, int] | None = None
        self._terminal: IO[str] | None = None
        self._live: Live | None = None
        self._ticker = _Ticker(first_line)

    def __enter__(self) -> Session:
        # No line of its own before the inputs are checked: bad input is one line, the error.
        if self.log is None:
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self._terminal = os.fdopen(os.dup(self._saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
        output.err.file = self._terminal
        log_fd = os.open(self.log, os.O_WRONLY | os.O_APPEND)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        if self.mode == "normal" and output.err.is_terminal:
            self._live = Live(self._ticker, console=output.err, transient=True, refresh_per_second=4,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = None
        output.err.file = None  # type: ignore[assignment]  # back to sys.stderr
        if self._terminal is not None:
            self._terminal.close()
            self._terminal = None
        if exc is not None:  # no receipt to put the log beside: drop it if empty, else say where it is
            log = self.keep_log(None)
            if log is not None and not isinstance(exc, (LoraParityError, KeyboardInterrupt)):
                output.hint(f"third-party logs: {log}")

    def progress(self, phase: str, status: str, seconds: float) -> None:
        """The runner's phase callback: a line per phase (verbose, or normal output to a file or pipe,
        where a live line cannot be drawn: CI logs still show where a run is), else the live line's text."""
        plain = self.phase_lines and self.mode == "normal" and self._live is None and self._saved is not None
        if self.mode == "verbose" or plain:
            output.progress(phase, status, seconds)
            return
        self._ticker.text = f"{self.first_line} · {phase} {'done' if status == 'ok' else status}"

    def status(self, text: str) -> None:
        """Replace the live line's text (what runs now)."""
        self._ticker.text = f"{self.first_line} · {text}"

    def note(self, markup: str) -> None:
        """One line on the terminal's stderr (above the live line), unless quiet."""
        if self.mode != "quiet":
            output.err.print(markup, soft_wrap=True)

    def keep_log(self, beside: Path | None) -> Path | None:
        """Move the log next to `beside` (a receipt: same name, .log), or keep it where it is; None if empty."""
        if self.log is None or not self.log.exists():
            return None
        if self.log.stat().st_size == 0:
            self.log.unlink()
            return None
        if beside is None:
            return self.log
        target = beside.with_suffix(".log") if beside.suffix else beside / "lora-parity.log"
        try:
            shutil.move(str(self.log), target)
        except OSError:
            return self.log
        self.log = target
        return target


def mode_of(verbose: bool, quiet: bool) -> str:
    """The session mode for --verbose / --quiet (verbose wins when both are given)."""
    return "verbose" if verbose else "quiet" if quiet else "normal"


def describe(opts: Any, what: str = "run") -> str:
    """The first line a run prints: what runs, and that third-party output goes to a log."""
    from lora_parity.models.config import DEFAULT_MODEL

    fault = f", injected fault {opts.inject}" if getattr(opts, "inject", None) else ""
    return (f"lora-parity {what}: {opts.model or DEFAULT_MODEL}, {opts.trainer} trainer vs {opts.sampler} "
            f"sampler{fault}")
