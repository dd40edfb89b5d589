"""The driver's side of TP=N: the trainer's N rank processes, driven over a pipe to rank 0, which
broadcasts each command (`protocol`); the rank processes themselves run `serve`.

Spawned: rank 0 starts first, opens the rendezvous store on a free port and reports it; ranks
1..N-1 then start with it. Under torchrun, only rank 0 is started here (as a child of torchrun's
rank 0, which runs the sequence and the sampler); the other ranks are torchrun's processes.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from lora_parity.backends.megatron import cpu, protocol
from lora_parity.util.errors import PhaseError


class RankProcesses:
    """The trainer's N rank processes, driven over a pipe to rank 0, which broadcasts each command."""

    def __init__(self, world: int, torchrun: bool) -> None:
        self.logdir = Path(tempfile.mkdtemp(prefix="lora-parity-megatron-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = dict(os.environ)
        if not torchrun:
            env.update(cpu.rank_environment(world))
            env.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        protocol.SPAWNED_ENV: "1"})
        try:
            self._start(0, {**env, protocol.PIPE_ENV: f"{cmd_read},{reply_write}"}, (cmd_read, reply_write))
        finally:
            os.close(cmd_read)
            os.close(reply_write)
        self._to_rank0: BinaryIO = os.fdopen(cmd_write, "wb")
        self._from_rank0: BinaryIO = os.fdopen(reply_read, "rb")
        if not torchrun:
            port = self._reply()["port"]
            for rank in range(1, world):
                self._start(rank, {**env, "MASTER_PORT": str(port)}, ())

    def _start(self, rank: int, env: dict[str, str], fds: tuple[int, ...]) -> None:
        if protocol.SPAWNED_ENV in env:
            env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(self.logdir / f"rank{rank}.log", "wb") as log:  # the child keeps its own copy
            self.procs.append(subprocess.Popen([sys.executable, "-m", protocol.RANK_MODULE], env=env,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               pass_fds=fds))

    def _log_tail(self, index: int) -> str:
        try:
            lines = (self.logdir / f"rank{index}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def _reply(self) -> dict[str, Any]:
        while True:
            ready, _, _ = select.select([self._from_rank0], [], [], 1.0)
            closed = False
            if ready:
                line = self._from_rank0.readline()
                if line:
                    reply: dict[str, Any] = json.loads(line)
                    return reply
                closed = True  # rank 0 closed its end: it is exiting
            self._raise_if_exited(closed)

    def _raise_if_exited(self, rank0_closed: bool) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None or (rank0_closed and i == 0):
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                message = f"megatron rank {i} exited with code {p.returncode}: {self._log_tail(i)}"
                self._stop()
                raise PhaseError(message)

    def call(self, method: str, args: dict[str, Any]) -> Any:
        """Run `method` on every rank; rank 0's result, or its error raised here."""
        if not self.procs:
            raise PhaseError("the megatron rank processes are not running")
        try:
            self._to_rank0.write(protocol.request(method, args))
            self._to_rank0.flush()
        except OSError:
            pass  # rank 0 has exited; its last words (a lost rank, say) are still in the pipe, or none
        return protocol.result(self._reply())

    def _stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        for f in (self._to_rank0, self._from_rank0):
            if f is not None:
                f.close()

    def close(self) -> None:
        """Ask every rank to exit, then make sure they have."""
        if self.procs:
            try:
                self._to_rank0.write(protocol.CLOSE)
                self._to_rank0.flush()
                for p in self.procs:
                    p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop()
        shutil.rmtree(self.logdir, ignore_errors=True)
