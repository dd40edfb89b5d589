"""Where each trainer rank runs, and whether it is still there: heartbeats through the rendezvous store.

A gloo collective with a rank whose node died can wait for its whole timeout (hours for the control
group, which idles while the sampler works), or fail with a socket error that names no rank. So
every rank process runs a heartbeat thread: every `interval` seconds it bumps its own counter in
the store (the one torchrun's agent for rank 0 hosts, or the one spawned rank 0 opens) and reads
the counters of the ranks it watches: rank 0 watches every other rank, the others watch rank 0.
Counters, not clocks, so that the nodes' clocks need not agree. A watched counter that has not
moved for `timeout` seconds (`protocol.RANK_TIMEOUT_ENV`), or a store that stays unreachable that
long, makes the rank lost; `on_lost` then ends the process's wait (rank 0 answers the driver with
an error naming the rank, then exits). After a collective fails, `lost_since_error` tells within a
few heartbeats whether a rank stopped.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

KEY = "heartbeat/{rank}"


def interval_for(timeout: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, between 0.2 and 2."""
    return min(2.0, max(0.2, timeout / 10))


def placement(environ: dict[str, str]) -> dict[str, str]:
    """This rank's node (torchrun's GROUP_RANK, 0 when spawned on one host) and a digest of its host
    name (the first 12 hex digits of its sha256: which ranks shared a machine, without naming it)."""
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]
    return {"node": environ.get("GROUP_RANK", "0"), "host": host}


def placement_settings(placements: list[dict[str, str]]) -> dict[str, int | list[str]]:
    """Receipt settings from every rank's `placement`, in rank order: the number of nodes, and per
    rank its node and host digest."""
    return {"nodes": len({p["node"] for p in placements}),
            "rank_nodes": [p["node"] for p in placements],
            "rank_hosts": [p["host"] for p in placements]}


class Liveness:
    """The heartbeat thread of one rank (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world: int, timeout: float,
                 on_lost: Callable[[list[int], float], None]) -> None:
        self.store, self.rank, self.timeout, self.on_lost = store, rank, timeout, on_lost
        self.interval = interval_for(timeout)
        self.watched = list(range(1, world)) if rank == 0 else [0]
        now = time.monotonic()
        self._last: dict[int, bytes | None] = dict.fromkeys(self.watched)
        self._seen = dict.fromkeys(self.watched, now)  # when each watched counter last moved
        self._beats = 0
        self._polled: float | None = None
        """When the last round that read every watched counter ended (time.monotonic())."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="lora-parity-heartbeat", daemon=True)

    def start(self) -> Liveness:
        """Start the thread; return self."""
        self._thread.start()
        return self

    def _beat(self) -> None:
        """Bump this rank's counter and note which watched counters moved; a store error skips the round."""
        self._beats += 1
        try:
            self.store.set(KEY.format(rank=self.rank), str(self._beats))
            for r in self.watched:
                key = KEY.format(rank=r)
                value = self.store.get(key) if self.store.check([key]) else None
                with self._lock:
                    if value is not None and value != self._last[r]:
                        self._last[r], self._seen[r] = value, time.monotonic()
            with self._lock:
                self._polled = time.monotonic()
        except Exception:  # the store's host is unreachable: no counter moves, so its ranks time out
            pass

    def _loop(self) -> None:
        while True:
            self._beat()
            lost = self.silent_since(time.monotonic() - self.timeout)
            if lost:
                self.on_lost(lost, self.timeout)
                return
            time.sleep(self.interval)

    def silent_since(self, moment: float) -> list[int]:
        """The watched ranks whose counter has not moved since `moment` (time.monotonic())."""
        with self._lock:
            return [r for r in self.watched if self._seen[r] <= moment]

    def lost_since_error(self) -> tuple[list[int], float]:
        """After a collective failed: the watched ranks that send no heartbeat for the next few
        intervals (at least 2 s, at most the timeout), and those seconds; [] if every one still beats.
        A beat counts from the first round that read the counters after the failure on: a rank that
        died beat last before it, and a thread slowed by a loaded machine may only see that last beat
        after the failure (it would pass for a live one)."""
        failed = time.monotonic()
        grace = min(self.timeout, max(2.0, 3 * self.interval))
        since: float | None = None
        while time.monotonic() < failed + grace:
            with self._lock:
                polled = self._polled
            if since is None:
                since = polled if polled is not None and polled > failed else None
            elif not self.silent_since(since):
                return [], 0.0
            time.sleep(self.interval / 2)
        return self.silent_since(since if since is not None else failed), round(grace, 1)


def connect(host: str, port: int, timeout: float) -> Any:
    """A client of the rendezvous store for the heartbeats (its own connection: the thread never
    shares one with the process group), whose operations give up after about `timeout` seconds."""
    import torch.distributed as dist

    seconds = max(1.0, timeout / 2)
    return dist.PrefixStore("lora-parity", dist.TCPStore(host, port, is_master=False,
                                                          timeout=dt.timedelta(seconds=seconds)))
