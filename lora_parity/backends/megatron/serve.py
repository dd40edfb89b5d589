"""A trainer rank process (`python -m lora_parity.backends.megatron.serve`): join the trainer's
process group, then run rank 0's commands (`protocol`) until "close". Rank 0 reads them from the
driver's pipe and broadcasts each over a gloo control group; every rank runs it on its `Shard`.

Imports neither the CLI nor the runner: torchrun's entry point is `lora_parity.launch`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from lora_parity.backends.megatron import cpu, protocol
from lora_parity.backends.megatron.shards import Shard
from lora_parity.config import ModelConfig


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
    """Rank 0's pipe to the driver (absent on the other ranks, and under torchrun's rank 0 without one)."""

    def __init__(self, pipe: str | None) -> None:
        self.incoming: BinaryIO | None = None
        self.outgoing: BinaryIO | None = None
        if pipe:
            read_fd, write_fd = (int(x) for x in pipe.split(","))
            self.incoming, self.outgoing = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")

    def reply(self, message: dict[str, Any]) -> None:
        if self.outgoing is not None:
            self.outgoing.write(json.dumps(message).encode() + b"\n")
            self.outgoing.flush()

    def next_command(self) -> bytes:
        assert self.incoming is not None
        return self.incoming.readline() or protocol.CLOSE


def _init_process_group(rank: int, world: int, driver: _Driver) -> Any:
    """Join the trainer's default process group; the gloo control group for commands (None at world 1)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if cuda else "gloo"
    if os.environ.get(protocol.SPAWNED_ENV):
        # Spawned on this host: rank 0 opens the store on a free port and reports it; the driver
        # then starts the other ranks with it (no port race).
        if rank == 0:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, is_master=True, wait_for_workers=False)
            driver.reply({"port": store.port})
        else:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    return dist.new_group(backend="gloo", timeout=protocol.CONTROL_TIMEOUT) if world > 1 else None


def _run(shard: Shard | None, method: str, args: dict[str, Any], world: int, control: Any) -> tuple[Shard, Any]:
    """Run one command; the shard (built by "init") and the command's result."""
    if method == "init":
        cfg = ModelConfig.model_validate(args["config"])
        shard = Shard(cfg, Path(args["model_dir"]), int(args["seed"]), world, control)
        return shard, shard.describe()
    assert shard is not None, "init first"
    return shard, getattr(shard, method)(**args)


def serve() -> None:
    """A rank process: join the trainer's process group, then run rank 0's commands until "close"."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    driver = _Driver(os.environ.get(protocol.PIPE_ENV))
    control = _init_process_group(rank, world, driver)
    shard: Shard | None = None
    with cpu.cpu_current_device(), cpu.quiet():
        while True:
            line = driver.next_command() if rank == 0 else b""
            request = json.loads(_broadcast(line, rank, control))
            method, args = request.get("method"), request.get("args") or {}
            if method == "close" or method not in protocol.METHODS:
                break
            try:
                shard, result = _run(shard, method, args, world, control)
                driver.reply({"ok": result})
            except Exception as e:  # reported to the driver, which raises it; the ranks stay in step
                driver.reply(protocol.error_reply(e))
    if shard is not None:
        shard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    serve()
