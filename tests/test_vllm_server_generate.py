"""The vllm-server sampler's decode path and its CUDA graphs setting (issue 44; `backends.vllm_server_generate`),
against the stand-in vLLM server (`tests/vllm_server_standin.py`), which samples from the fake model with each
request's seed as vLLM does; the settings of a started server from its command line alone (nothing is started)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends.base import GeneratingSampler
from lora_parity.backends.vllm_server import VLLMServerSampler, server_argv
from lora_parity.backends.vllm_server_generate import (
    CPU_GRAPHS,
    EAGER,
    NOT_TOLD,
    generated,
    started_graphs,
    told_graphs,
)
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.run import probes
from lora_parity.run.faults import FAULTS, SAMPLED_FAULTS
from lora_parity.run.generation import TEMPERED_FAULT_NAMES
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ScoreError
from lora_parity.verdict import lifecycle

from .test_sglang_unit import SEQS, checkpoint, exported  # noqa: F401  (checkpoint: the fixture)
from .vllm_server_standin import VLLMStandIn

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("checkpoint")]


@pytest.fixture
def toy_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default config is synthetic (no tokenizer): tokenize characters into the fake's vocabulary."""
    monkeypatch.setattr(probes, "checkpoint_tokenizer",
                        lambda cfg, kind="text": (lambda text: [ord(ch) % 64 for ch in text], "toy"))


@pytest.fixture
def server() -> Iterator[VLLMStandIn]:
    stand_in = VLLMStandIn()
    yield stand_in
    stand_in.close()


def attach(url: str) -> VLLMServerSampler:
    return VLLMServerSampler(config.load(None), None, {}, url=url)


def run(tmp_path: Path, url: str, **kw: Any):  # type: ignore[no-untyped-def]
    return execute(RunOptions(trainer="fake", sampler="vllm-server", sampler_url=url, per_target=False,
                              probes="sampled", out=tmp_path / "r.json", **kw)).receipt


def rows(receipt: Any) -> dict[str, Any]:
    return {r.condition: r for r in receipt.lifecycle or []}


def test_generate_sends_the_in_process_request_and_its_logprobs_are_the_scores(server: VLLMStandIn,
                                                                               tmp_path: Path) -> None:
    folder, trainer = exported(tmp_path, "v1")
    sampler = attach(server.url)
    try:
        assert isinstance(sampler, GeneratingSampler)
        handle = sampler.publish(folder, "a", 1)
        prompts = [s[:5] for s in SEQS]
        sequences, logprobs = sampler.generate(prompts, 6, 7, handle)
        assert [s[:5] for s in sequences] == prompts and all(len(s) == 11 for s in sequences)
        assert sampler.score(sequences, handle) == trainer.score(sequences)
        assert [x for row in logprobs for x in row] == pytest.approx([x for row in trainer.score(sequences)
                                                                      for x in row], abs=1e-12)
        assert sampler.generate(prompts, 6, 7, handle)[0] == sequences  # the same seeds, the same tokens
        assert sampler.generate(prompts, 6, 8, handle)[0] != sequences
        base = sampler.generate(prompts, 6, 7, None)[1]
        assert base != logprobs
    finally:
        sampler.close()
    bodies = [b for b in server.posted("/v1/completions") if b.get("seed") is not None]
    assert bodies[0] == {"model": handle.name, "prompt": prompts[0], "max_tokens": 6, "min_tokens": 6,
                         "ignore_eos": True, "temperature": 1.0, "seed": 7, "logprobs": 0, "prompt_logprobs": 0,
                         "return_tokens_as_token_ids": True}
    assert [b["seed"] for b in bodies[:2]] == [7, 8]  # request i seeded with seed + i
    assert bodies[-1]["model"] == "base"


@pytest.mark.parametrize(("answer", "says"), [
    ({"logprobs": {"tokens": ["token_id:3"], "token_logprobs": [-1.0]}}, "expected 2 tokens as token_id:N"),
    ({"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}}, "expected 2 tokens as token_id:N"),
    ({"logprobs": {"tokens": ["token_id:3", "token_id:4"], "token_logprobs": [-1.0, None]}}, "each with its logprob"),
    ({"logprobs": None}, "got no tokens"),
])
def test_a_generation_answer_that_is_not_exactly_max_tokens_is_one_score_error(server: VLLMStandIn,
                                                                              answer: dict[str, Any],
                                                                              says: str) -> None:
    sampler = attach(server.url)
    sampler._completion = lambda *a, **k: [{"index": 0, "prompt_logprobs": [None, {"2": {"logprob": -1.0}}],
                                            **answer}]  # type: ignore[method-assign]
    try:
        with pytest.raises(ScoreError, match=f"generation for prompt 0: .*{says}") as e:
            sampler.generate([[1, 2]], 2, 0, None)
        assert "\n" not in str(e.value)
    finally:
        sampler.close()


def test_a_sampled_run_through_the_server_passes_and_covers_the_decode_path_and_graphs(
        server: VLLMStandIn, toy_tokenizer: None, tmp_path: Path) -> None:
    receipt = run(tmp_path, server.url)
    assert receipt.verdict == Verdict.PASS, receipt.error
    status = {c.id: c.status for c in receipt.checks}
    assert all(status[c] == CheckStatus.PASS for c in status if c.startswith(("G.sampled", "G.updated", "G.trainer")))
    assert {"G.updated.parity.mean", "G.trainer.parity.mean"} <= set(status)
    table = rows(receipt)
    assert table["decode-path logprobs"].status == "covered"
    graphs = receipt.sampler.settings["cuda_graphs"]
    assert graphs == "on (cudagraph_mode FULL_AND_PIECEWISE, 5 capture sizes up to 16; the server's /server_info)"
    assert table["CUDA graphs"].status == "covered" and table["CUDA graphs"].detail == graphs


@pytest.mark.parametrize("fault", [f for f in SAMPLED_FAULTS if f not in TEMPERED_FAULT_NAMES])  # tempered: hf only
def test_each_generation_fault_fails_its_checks_through_the_server(server: VLLMStandIn, toy_tokenizer: None,
                                                                   tmp_path: Path, fault: str) -> None:
    receipt = run(tmp_path, server.url, inject=fault)
    spec, status = FAULTS[fault], {c.id: c.status for c in receipt.checks}
    assert receipt.verdict == Verdict.FAIL, receipt.error
    assert all(any(status.get(i) == CheckStatus.FAIL for i in entry.split("|")) for entry in spec.caught_by)
    assert all(status[c] == CheckStatus.PASS for c in spec.must_pass)
    assert all(s == CheckStatus.PASS for c, s in status.items() if not c.startswith("G."))


def test_generation_faults_apply_to_the_server() -> None:
    from lora_parity.run.faults import faults_for

    assert {"gen-no-adapter", "prompt-no-adapter", "graphs-hold-old"} <= set(
        faults_for("new-id", VLLMServerSampler.traits, sampled=True))


def test_an_attached_server_records_graphs_only_where_its_server_info_tells(tmp_path: Path) -> None:
    for kw, expected in (({"dev_mode": False}, NOT_TOLD),
                         ({"compilation": None}, "off (enforce_eager: true, as the server's /server_info reports)")):
        stand_in = VLLMStandIn(**kw)
        sampler = attach(stand_in.url)
        try:
            setting = sampler.info().settings["cuda_graphs"]
        finally:
            sampler.close()
            stand_in.close()
        assert setting == expected
        table = {r.condition: r for r in lifecycle.derive("vllm-server", {"cuda_graphs": setting}, [])}
        assert table["CUDA graphs"].status == "not covered" and table["CUDA graphs"].detail == expected
    assert told_graphs({"vllm_config": "model='m', compilation_config={'mode': <CompilationMode.NONE: 0>, "
                                       "'cudagraph_mode': <CUDAGraphMode.NONE: 0>, 'cudagraph_capture_sizes': []}, "
                                       "device_config=cuda"}) == ("off (cudagraph_mode NONE, 0 capture sizes; the "
                                                                  "server's /server_info)")
    assert told_graphs({"vllm_config": "model='m'"}) is None and told_graphs("Not Found") is None


def with_eager(eager: bool | None, user: bool | None) -> config.ModelConfig:
    cfg = config.load(None)
    sampler = cfg.sampler.model_copy(update={"engine_args": {} if user is None else {"enforce_eager": user},
                                             **({} if eager is None else {"enforce_eager": eager})})
    return cfg.model_copy(update={"sampler": sampler})


@pytest.mark.parametrize(("eager", "user", "on"), [(True, None, False), (False, None, True), (True, False, True),
                                                   (False, True, False)])
def test_a_started_server_records_graphs_from_the_flags_it_was_started_with(eager: bool, user: bool | None,
                                                                            on: bool) -> None:
    argv = server_argv(with_eager(eager, user), Path("m"), 1, cuda=True)
    setting = started_graphs(argv, cuda=True)
    assert setting.startswith("on") == on and (setting == EAGER) == (not on)
    assert started_graphs(argv, cuda=False) == CPU_GRAPHS  # vLLM-CPU captures none, whatever the flags
    sampler = SimpleNamespace(server=SimpleNamespace(argv=argv, env={}), cuda=True,
                              _call=lambda *a: pytest.fail("a started server without dev mode is not asked"))
    assert VLLMServerSampler._graphs_setting(sampler) == setting  # type: ignore[arg-type]
    table = {r.condition: r for r in lifecycle.derive("vllm-server", {"cuda_graphs": setting}, [])}
    assert (table["CUDA graphs"].status == "covered") == on


def test_a_started_server_in_dev_mode_is_asked() -> None:
    argv = server_argv(with_eager(False, None), Path("m"), 1, cuda=True)
    told = {"vllm_config": "enforce_eager=True, device_config=cuda"}
    sampler = SimpleNamespace(server=SimpleNamespace(argv=argv, env={"VLLM_SERVER_DEV_MODE": "1"}), cuda=True,
                              _call=lambda *a: told)
    assert VLLMServerSampler._graphs_setting(sampler).startswith("off (enforce_eager: true")  # type: ignore[arg-type]


def test_a_strangers_numbers_are_refused_not_converted() -> None:
    """A server's answer is a stranger's: a capture size or token id of thousands of digits (past Python's limit on
    converting them) is no setting and no token, never a traceback."""
    text = ("'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'cudagraph_capture_sizes': [SIZE, 8, 1], "
            "device_config=cuda")
    assert told_graphs({"vllm_config": text.replace("SIZE", "512")}).startswith("on (cudagraph_mode FULL_AND_PIECEWISE")
    assert told_graphs({"vllm_config": text.replace("SIZE", "9" * 5000)}) is None
    huge = {"logprobs": {"tokens": ["token_id:" + "9" * 5000], "token_logprobs": [-1.0]}}
    with pytest.raises(ScoreError, match="expected 1 tokens as token_id:N"):
        generated(huge, 1, "prompt 0")


@pytest.mark.parametrize("body", [b'{"data": [', b'{"n": ' + b"9" * 5000 + b"}"], ids=["malformed", "huge-number"])
def test_a_body_that_is_not_json_is_one_server_error_naming_the_route(server: VLLMStandIn, body: bytes) -> None:
    def answer(h: Any, _: dict[str, Any]) -> bool:
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
        return True

    sampler = attach(server.url)
    try:
        server.overrides["/weight_info"] = answer
        with pytest.raises(ScoreError, match=r"^vLLM server: /weight_info answered non-JSON: \{"):
            sampler._call("/weight_info", None, "weight_info")
    finally:
        sampler.close()
