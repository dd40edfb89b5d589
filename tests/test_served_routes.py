"""The routes of an MoE model's scoring requests over HTTP (issue 52: the `vllm-server` and `sglang` samplers).
vLLM 0.26's `/v1/completions` carries each choice's routed experts as base64 of an `.npy` array (its source:
entrypoints/openai/completion/serving.py and protocol.py, `routed_experts`); SGLang 0.5.16's `/generate`, asked with
`return_routed_experts`, as base64 of the raw int32 bytes of [tokens, num_hidden_layers, top-k] in
`meta_info.routed_experts` (srt/managers/tokenizer_manager.py, srt/state_capturer/routed_experts.py). Stand-in
servers on 127.0.0.1 answer as they do; the GPU runs are a later session's."""

from __future__ import annotations

import base64
import http.server
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lora_parity.backends import moe, vllm_routes
from lora_parity.backends.base import RouteReturningSampler
from lora_parity.backends.fake import FakeTrainer
from lora_parity.backends.sglang import SGLangSampler
from lora_parity.backends.sglang_server import server_argv as sglang_argv
from lora_parity.backends.vllm_server import VLLMServerSampler, server_argv
from lora_parity.models import config
from lora_parity.run import route_replay
from lora_parity.util.errors import ScoreError

from .sglang_server import StandIn as SGLangStandIn
from .sglang_server import send_json
from .test_strangers import Heard

pytestmark = pytest.mark.unit

LAYERS, K = 2, 2


def npy(array: Any, allow_pickle: bool = False) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def routed(seq: list[int]) -> Any:
    """What the stand-in engine routes each token to: experts (token + layer) % 8 and the next, uint8 as vLLM sends."""
    return np.array([[[(t + layer) % 8, (t + layer + 1) % 8] for layer in range(LAYERS)] for t in seq], dtype=np.uint8)


class StandIn(Heard):
    """vLLM's OpenAI server as the sampler calls it: /v1/models, and /v1/completions with prompt logprobs
    (-0.1 x the token id) and, where `routes` is on, every prompt's routed experts."""

    def __init__(self, routes: bool) -> None:
        self.routes = routes
        self.completions: list[dict[str, Any]] = []
        super().__init__(self.reply)

    def reply(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if h.command == "GET":
            send_json(h, 200, {"data": [{"id": "base"}]})
            return
        body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
        self.completions.append(body)
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        send_json(h, 200, {"choices": [{"index": i, "text": "",
                                        "prompt_logprobs": [None] + [{str(t): {"logprob": -0.1 * t}} for t in seq[1:]],
                                        "routed_experts": npy(routed(seq)) if self.routes else None}
                                       for i, seq in enumerate(prompts)]})


@pytest.fixture
def moe_checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": LAYERS,
                                                      "num_experts": 8, "num_experts_per_tok": K}))
    return tmp_path


@pytest.fixture(params=[True, False], ids=["returns-routes", "no-routes"])
def stand_in(request: pytest.FixtureRequest) -> Iterator[StandIn]:
    server = StandIn(routes=request.param)
    yield server
    server.close()


def test_an_attached_server_that_returns_routes_replays_and_one_that_does_not_says_why(
        stand_in: StandIn, moe_checkpoint: Path) -> None:
    sampler = VLLMServerSampler(config.load("tiny-qwen3-moe"), moe_checkpoint, {}, url=stand_in.url)
    assert isinstance(sampler, RouteReturningSampler)
    assert stand_in.completions[0]["prompt"] == [0, 0]  # asked once, with two tokens
    why = route_replay.unavailable(FakeTrainer, sampler)
    if stand_in.routes:
        assert why is None and sampler.moe_layers == [0, 1]
        scores, routes = sampler.score_with_routes([[3, 4, 5], [6, 7]], None)
        assert scores == [pytest.approx([-0.4, -0.5]), pytest.approx([-0.7])]
        assert routes[0][0] == [[3, 4], [4, 5]] and routes[1][1] == [[0, 7], [0, 1]]
        assert sampler.score([[3, 4, 5]], None) == [pytest.approx([-0.4, -0.5])]  # the same values without routes
    else:
        assert why is not None and "returns no routed experts" in why and "--enable-return-routed-experts" in why
        with pytest.raises(ScoreError, match="returns no routes"):
            sampler.score_with_routes([[1, 2]], None)


def test_a_dense_checkpoint_is_not_asked_for_routes(tmp_path: Path) -> None:
    server = StandIn(routes=False)
    try:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
        sampler = VLLMServerSampler(config.load(None), tmp_path, {}, url=server.url)
        assert server.completions == [] and sampler.traits.routing_unavailable is not None
    finally:
        server.close()


def test_a_server_started_here_returns_routes_for_an_moe_model_on_cuda_only() -> None:
    flag = "--enable-return-routed-experts"
    moe_cfg = config.load("tiny-qwen3-moe")
    assert flag in server_argv(moe_cfg, Path("ckpt"), 8123, cuda=True)
    assert flag not in server_argv(moe_cfg, Path("ckpt"), 8123, cuda=False)
    assert flag not in server_argv(config.load(None), Path("ckpt"), 8123, cuda=True)  # dense
    off = moe_cfg.model_copy(update={"sampler": moe_cfg.sampler.model_copy(update={"engine_args": {
        vllm_routes.ENGINE_ARG: False}})})
    argv = server_argv(off, Path("ckpt"), 8123, cuda=True)
    assert flag not in argv and "--no-enable-return-routed-experts" in argv  # the user's word stands


def test_a_server_started_here_on_the_cpu_or_told_not_to_says_why(moe_checkpoint: Path) -> None:
    def setup(cuda: bool, engine_args: dict[str, Any]) -> str | None:
        cfg = config.load("tiny-qwen3-moe")
        sampler = object.__new__(VLLMServerSampler)
        sampler.cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"engine_args": engine_args})})
        sampler.server, sampler.cuda, sampler.moe_layers = object(), cuda, []  # type: ignore[assignment]
        return sampler._routes_setup(moe_checkpoint)

    assert setup(cuda=False, engine_args={}) == moe.VLLM_ROUTING_UNAVAILABLE
    assert "without --enable-return-routed-experts" in (setup(True, {vllm_routes.ENGINE_ARG: False}) or "")
    assert setup(cuda=True, engine_args={}) is None


@pytest.mark.parametrize("bad", [
    npy(np.array([{"a": 1}], dtype=object), allow_pickle=True),  # a pickle: never read
    npy(np.zeros((3, 2, 2), dtype=np.float32)),  # not expert ids
    npy(np.zeros((3, 2), dtype=np.int32)),  # not [tokens, layers, top-k]
    "not base64 at all!",
    base64.b64encode(b"\x93NUMPY garbage").decode(),
    12,
])
def test_routes_that_are_not_an_integer_array_of_three_axes_are_a_score_error(bad: Any) -> None:
    with pytest.raises(ScoreError, match="routed experts of sequence 4"):
        vllm_routes.decoded(bad, 4)
    assert vllm_routes.decoded(None, 4) is None
    good = vllm_routes.decoded(npy(routed([1, 2, 3])), 4)
    assert good.shape == (3, LAYERS, K) and good.dtype == np.uint8


def int32_b64(array: Any) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")


@pytest.mark.parametrize("returns", [True, False], ids=["returns-routes", "no-routes"])
def test_an_attached_sglang_server_that_returns_routes_replays_and_one_that_does_not_says_why(
        returns: bool, moe_checkpoint: Path) -> None:
    server = SGLangStandIn()
    asked: list[dict[str, Any]] = []

    def with_routes(h: http.server.BaseHTTPRequestHandler, body: dict[str, Any]) -> bool:
        asked.append(body)
        status, answer = server.answer("POST", "/generate", body)
        if returns and body.get("return_routed_experts"):
            answer["meta_info"]["routed_experts"] = int32_b64(routed(body["input_ids"]))
        return send_json(h, status, answer)

    server.overrides["/generate"] = with_routes
    try:
        sampler = SGLangSampler(config.load("tiny-qwen3-moe"), moe_checkpoint, {}, url=server.url)
        assert isinstance(sampler, RouteReturningSampler)
        assert asked[0]["input_ids"] == [0, 0] and asked[0]["return_routed_experts"] is True  # asked once
        why = route_replay.unavailable(FakeTrainer, sampler)
        if returns:
            assert why is None and sampler.moe_layers == [0, 1]
            scores, routes = sampler.score_with_routes([[3, 4, 5], [6, 7]], None)
            assert scores == sampler.score([[3, 4, 5], [6, 7]], None)  # the same values without routes
            assert routes[0][0] == [[3, 4], [4, 5]] and routes[1][1] == [[0, 7], [0, 1]]
            assert "return_routed_experts" not in asked[-1]  # plain scoring does not ask
        else:
            assert why is not None and "returns no routed experts" in why
            with pytest.raises(ScoreError, match="returns no routes"):
                sampler.score_with_routes([[1, 2]], None)
    finally:
        server.close()


def test_an_sglang_server_started_here_returns_routes_for_an_moe_model() -> None:
    flag = "--enable-return-routed-experts"
    assert flag in sglang_argv(config.load("tiny-qwen3-moe"), Path("ckpt"), 8124)
    assert flag not in sglang_argv(config.load(None), Path("ckpt"), 8124)  # dense


@pytest.mark.parametrize("bad, match", [
    ("not base64 at all!", "not base64 int32"),
    (int32_b64(np.zeros(7)), r"\(7 ids\) are not \[tokens, 2 layers, top-2\]"),
    (3, "not base64 int32"),
])
def test_raw_routes_that_do_not_fit_the_models_shape_are_a_score_error(bad: Any, match: str) -> None:
    with pytest.raises(ScoreError, match=match):
        vllm_routes.decoded_raw(bad, 1, LAYERS, K)
    assert vllm_routes.decoded_raw(None, 1, LAYERS, K) is None
    good = vllm_routes.decoded_raw(int32_b64(routed([1, 2, 3])), 1, LAYERS, K)
    assert good.shape == (3, LAYERS, K) and good[2].tolist() == [[3, 4], [4, 5]]



def test_a_strangers_checkpoint_or_a_server_that_refuses_the_question_is_not_available_with_why(
        moe_checkpoint: Path) -> None:
    class Refusing(StandIn):
        def reply(self, h: http.server.BaseHTTPRequestHandler) -> None:
            if h.command == "GET":
                send_json(h, 200, {"data": [{"id": "base"}]})
            else:
                send_json(h, 400, {"error": "no such field"})

    cfg = config.load("tiny-qwen3-moe")
    refusing = Refusing(routes=True)
    try:
        why = VLLMServerSampler(cfg, moe_checkpoint, {}, url=refusing.url).traits.routing_unavailable
        assert why is not None and "did not answer a request for routed experts" in why and "400" in why
        (moe_checkpoint / "config.json").write_text(json.dumps({"num_hidden_layers": "many", "num_experts": 8}))
        why = VLLMServerSampler(cfg, moe_checkpoint, {}, url=refusing.url).traits.routing_unavailable
        assert why == "the checkpoint's config.json does not give its layers as numbers"
    finally:
        refusing.close()
