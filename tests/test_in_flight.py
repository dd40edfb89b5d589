"""A served sampler's HTTP timings are wall time (`util.in_flight`): calls in flight together from a thread pool count
once, not once per thread; the calls apart add up; a call that raises still counts."""

from __future__ import annotations

import threading

import pytest

from lora_parity.util.in_flight import InFlight

pytestmark = pytest.mark.unit


def test_overlapping_calls_count_their_wall_time_once() -> None:
    now = [0.0]
    timings: dict[str, float] = {"http.other": 1.0}
    clock = InFlight(timings, clock=lambda: now[0])
    first, second = clock.call("http.x"), clock.call("http.x")
    first.__enter__()
    now[0] = 1.0
    second.__enter__()
    now[0] = 2.0
    first.__exit__(None, None, None)
    assert "http.x" not in timings  # one call still in flight: nothing added yet
    now[0] = 3.0
    second.__exit__(None, None, None)
    assert timings == {"http.other": 1.0, "http.x": 3.0}  # 0 to 3, not 2 + 2
    now[0] = 5.0
    with pytest.raises(RuntimeError), clock.call("http.x"):
        now[0] = 6.5
        raise RuntimeError("the server went away")
    assert timings["http.x"] == 4.5 and clock.calls == 3


def test_threads_in_flight_together_read_as_one_stretch_of_wall_time() -> None:
    timings: dict[str, float] = {}
    clock = InFlight(timings)
    barrier = threading.Barrier(8)
    release = threading.Event()

    def one() -> None:
        with clock.call("http.pool"):
            barrier.wait()  # all eight in flight at once
            release.wait(5)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    threading.Timer(0.3, release.set).start()
    for t in threads:
        t.join(10)
    assert clock.calls == 8 and 0.25 <= timings["http.pool"] < 1.5  # about 0.3 s once, not 8 x 0.3 s
