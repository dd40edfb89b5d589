"""The vllm-server sampler's mixed batch (issue 44, the engine as deployed, over HTTP; `backends.vllm_server_mixed`):
every sequence under every route sent at once, against the stand-in vLLM server (`tests/vllm_server_standin.py`),
each route scoring as it does alone (M.*); a batch that serves every request the first route's adapter is caught."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends import vllm_server_mixed
from lora_parity.backends.mixed_batch import MixedBatchSampler
from lora_parity.backends.vllm_server import VLLMServerSampler
from lora_parity.backends.vllm_server_mixed import VLLMServerMixedBatch
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.run.faults import FAULTS
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict import lifecycle

from .test_sglang_unit import SEQS, checkpoint, exported  # noqa: F401  (checkpoint: the fixture)
from .vllm_server_standin import VLLMStandIn

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("checkpoint")]


@pytest.fixture(autouse=True)
def no_cpu_lora_defect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in serves the fake model, not vLLM-CPU's LoRA ops: this machine's build has no say in its batches."""
    monkeypatch.setattr(vllm_server_mixed, "cpu_lora_defect", lambda: None)


@pytest.fixture
def server() -> Iterator[VLLMStandIn]:
    stand_in = VLLMStandIn()
    yield stand_in
    stand_in.close()


def run(tmp_path: Path, url: str, **kw: object):  # type: ignore[no-untyped-def]
    return execute(RunOptions(trainer="fake", sampler="vllm-server", sampler_url=url, per_target=False,
                              out=tmp_path / "r.json", **kw)).receipt  # type: ignore[arg-type]


def test_the_mixed_batch_sends_every_route_at_once_and_each_scores_as_alone(server: VLLMStandIn,
                                                                            tmp_path: Path) -> None:
    sampler = VLLMServerSampler(config.load(None), None, {}, url=server.url)
    try:
        assert isinstance(sampler, MixedBatchSampler) and sampler.traits.mixed_batch_unavailable is None
        assert sampler.adapters_per_batch == 1  # attached: its --max-loras is not known
        one = sampler.publish(exported(tmp_path, "v1")[0], "a", 1)
        two = sampler.publish(exported(tmp_path, "v2", std=0.2, seed=5)[0], "b", 2)
        routes = [None, one, two]
        before = len(server.posted("/v1/completions"))
        mixed = sampler.score_mixed(SEQS, routes)
        asked = server.posted("/v1/completions")[before:]
        # one request per sequence and route, each a single prompt naming its route
        assert sorted(body["model"] for body in asked) == sorted([sampler.base_model, one.name, two.name] * len(SEQS))
        assert all(len(body["prompt"]) == 1 and body["prompt_logprobs"] == 0 for body in asked)
        assert mixed == [sampler.score(SEQS, route) for route in routes]
        assert mixed[1] != mixed[0] and mixed[2] != mixed[1]  # the routes score apart: the test can tell them
        assert sampler.info().settings["mixed_batch"].startswith("on (every sequence under every route sent at once")
    finally:
        sampler.close()


def test_a_clean_run_over_http_mixes_base_and_synced_adapter_and_passes_m(server: VLLMStandIn,
                                                                          tmp_path: Path) -> None:
    receipt = run(tmp_path, server.url)
    assert receipt.verdict == Verdict.PASS
    names = [p.name for p in receipt.phases]
    assert names.index("base_after_sync") < names.index("mixed_batch")
    assert {"mixed_base", "mixed_updated", "mixed_control"} <= set(receipt.scores)
    status = {c.id: c.status for c in receipt.checks}
    assert status["M.base"] == status["M.updated"] == CheckStatus.PASS and "M.old" not in status
    row = next(r for r in lifecycle.of_receipt(receipt) if r.condition == "mixed batches")
    assert row.status == "covered"


def test_a_batch_that_gives_every_request_the_first_route_fails_m_over_http(server: VLLMStandIn,
                                                                            tmp_path: Path) -> None:
    receipt = run(tmp_path, server.url, inject="mixed-one-route")
    status = {c.id: c.status for c in receipt.checks}
    assert status["M.updated"] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
    assert all(any(status.get(i) == CheckStatus.FAIL for i in entry.split("|"))
               for entry in FAULTS["mixed-one-route"].caught_by)


def test_a_server_started_on_the_cpu_mixes_no_batch_where_the_build_has_the_lora_defect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def mixin(server: Any, cuda: bool, **engine_args: Any) -> VLLMServerMixedBatch:
        one = VLLMServerMixedBatch()
        cfg = SimpleNamespace(sampler=SimpleNamespace(engine_args=engine_args))
        vars(one).update(cfg=cfg, cuda=cuda, server=server)
        return one

    monkeypatch.setattr(vllm_server_mixed, "cpu_lora_defect", lambda: "the CPU op applies the adapter to slot -1")
    started_cpu = mixin(object(), cuda=False, max_loras=3)
    assert started_cpu._unmixed() == "the CPU op applies the adapter to slot -1"
    vars(started_cpu)["traits"] = SimpleNamespace(mixed_batch_unavailable=started_cpu._unmixed())
    assert started_cpu._mixed() == "off (engine defect): the CPU op applies the adapter to slot -1"
    assert started_cpu.adapters_per_batch == 3  # the --max-loras it was started with
    assert mixin(object(), cuda=True)._unmixed() is None  # CUDA kernels skip slot -1
    # attached, on a machine without CUDA whose build has the defect: most likely that build, said so
    assert mixin(None, cuda=False, max_loras=3)._unmixed() == (
        "the CPU op applies the adapter to slot -1; an attached server's own build is not known: this machine's has "
        "the defect")
    assert mixin(None, cuda=True)._unmixed() is None
    assert mixin(None, cuda=False, max_loras=3).adapters_per_batch == 1
    monkeypatch.setattr(vllm_server_mixed, "cpu_lora_defect", lambda: None)
    assert mixin(object(), cuda=False)._unmixed() is None
