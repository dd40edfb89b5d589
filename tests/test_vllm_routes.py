"""vLLM's routed experts as the `vllm` sampler reads them on CUDA (issue 52's GPU part): the MoE layers from
config.json, each pass's [tokens, layers, top-k] arrays turned into the routes the HF trainer replays, and the engine
started so for an MoE model only. Stand-ins of vLLM 0.26's outputs (its source: outputs.py, `CompletionOutput.
routed_experts`); the GPU run is a later session's."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lora_parity.backends import vllm_routes
from lora_parity.backends.base import RouteReturningSampler, RoutingIntrospection
from lora_parity.backends.vllm import VLLMSampler
from lora_parity.backends.vllm_options import engine_options
from lora_parity.models import config
from lora_parity.run import route_replay
from lora_parity.util.errors import ScoreError

pytestmark = pytest.mark.unit


def test_the_moe_layers_follow_each_familys_config() -> None:
    assert vllm_routes.moe_layers({"num_hidden_layers": 4, "mlp_only_layers": [0]}) == [1, 2, 3]
    assert vllm_routes.moe_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == [1, 3]
    assert vllm_routes.moe_layers({"num_hidden_layers": 4, "first_k_dense_replace": 1}) == [1, 2, 3]
    assert vllm_routes.moe_layers({"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
                                   "first_k_dense_replace": 2}) == [1, 2]  # said per layer: that wins
    assert vllm_routes.moe_layers({"num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}) == [2, 4]


def arrays(sequences: list[list[int]], layers: int, k: int, seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [np.stack([[rng.permutation(8)[:k] for _ in range(layers)] for _ in seq]) for seq in sequences]


def test_routes_are_each_tokens_sorted_experts_in_the_moe_layers_only() -> None:
    sequences = [[1, 2, 3], [4, 5]]
    raw = arrays(sequences, layers=3, k=2)
    raw[0][:, 0] = 0  # layer 0 is dense: vLLM's capture buffer stays zero there
    routes = vllm_routes.routes_of(raw, sequences, [1, 2])
    assert [len(r) for r in routes] == [3, 2] and all(len(t) == 2 for r in routes for t in r)
    assert routes[0][1][0] == sorted(int(e) for e in raw[0][1][1])
    assert routes[1][0][1] == sorted(int(e) for e in raw[1][0][2])


@pytest.mark.parametrize("bad", [None, np.zeros((2, 3, 2), dtype=np.int32), np.zeros((3, 1, 2), dtype=np.int32)])
def test_a_missing_or_short_routes_array_is_a_score_error_naming_the_engine_argument(bad: Any) -> None:
    with pytest.raises(ScoreError, match="enable_return_routed_experts"):
        vllm_routes.routes_of([bad], [[1, 2, 3]], [1, 2])


def test_the_engine_returns_routes_for_an_moe_model_on_cuda_only_and_the_user_can_turn_it_off() -> None:
    moe = config.load("tiny-qwen3-moe")
    assert engine_options(moe, "ckpt", cuda=True)[vllm_routes.ENGINE_ARG] is True
    assert vllm_routes.ENGINE_ARG not in engine_options(moe, "ckpt", cuda=False)
    assert vllm_routes.ENGINE_ARG not in engine_options(config.load(None), "ckpt", cuda=True)  # dense
    off = moe.model_copy(update={"sampler": moe.sampler.model_copy(update={"engine_args": {
        vllm_routes.ENGINE_ARG: False}})})
    assert engine_options(off, "ckpt", cuda=True)[vllm_routes.ENGINE_ARG] is False


class FakeLLM:
    """vLLM's `LLM.generate` as the sampler calls it: prompt logprobs, and routed experts per request."""

    def __init__(self, layers: int, k: int) -> None:
        self.layers, self.k, self.calls = layers, k, 0

    def generate(self, prompts: list[dict[str, Any]], params: Any, lora_request: Any, use_tqdm: bool) -> list[Any]:
        self.calls += 1
        out = []
        for p in prompts:
            seq = p["prompt_token_ids"]
            plp = [None] + [{tok: SimpleNamespace(logprob=-0.1 * tok)} for tok in seq[1:]]
            routed = np.stack([[[(tok + layer) % 8, (tok + layer + 1) % 8][:self.k] for layer in range(self.layers)]
                               for tok in seq])
            out.append(SimpleNamespace(prompt_logprobs=plp, outputs=[SimpleNamespace(routed_experts=routed)]))
        return out


def sampler_on_cuda(returns: bool) -> VLLMSampler:
    cfg = config.load("tiny-qwen3-moe")
    engine = object.__new__(VLLMSampler)
    engine.cfg, engine.cuda, engine.pack, engine.params = cfg, True, 0, None
    engine.engine_args = {vllm_routes.ENGINE_ARG: True} if returns else {}
    engine._TokensPrompt = dict
    engine.llm = FakeLLM(layers=2, k=2)
    engine.traits = replace(VLLMSampler.traits, routing_unavailable=engine._routing_unavailable())
    engine.moe_layers = [0, 1] if returns else []
    return engine


def test_a_cuda_engine_that_returns_routes_replays_and_one_that_does_not_says_why() -> None:
    engine = sampler_on_cuda(returns=True)
    assert isinstance(engine, RouteReturningSampler) and isinstance(engine, RoutingIntrospection)
    scores, routes = engine.score_with_routes([[3, 4, 5], [6, 7]], None)
    assert scores == [pytest.approx([-0.4, -0.5]), pytest.approx([-0.7])]
    assert engine.llm.calls == 2  # one request per sequence (an MoE model)
    assert routes[0][0] == [[3, 4], [4, 5]] and routes[1][1] == [[0, 7], [0, 1]]
    assert route_replay.unavailable(route_replay_trainer(), engine) is None
    dense = sampler_on_cuda(returns=False)
    why = route_replay.unavailable(route_replay_trainer(), dense)
    assert why is not None and "without enable_return_routed_experts" in why
    with pytest.raises(ScoreError, match="returns no routes"):
        dense.score_with_routes([[1, 2]], None)


def route_replay_trainer() -> Any:
    from lora_parity.backends.fake import FakeTrainer

    return FakeTrainer


def test_the_many_experts_shape_routes_in_all_sixteen_layers_and_replays_where_both_sides_can() -> None:
    from lora_parity.models.synthetic import hf_config_fields

    cfg = config.load("qwen3-moe-64x8-synth")
    assert cfg.model.synthetic is not None and cfg.model.synthetic.moe is not None
    assert (cfg.model.synthetic.moe.num_experts, cfg.model.synthetic.moe.num_experts_per_tok) == (64, 8)
    assert vllm_routes.moe_layers(hf_config_fields(cfg.model.synthetic)) == list(range(16))
    assert cfg.route_replay == "auto" and cfg.model.dtype == "bfloat16"
