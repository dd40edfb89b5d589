"""A trainer rank process (`python -m lora_parity.backends.megatron.serve`): join the trainer's
process group, then run rank 0's commands (`protocol`) until "close". Rank 0 reads them from the
driver's pipe and broadcasts each over a gloo control group; every rank runs it on its `Shard`.

Imports neither the CLI nor the runner: torchrun's entry point is `lora_parity.launch`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lora_parity.backends.megatron import cpu, liveness, protocol
from lora_parity.backends.megatron.shards import Shard
from lora_parity.models.config import ModelConfig
from lora_parity.util import errors


def _broadcast(data: bytes, rank: int, group: Any) -> bytes:
    import torch.distributed as dist

    if group is None:
        return data
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return bytes(buf.numpy()) if rank != 0 else data


class _Driver:
    """Rank 0's pipe to the driver (absent on the other ranks, and under torchrun's rank 0 without one).
    Replies come from the main thread and, once, from the heartbeat thread: a lock keeps lines whole."""

    def __init__(self, pipe: str | None) -> None:
        self.incoming: BinaryIO | None = None
        self.outgoing: BinaryIO | None = None
        self._lock = threading.Lock()
        if pipe:
            read_fd, write_fd = (int(x) for x in pipe.split(","))
            self.incoming, self.outgoing = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")

    def reply(self, message: dict[str, Any]) -> None:
        with self._lock:
            if self.outgoing is not None:
                self.outgoing.write(json.dumps(message).encode() + b"\n")
                self.outgoing.flush()

    def next_command(self) -> bytes:
        assert self.incoming is not None
        return self.incoming.readline() or protocol.CLOSE


class _Group:
    """The process group as this rank sees it: the gloo control group for commands (None at world
    1), the heartbeats (`liveness`; none at world 1), and every rank's placement (node, host
    digest), gathered at "init"."""

    def __init__(self, rank: int, world: int, control: Any, store: Any, timeout: float, driver: _Driver) -> None:
        self.rank, self.world, self.control, self.driver = rank, world, control, driver
        self.placements: list[dict[str, str]] = [liveness.placement(dict(os.environ))]
        self.heartbeat = None if store is None else liveness.Liveness(store, rank, world, timeout, self._lost)

    def gather_placements(self) -> None:
        """Every rank's placement, in rank order (a collective: every rank calls it)."""
        import torch.distributed as dist

        if self.control is not None:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, self.placements[0], group=self.control)
            self.placements = gathered

    def nodes(self) -> dict[int, str]:
        """Each rank's node, once gathered."""
        return {r: p["node"] for r, p in enumerate(self.placements)} if len(self.placements) == self.world else {}

    def _lost(self, ranks: list[int], seconds: float) -> None:
        """The heartbeat thread found `ranks` lost: rank 0 answers the driver with an error naming
        them; every rank then exits at once (its main thread may be stuck in a collective)."""
        reply = protocol.lost_error(ranks, self.nodes(), seconds, after_failure=False)
        if self.rank == 0:
            self.driver.reply(reply)
        print(f"lora-parity rank {self.rank}: {reply['error']}", file=sys.stderr, flush=True)
        os._exit(1)


def _init_process_group(rank: int, world: int, driver: _Driver, timeout: float) -> tuple[Any, Any]:
    """Join the trainer's default process group; the gloo control group for commands (None at world
    1) and a second client of the rendezvous store for the heartbeats (None at world 1)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    host = os.environ["MASTER_ADDR"]
    if os.environ.get(protocol.SPAWNED_ENV):
        # Spawned on this host: rank 0 opens the store on a free port and reports it; the driver
        # then starts the other ranks with it (no port race).
        if rank == 0:
            store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
            driver.reply({"port": store.port})
            port = store.port
        else:
            port = int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(host, port, world, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        port = int(os.environ["MASTER_PORT"])
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    if world == 1:
        return None, None
    return dist.new_group(backend="gloo", timeout=protocol.CONTROL_TIMEOUT), liveness.connect(host, port, timeout)


def _run(shard: Shard | None, method: str, args: dict[str, Any], group: _Group) -> tuple[Shard, Any]:
    """Run one command; the shard (built by "init") and the command's result."""
    if method == "init":
        cfg = ModelConfig.model_validate(args["config"])
        shard = Shard(cfg, Path(args["model_dir"]), int(args["seed"]), group.world, group.control)
        group.gather_placements()
        described = shard.describe()
        described["settings"].update(liveness.placement_settings(group.placements))
        return shard, described
    assert shard is not None, "init first"
    return shard, getattr(shard, method)(**args)


def _failure(e: Exception, group: _Group) -> dict[str, Any]:
    """The reply for a command that raised. A collective that failed may mean a rank is gone: then
    the error names it (after a few heartbeats), not the socket."""
    if group.heartbeat is not None and not isinstance(e, errors.LoraParityError):
        lost, seconds = group.heartbeat.lost_since_error()
        if lost:
            return protocol.lost_error(lost, group.nodes(), seconds, after_failure=True)
    return protocol.error_reply(e)


def _serve(rank: int, driver: _Driver, group: _Group) -> Shard | None:
    """Run rank 0's commands until "close"; the shard, to free. A failed broadcast of the next
    command leaves the ranks out of step: rank 0 reports it, and every rank stops."""
    shard: Shard | None = None
    while True:
        line = driver.next_command() if rank == 0 else b""
        try:
            request = json.loads(_broadcast(line, rank, group.control))
        except Exception as e:
            driver.reply(_failure(e, group))
            return shard
        method, args = request.get("method"), request.get("args") or {}
        if method == "close" or method not in protocol.METHODS:
            return shard
        try:
            shard, result = _run(shard, method, args, group)
            driver.reply({"ok": result})
        except Exception as e:  # reported to the driver, which raises it; the ranks stay in step
            driver.reply(_failure(e, group))


def serve() -> None:
    """A rank process: join the trainer's process group, start the heartbeats, then run rank 0's
    commands until "close"."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    driver = _Driver(os.environ.get(protocol.PIPE_ENV))
    timeout = protocol.rank_timeout(os.environ)
    control, store = _init_process_group(rank, world, driver, timeout)
    group = _Group(rank, world, control, store, timeout, driver)
    if group.heartbeat is not None:
        group.heartbeat.start()
    with cpu.cpu_current_device(), cpu.quiet():
        shard = _serve(rank, driver, group)
    if shard is not None:
        shard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    serve()
