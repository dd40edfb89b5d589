"""The vllm-server sampler's cached scoring (`CachedScoringSampler`; the phases stale_cached and updated_cached).

vLLM never reads the prefix cache for a prompt_logprobs request, and its OpenAI server takes no
`skip_reading_prefix_cache`: a score read through the cache is read as a rollout reads it, one request per prefix,
its next token forced (`allowed_token_ids`, `logprobs: 0`), the requests in flight together. That forced token's
logprob is the raw one only under `logprobs_mode=raw_logprobs`: under any other mode the sampler is built without
cached scoring (`engine_args.cached_scoring_off`, its `traits.reads_prefix_cache`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lora_parity.backends.base import AdapterHandle, Scores, Sequences
from lora_parity.util.errors import ScoreError

CACHED_CONCURRENCY = 32
"""Cached-scoring requests in flight at once."""


class VLLMServerCachedScoring:
    """`score_cached` for the vllm-server sampler (a mixin: it needs the sampler's `_completion` and `base_model`)."""

    if TYPE_CHECKING:
        traits: Any

        @property
        def base_model(self) -> str: ...

        def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]: ...

    def _forced_next(self, prefix: list[int], token: int, model: str) -> float:
        choice = self._completion(prefix, model, "completions_cached", logprobs=0, allowed_token_ids=[token],
                                  return_tokens_as_token_ids=True)[0]
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("tokens") != [f"token_id:{token}"]:
            raise ScoreError(f"vLLM server: forced token {token} not returned ({logprobs.get('tokens')})")
        return float(logprobs["token_logprobs"][0])

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Same values as `score` (entry t = log p(s[t+1] | s[:t+1])), computed as a rollout reads
        them: one request per prefix, reading the prefix cache, the next token forced."""
        if not self.traits.reads_prefix_cache:
            raise ScoreError("vLLM server: no cached scoring under this logprobs mode (engine_args.cached_scoring_off)")
        model = adapter.name if adapter is not None else self.base_model
        with ThreadPoolExecutor(CACHED_CONCURRENCY) as pool:
            return [list(pool.map(lambda t, seq=seq: self._forced_next(seq[:t + 1], seq[t + 1], model),
                                  range(len(seq) - 1))) for seq in sequences]
