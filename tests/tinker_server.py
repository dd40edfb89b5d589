"""SkyRL's Tinker-compatible server on loopback, for the `tinker` tests.

Installs nothing: it uses the venv that `scripts/skyrl-server.sh install` made in .venv-skyrl/
(.ci/run runs that before the tests), and starts and stops the server through the same script.
The server serves a copy of the embedded default's synthetic checkpoint plus a tokenizer made
locally (`lora_parity.models.synthetic.add_tokenizer`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lora_parity.models import config, synthetic

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "skyrl-server.sh"
VENV = ROOT / ".venv-skyrl"
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class Server:
    """A running server: its URL, the base model name clients use, and its process id."""

    url: str
    base_model: str
    pid: int
    log: Path


def installed() -> bool:
    """Whether .venv-skyrl/ holds an installed server."""
    return (VENV / ".installed").is_file()


def free_port() -> int:
    """A TCP port nobody listens on right now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_with_tokenizer(folder: Path) -> Path:
    """The tiny-qwen3 checkpoint copied into `folder`, with a byte-level BPE tokenizer of its vocabulary."""
    cfg = config.load("tiny-qwen3")
    assert cfg.model.synthetic is not None
    shutil.copytree(synthetic.materialize(cfg), folder)
    return synthetic.add_tokenizer(folder, cfg.model.synthetic.vocab_size)


def alive(pid: int) -> bool:
    """Whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def skyrl_server(workdir: Path) -> Iterator[Server]:
    """Start the server on a free loopback port, wait until it is ready, yield it, stop it by its pid."""
    model_dir = model_with_tokenizer(workdir / "model")
    port = free_port()
    run = VENV / "run" / str(port)
    started = subprocess.run(["bash", str(SCRIPT), "start", str(model_dir), str(port)], capture_output=True,
                             text=True, timeout=START_TIMEOUT_S, cwd=ROOT)
    if started.returncode != 0:
        raise RuntimeError(f"skyrl-server.sh start failed ({started.returncode}): {started.stderr[-3000:]}")
    pid = int((run / "server.pid").read_text())
    try:
        yield Server(url=f"http://127.0.0.1:{port}", base_model=str(model_dir.resolve()), pid=pid,
                     log=run / "server.log")
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(port)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
