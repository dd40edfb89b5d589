"""The user's loop between a sync and the next scoring (issue 44's lifecycle section, `--loop`, `sampler.loop`): the
prefix-cache reset after the sync and its fault, the wake around the sync, what the receipt and the table say."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_parity import backends
from lora_parity.models import config, loop
from lora_parity.models.loop import LoopSpec
from lora_parity.run.runner import RunOptions, execute, prepare
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import ConfigError, ScoreError
from lora_parity.verdict.verify import verify

from .conftest import cli
from .test_vllm_server_unit import FakeServedSampler

pytestmark = pytest.mark.unit


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(backends, "SAMPLERS", {**backends.SAMPLERS, "served-fake": FakeServedSampler})
    return "served-fake"


def test_the_options_are_checked_in_one_line_and_the_default_keeps_older_digests() -> None:
    spec = loop.merged(LoopSpec(), loop.parse(["reset_prefix_cache=true", " wake = all"]))
    assert (spec.reset_prefix_cache, spec.wake, spec.default) == (True, "all", False)
    assert LoopSpec().default and "reset after the sync: no" in LoopSpec().describe()
    for bad, said in (("wake=some", "--loop wake"), ("resets=1", "--loop resets"), ("wake", "KEY=VALUE"),
                      ("reset_prefix_cache=maybe", "--loop reset_prefix_cache")):
        with pytest.raises(ConfigError, match=said) as e:
            loop.merged(LoopSpec(), loop.parse([bad]))
        assert "\n" not in str(e.value)
    cfg = config.load(None)
    explicit = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"loop": LoopSpec()})})
    resetting = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"loop": spec})})
    assert explicit.digest() == cfg.digest() != resetting.digest()
    assert "loop" not in cfg.model_dump(mode="json", exclude={"sampler": {"loop"}})["sampler"]


def test_refused_where_the_sampler_cannot_reset_or_the_fault_is_not_this_loops(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the fake sampler has no prefix-cache reset"):
        prepare(RunOptions(trainer="fake", sampler="fake", loop=("reset_prefix_cache=true",)))
    for args, said in ((("reset_prefix_cache=true",), "fault 'warm-prefix-cache' does not apply to this loop"),
                       ((), "fault 'prefix-reset-dropped' does not apply to this loop")):
        fault = "warm-prefix-cache" if args else "prefix-reset-dropped"
        with pytest.raises(ConfigError, match=said):
            prepare(RunOptions(trainer="fake", sampler="fake", loop=args, inject=fault))
    result = cli("run", "--trainer", "fake", "--sampler", "fake", "--loop", "wake=sometimes", "--out",
                 str(tmp_path / "r.json"))
    assert result.returncode == 2 and "--loop wake" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "r.json").exists()


def test_a_loop_that_resets_after_the_sync_catches_the_reset_lost_and_passes_clean(served: str,
                                                                                     tmp_path: Path) -> None:
    opts = RunOptions(trainer="fake", sampler=served, loop=("reset_prefix_cache=true",))
    result = selftest(opts, tmp_path)
    names = [r.fault for r in result.rows]
    assert "prefix-reset-dropped" in names and "warm-prefix-cache" not in names
    rows = {r.fault: r for r in result.rows}
    assert rows["none"].caught and rows["prefix-reset-dropped"].caught
    clean = verify(Path(rows["none"].receipt)).receipt
    assert clean.sampler.settings["loop"] == loop.LoopSpec(reset_prefix_cache=True).describe()
    row = next(r for r in clean.lifecycle or [] if r.condition == "warm prefix cache after the sync")
    assert row.status == "covered" and "the cache reset after the sync as the user's loop does" in row.detail
    faulty = verify(Path(rows["prefix-reset-dropped"].receipt)).receipt
    failed = {c.id for c in faulty.checks if c.status.value == "fail"}
    assert "P.parity.mean" in failed and "C.parity.mean" not in failed


def test_the_reset_is_what_clears_the_old_blocks(served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # prefix-reset-dropped's sync (in place under the same name and path) fails P with the reset lost; the same sync
    # with the reset made passes: P reads what the reset did.
    from lora_parity.run import phases

    opts = RunOptions(trainer="fake", sampler=served, loop=("reset_prefix_cache=true",), inject="prefix-reset-dropped")
    dropped = execute(RunOptions(**{**opts.__dict__, "out": tmp_path / "d.json"})).receipt
    assert "P.parity.mean" in {c.id for c in dropped.checks if c.status.value == "fail"}
    monkeypatch.setattr(phases, "after_loop_sync", lambda run: run.sampler.reset_prefix_cache())  # the reset kept
    kept = execute(RunOptions(**{**opts.__dict__, "out": tmp_path / "k.json"})).receipt
    assert not [c.id for c in kept.checks if c.id.startswith("P.") and c.status.value == "fail"]
    clean = execute(RunOptions(trainer="fake", sampler=served, loop=("reset_prefix_cache=true",),
                               out=tmp_path / "c.json")).receipt
    assert clean.verdict.value == "pass"


def test_wake_all_wakes_everything_before_the_sync(tmp_path: Path) -> None:
    from lora_parity.models.loop import LoopSpec
    from lora_parity.run import sleep_wake

    from .test_sleep_wake import vllm_run

    r = vllm_run(tmp_path)
    r.cfg = r.cfg.model_copy(update={"sampler": r.cfg.sampler.model_copy(update={"loop": LoopSpec(wake="all")})})
    engine = r.sampler
    sleep_wake.sleep_sync_wake(r, 1)
    calls = [c[0] if c[0] != "wake_up" else c for c in engine.llm.calls]  # type: ignore[attr-defined]
    assert calls[:2] == [("sleep"), ("wake_up", None)] and ("wake_up", ["kv_cache"]) not in calls
    assert calls.index(("wake_up", None)) < calls.index("add_lora") < calls.index("generate")
    assert "sleep_wake.level1" in r.scores


def test_the_table_says_which_loop_the_phases_ran() -> None:
    from lora_parity.verdict import lifecycle

    from .test_lifecycle import ok

    phases = ok(*lifecycle.SLEEP_PHASES[1], *lifecycle.PREFIX_PHASES)
    spec = LoopSpec(reset_prefix_cache=True, wake="all")
    ours = {r.condition: r.detail for r in lifecycle.derive("vllm", {"sleep_mode": "on"}, phases)}
    theirs = {r.condition: r.detail for r in lifecycle.derive("vllm", {"sleep_mode": "on", "loop": spec.describe()},
                                                              phases)}
    assert ours["sleep level 1 + wake"].startswith("sleep -> sync -> wake -> score")
    assert theirs["sleep level 1 + wake"].startswith("sleep -> wake -> sync -> score")
    assert "reset after the sync" not in ours["warm prefix cache after the sync"]
    assert "the cache reset after the sync as the user's loop does" in theirs["warm prefix cache after the sync"]


def test_the_vllm_server_sampler_resets_its_cache_over_http() -> None:
    from lora_parity.backends.vllm_server import VLLMServerSampler
    from lora_parity.run.loop import PrefixResetting

    from .vllm_server_standin import VLLMStandIn

    server = VLLMStandIn()
    try:
        sampler = VLLMServerSampler(config.load(None), None, {}, url=server.url)
        assert isinstance(sampler, PrefixResetting) and issubclass(VLLMServerSampler, PrefixResetting)
        sampler.reset_prefix_cache()
        assert len(server.posted("/reset_prefix_cache")) == 1
    finally:
        server.close()
    server = VLLMStandIn(dev_mode=False)  # an attached server without dev mode: one line saying so
    try:
        with pytest.raises(ScoreError, match=r"not served \(the server runs without VLLM_SERVER_DEV_MODE=1"):
            VLLMServerSampler(config.load(None), None, {}, url=server.url).reset_prefix_cache()
    finally:
        server.close()


def test_an_attached_servers_engine_arguments_are_recorded_as_declared_not_set() -> None:
    from lora_parity.backends import engine_args
    from lora_parity.backends.vllm_server import VLLMServerSampler
    from lora_parity.verdict import lifecycle

    from .vllm_server_standin import VLLMStandIn

    cfg = config.load(None)
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"engine_args": {"max_num_seqs": 8}})})
    server = VLLMStandIn()
    try:
        settings = VLLMServerSampler(cfg, None, {}, url=server.url).info().settings
    finally:
        server.close()
    assert settings["engine_args"] == ["max_num_seqs=8"] and engine_args.ATTACHED in settings["engine_args_effect"]
    row = next(r for r in lifecycle.derive("vllm-server", settings, []) if r.condition == "the user's engine arguments")
    assert "lora-parity did not start" in row.detail


def test_a_server_started_here_for_a_resetting_loop_runs_in_dev_mode() -> None:
    from lora_parity.backends.vllm_server import server_env

    cfg = config.load(None)
    resetting = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
        update={"loop": LoopSpec(reset_prefix_cache=True)})})
    assert server_env(cfg, False).get("VLLM_SERVER_DEV_MODE") is None
    assert server_env(resetting, False)["VLLM_SERVER_DEV_MODE"] == "1"
