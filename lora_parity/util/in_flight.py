"""Wall time of calls that may overlap (a served sampler's requests from a thread pool): per key, the time during which
at least one call under it was in flight. Adding each call's own time would count thread-seconds: twelve requests in
flight together for 0.2 s read as 2.4 s."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class InFlight:
    """Adds to `timings[key]` the wall time while a call under `key` is in flight (`call`), and counts the calls."""

    def __init__(self, timings: dict[str, float], clock: Callable[[], float] = time.perf_counter) -> None:
        self.timings, self.clock = timings, clock
        self.calls = 0
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, float]] = {}
        """Per key: calls in flight, and since when at least one has been."""

    @contextlib.contextmanager
    def call(self, key: str) -> Iterator[None]:
        with self._lock:
            count, since = self._open.get(key, (0, self.clock()))
            self._open[key] = (count + 1, since)
        try:
            yield
        finally:
            with self._lock:
                count, since = self._open.pop(key)
                self.calls += 1
                if count > 1:
                    self._open[key] = (count - 1, since)
                else:
                    self.timings[key] = self.timings.get(key, 0.0) + self.clock() - since
