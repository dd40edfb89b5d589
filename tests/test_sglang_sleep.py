"""SGLang's memory release and resume as the sleep phases drive it (issue 44; `backends.sglang_state`), against the
stand-in SGLang server, which keeps the memory saver as SGLang 0.5.16's source says it works: a server with a CPU copy
of its weights gets them back (level 1), one without gets them back undefined until it loads them from disk (level
2); the adapters stay through both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_parity.backends import sglang_server
from lora_parity.backends.base import BaseReloadingSampler, BaseResettingSampler
from lora_parity.backends.sleep import KV_CACHE, LOST_LOGPROB, WEIGHTS, SleepingSampler
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.run.faults import FAULTS
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import lifecycle

from .sglang_server import StandIn
from .test_sglang_unit import SEQS, attach, checkpoint, exported  # noqa: F401  (checkpoint: the fixture)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("checkpoint")]  # the runs serve its checkpoint


@pytest.fixture(params=[1, 2], ids=["level1-cpu-backup", "level2-no-backup"])
def saver(request: pytest.FixtureRequest) -> Iterator[tuple[StandIn, int]]:
    """A stand-in started with the memory saver, with (level 1) or without (level 2) a CPU copy of its weights."""
    level = request.param
    server = StandIn(server_args={"enable_memory_saver": True, "enable_weights_cpu_backup": level == 1})
    yield server, level
    server.close()


def run(tmp_path: Path, url: str, levels: str, **kw: object):  # type: ignore[no-untyped-def]
    return execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=url, per_target=False,
                              sleep_levels=levels, out=tmp_path / "r.json", **kw)).receipt  # type: ignore[arg-type]


def test_the_sampler_sleeps_and_loads_its_base_again_but_never_reloads_merged_weights(
        saver: tuple[StandIn, int]) -> None:
    sampler = attach(saver[0].url)
    try:
        assert isinstance(sampler, SleepingSampler) and isinstance(sampler, BaseResettingSampler)
        # No merged sync mode comes with it: SGLang's sampler does not reload merged weights.
        assert not isinstance(sampler, BaseReloadingSampler)
    finally:
        sampler.close()


def test_a_started_server_gets_the_memory_saver_and_the_cpu_copy_its_level_needs() -> None:
    cfg = config.load(None)

    def argv(levels: list[int]) -> list[str]:
        asked = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"sleep_levels": levels})})
        return sglang_server.server_argv(asked, Path("m"), 1)

    assert "--enable-memory-saver" not in argv([])
    assert argv([1])[-2:] == ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    assert "--enable-memory-saver" in argv([2]) and "--enable-weights-cpu-backup" not in argv([2])
    with pytest.raises(ConfigError, match=r"sleeps at one level per server: .* run --sleep-levels 1 and "):
        argv([1, 2])


def test_release_and_resume_keep_the_adapter_and_the_weights_only_with_a_cpu_copy(
        saver: tuple[StandIn, int], tmp_path: Path) -> None:
    server, level = saver
    folder, trainer = exported(tmp_path, "v1")
    sampler = attach(server.url)
    try:
        assert sampler.traits.sleep_unavailable is None and sampler.sleep_levels == (level,)
        handle = sampler.publish(folder, "a", 1)
        sampler.sleep(level)
        assert server.released == {"kv_cache", "weights", "cuda_graph"}
        sampler.wake_up([WEIGHTS])
        assert server.released == {"kv_cache", "cuda_graph"}
        sampler.wake_up([KV_CACHE])
        assert not server.released
        woken = sampler.score(SEQS, handle)
        if level == 1:
            assert woken == trainer.score(SEQS)  # the CPU copy came back, the adapter stayed
        else:
            assert {x for row in woken for x in row} == {LOST_LOGPROB}  # undefined until loaded again
            sampler.reset_base()
            assert sampler.score(SEQS, handle) == trainer.score(SEQS)
            assert server.posted("/update_weights_from_disk") == [{"model_path": "/models/tiny-qwen3"}]
        with pytest.raises(ConfigError, match=f"sleeps at level \\({level},\\), not {3 - level}"):
            sampler.sleep(3 - level)
    finally:
        sampler.close()


def test_a_run_sleeps_at_the_servers_level_passes_and_covers_that_row(saver: tuple[StandIn, int],
                                                                      tmp_path: Path) -> None:
    server, level = saver
    receipt = run(tmp_path, server.url, str(level))
    assert receipt.verdict == Verdict.PASS, receipt.error
    first, again = lifecycle.SLEEP_PHASES[level]
    names = [p.name for p in receipt.phases]
    assert first in names and again in names and receipt.scores[first] == receipt.scores["updated"]
    rows = {r.condition: r for r in receipt.lifecycle or []}
    assert rows[f"sleep level {level} + wake"].status == "covered"
    assert rows[f"sleep level {3 - level} + wake"].status == "not covered"
    assert receipt.sampler.settings["sleep_mode"] == f"on (levels {level})"
    assert len(server.posted("/update_weights_from_disk")) == (2 if level == 2 else 0)  # after each level-2 wake


@pytest.mark.parametrize(("fault", "level", "check"), [("wake-drops-adapter", 1, "W.sleep_wake.level1"),
                                                       ("level2-base-lost", 2, "W.sleep_wake.level2")])
def test_each_sleep_fault_of_its_level_fails_its_check_through_the_server(tmp_path: Path, fault: str, level: int,
                                                                          check: str) -> None:
    server = StandIn(server_args={"enable_memory_saver": True, "enable_weights_cpu_backup": level == 1})
    try:
        receipt = run(tmp_path, server.url, str(level), inject=fault)
    finally:
        server.close()
    status = {c.id: c.status for c in receipt.checks}
    assert status[check] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
    assert all(any(status.get(i) == CheckStatus.FAIL for i in entry.split("|")) for entry in FAULTS[fault].caught_by)


def test_a_server_without_the_memory_saver_skips_the_phases_and_the_rows_say_why(tmp_path: Path) -> None:
    server = StandIn()  # SGLang's default: no memory saver, so a release would free nothing
    try:
        receipt = run(tmp_path, server.url, "1")
    finally:
        server.close()
    assert receipt.verdict == Verdict.PASS and not server.posted("/release_memory_occupation")
    rows = {r.condition: r for r in receipt.lifecycle or []}
    assert rows["sleep level 1 + wake"].detail == ("no sleep/wake phase ran: off (the server runs without "
                                                   "--enable-memory-saver (it cannot give its memory back))")
