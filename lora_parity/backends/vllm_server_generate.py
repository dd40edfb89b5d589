"""The vllm-server sampler's decode path and CUDA graphs (issue 44, the engine as deployed, over HTTP).

`generate` is the in-process sampler's request sent to `/v1/completions` (vLLM 0.26 and 0.32 take the same fields):
a token-id prompt, the adapter's served name as `model`, temperature 1, request i seeded with `seed + i`, exactly
`max_tokens` tokens (`min_tokens`, `ignore_eos`), `logprobs: 0` (the sampled token's logprob) and `prompt_logprobs: 0`
in the same request. The server runs with --skip-tokenizer-init, so the tokens come back as "token_id:N"
(`return_tokens_as_token_ids`, in both versions; 0.32's `return_token_ids` is not in 0.26).

`cuda_graphs` records what the server does, never a guess: an attached server only where its dev-mode `/server_info`
reports its compilation config; a server started here from the flags it was started with (`enforce_eager`, the
config's or the user's `--engine-arg`), or from `/server_info` where it runs in dev mode. vLLM captures graphs for
prefill and decode batches alike (piecewise), so prompt scoring runs through them too.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lora_parity.backends import engine_args
from lora_parity.backends.base import AdapterHandle, Scores, Sequences
from lora_parity.backends.vllm_server_state import DEV_MODE
from lora_parity.util.errors import ScoreError

if TYPE_CHECKING:
    from lora_parity.models.config import ModelConfig

TOKEN_ID = re.compile(r"token_id:(\d{1,12})")
"""A generated token as vLLM writes it with `return_tokens_as_token_ids` (a longer number is no token id: refused)."""
CPU_GRAPHS = "off (vLLM-CPU captures no CUDA graphs: its platform empties cudagraph_capture_sizes)"
EAGER = "off (enforce_eager: true, as lora-parity started the server)"
COMPILED = ("on (enforce_eager: false, as lora-parity started the server: vLLM compiles the model and captures CUDA "
            "graphs where the model allows them; the capture sizes are reported by its dev-mode /server_info only)")
NOT_TOLD = ("not recorded (attached server: its /server_info, served in dev mode only, reported no compilation "
            "config)")


def prompt_row(seq: list[int], choice: dict[str, Any], what: str) -> list[float]:
    """`seq`'s scores from a choice's `prompt_logprobs` (entry 0, null, dropped: the alignment rule)."""
    plp = choice.get("prompt_logprobs")
    if not isinstance(plp, list) or len(plp) != len(seq) or plp[0] is not None:
        got = f"{len(plp)} entries" if isinstance(plp, list) else "null"
        raise ScoreError(f"vLLM server prompt_logprobs for {what}: expected {len(seq)} entries starting with null, "
                         f"got {got}")
    try:
        return [float(plp[t][str(seq[t])]["logprob"]) for t in range(1, len(seq))]
    except (KeyError, TypeError, ValueError):
        raise ScoreError(f"vLLM server prompt_logprobs for {what}: a prompt token's logprob is missing") from None


def generated(choice: dict[str, Any], max_tokens: int, what: str) -> tuple[list[int], list[float]]:
    """The generated token ids and the logprobs they were sampled with, from a choice's `logprobs`
    ("token_id:N" tokens); `ScoreError` unless exactly `max_tokens` came back, each with its logprob."""
    logprobs = choice.get("logprobs") or {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    ids = [TOKEN_ID.fullmatch(t) if isinstance(t, str) else None for t in tokens or []]
    if (not isinstance(values, list) or len(ids) != max_tokens or len(values) != max_tokens
            or None in ids or not all(isinstance(v, int | float) for v in values)):
        got = f"{len(ids)} tokens" if tokens is not None else "no tokens"
        raise ScoreError(f"vLLM server generation for {what}: expected {max_tokens} tokens as token_id:N, each with "
                         f"its logprob; got {got}")
    return [int(m[1]) for m in ids if m is not None], [float(v) for v in values]


def told_graphs(answer: Any) -> str | None:
    """The `cuda_graphs` setting from `GET /server_info`'s `vllm_config` text (vLLM's `str(VllmConfig)`: its
    compilation config's `cudagraph_mode` and `cudagraph_capture_sizes`, read as the in-process sampler reads the
    engine's), or None where it reports neither those nor eager mode."""
    text = answer.get("vllm_config") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        return None
    mode = re.search(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)", text)
    sizes = re.search(r"'cudagraph_capture_sizes': \[([\d,\s]*)\]", text)
    if mode is None or sizes is None:
        eager = re.search(r"\benforce_eager=True\b", text)
        return "off (enforce_eager: true, as the server's /server_info reports)" if eager else None
    device = re.search(r"\bdevice_config=(\w+)", text)
    compiled = re.search(r"'mode': <CompilationMode\.(\w+)", text)
    items = [x.strip() for x in sizes[1].split(",") if x.strip()]
    if not all(re.fullmatch(r"\d{1,9}", x) for x in items):  # a server's text: no size is a thousand-digit number
        return None
    config = SimpleNamespace(cudagraph_mode=mode[1], mode=compiled[1] if compiled else "",
                             cudagraph_capture_sizes=[int(x) for x in items])
    truth = engine_args.graphs_truth(config, device[1] if device else "cuda")
    return f"{truth[:-1]}; the server's /server_info)"


def started_graphs(argv: list[str], cuda: bool) -> str:
    """The `cuda_graphs` setting of a server started here, from its own command line (the last of --enforce-eager and
    --no-enforce-eager wins, as vLLM's argument parser reads it; neither: vLLM's default, compiled)."""
    if not cuda:
        return CPU_GRAPHS
    flags = [a for a in argv if a in ("--enforce-eager", "--no-enforce-eager")]
    return EAGER if flags and flags[-1] == "--enforce-eager" else COMPILED


class VLLMServerGeneration:
    """`GeneratingSampler` and the `cuda_graphs` setting for the vllm-server sampler (a mixin: it needs the sampler's
    `_completion`, `_call`, `base_model`, `server`, `cuda` and `cfg`)."""

    if TYPE_CHECKING:
        server: Any
        cuda: bool
        cfg: ModelConfig

        @property
        def base_model(self) -> str: ...

        def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any: ...

        def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]: ...

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """One `/v1/completions` per prompt: the user's sampling parameters (`SamplingSpec.request`), request i seeded
        with `seed + i`, exactly `max_tokens` tokens (EOS ignored), `logprobs: 0` and `prompt_logprobs: 0` in the same
        request; see `GeneratingSampler`."""
        model = adapter.name if adapter is not None else self.base_model
        sampling = self.cfg.sampler.sampling.request(max_tokens, self.cfg.sampler.engine_args)
        sequences: Sequences = []
        logprobs: Scores = []
        for i, prompt in enumerate(prompts):
            choices = self._completion(list(prompt), model, "generate", seed=seed + i, logprobs=0, prompt_logprobs=0,
                                       return_tokens_as_token_ids=True, **sampling)
            if len(choices) != 1:
                raise ScoreError(f"vLLM server generation for prompt {i}: expected one choice, got {len(choices)}")
            tokens, sampled = generated(choices[0], max_tokens, f"prompt {i}")
            sequences.append(list(prompt) + tokens)
            logprobs.append(prompt_row(list(prompt), choices[0], f"prompt {i}") + sampled)
        return sequences, logprobs

    def _graphs_setting(self) -> str:
        """What the receipt records as `cuda_graphs` (`verdict.lifecycle` reads it): see the module's docstring."""
        dev_mode = self.server is None or self.server.env.get(DEV_MODE) == "1"
        if dev_mode:
            try:
                told = told_graphs(self._call("/server_info", None, "server_info"))
            except ScoreError:  # 404 without dev mode
                told = None
            if told is not None:
                return told
        return NOT_TOLD if self.server is None else started_graphs(list(self.server.argv), self.cuda)
