"""The `sglang` sampler: SGLang's server over its native HTTP API, as slime, AReaL and verl run it for
rollouts. GPU only (SGLang has no CPU build); CI tests this client against a stand-in server.

lora-parity starts `python -m sglang.launch_server` itself (`sglang_server`) or attaches to a server
the user runs (`--sampler-url`; nothing is started or stopped). Adapters are loaded with
`/load_lora_adapter` (`lora_name`, `lora_path`; a new name per version), or with `--sync tensors` sent
in memory to `/load_lora_adapter_from_tensors` (the server never reads the folder), and unloaded with
`/unload_lora_adapter` (`lora_name`). SGLang has no in-place reload: `--sync inplace` unloads the name
and loads it again, which mints a new `lora_id` and with it a radix-cache namespace of its own. An
adapter SGLang cannot serve (`ADAPTER_NEEDS`: it would kill the server at its first use) is refused before
it is sent; an unloaded name is not final there (`UNLOAD_RELOADS`).

Scoring follows the alignment rule in `backends/base.py`: `/generate` with `input_ids`,
`return_logprob: true`, `logprob_start_len: 0` and the adapter's name as `lora_path` (none: the base
model). `meta_info.input_token_logprobs` has one `[logprob, token_id, text]` per input token, the
first with logprob null; it is dropped and the rest checked against the sequence. A request whose
logprobs start at 0 never reads the radix cache, so `score_cached` scores the same positions as a
rollout reads them: one request per prefix, `logprob_start_len` at its last token (the prefix before
it may come from the cache) and the next token's logprob asked for with `token_ids_logprob`
(`meta_info.output_token_ids_logprobs[0]`).
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from lora_parity.backends import bounded_http, engine_args, served, sglang_server, vllm_routes
from lora_parity.backends.base import (
    UNSERVABLE,
    AdapterHandle,
    BackendOptions,
    BackendTraits,
    PreflightOptions,
    Routes,
    SamplerBackend,
    Scores,
    Sequences,
)
from lora_parity.backends.served import ServedAdapters
from lora_parity.backends.server_process import ServerProcess
from lora_parity.backends.sglang_state import SGLangEngineState
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models import adapter_files, lora_targets
from lora_parity.models.config import ModelConfig
from lora_parity.models.provenance import redact_secrets, remember_secret
from lora_parity.models.provenance import redact_url as redact
from lora_parity.util.errors import ConfigError, ScoreError
from lora_parity.util.in_flight import InFlight

CACHED_CONCURRENCY = 32
"""Requests in flight at once when scoring through the radix cache (one per prefix)."""
SAME_NAME_RELOAD_REFUSED = ("refuses a load under a loaded name (SGLang answers 400, 'already loaded': an error "
                            "receipt, not a silent keep of the old adapter)")
RELOAD_GETS_FRESH_CACHE = ("keys its radix cache by a lora_id minted at every load (sgl-project/sglang#8261), so an "
                           "unload and load under the same name and path reads none of the old adapter's blocks")
UNLOAD_RELOADS = ("loads an unloaded adapter again from its path when a request names it (sglang 0.5.16 keeps every "
                  "name it loaded, TokenizerManager.lora_ref_cache, and _resolve_lora_path reloads it: 'Reloading "
                  "evicted adapter'), so a score after the unload reads the adapter the name was loaded from: no "
                  "error (seen on the H200)")
ADAPTER_NEEDS = (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("q_proj", "v_proj"), ("up_proj", "gate_proj"))
"""What sglang 0.5.16 needs of an adapter's module paths (srt/lora/lora.py, `normalize_qkv_proj`,
`normalize_gate_up_proj`): it stacks k_proj and v_proj into qkv_proj only beside q_proj, q_proj only with
v_proj (a missing k_proj is zero), and up_proj into gate_up_proj only beside gate_proj (a missing up_proj
is zero). Left unstacked, k/v or up match none of the model's LoRA modules: the load answers 200, then the
scheduler dies at the first request that uses the adapter, taking the server down (seen on the H200 with
an adapter lacking q_proj: benchmarks/gpu-sglang-09560bc.tar.xz); q_proj without v_proj fails the load."""
SERVER_ARGS_RECORDED = ("enable_deterministic_inference", "attention_backend", "sampling_backend", "lora_backend",
                        "disable_radix_cache", "dtype", "max_lora_rank", "max_loras_per_batch", "tp_size",
                        "random_seed", "mem_fraction_static", "chunked_prefill_size", "disable_cuda_graph",
                        "enable_memory_saver", "enable_weights_cpu_backup")
"""The attached or started server's settings that change numbers, read back from `/server_info`
into the receipt as `server.<name>` (only these: that answer also holds the server's API key)."""


def tensor_payload(folder: Path) -> dict[str, Any]:
    """The body of `/load_lora_adapter_from_tensors` for a PEFT folder: `config_dict` (its
    adapter_config.json), `serialized_tensors` (the tensors by name, pickled as torch CPU tensors and
    base64-encoded: SGLang's `MultiprocessingSerializer.deserialize` reads them through its
    `SafeUnpickler`, which admits torch's rebuild functions). Built here from the folder's own
    safetensors file; nothing is unpickled on this side. No `expected_checksums`: sglang 0.5.16 checks
    them, then its scheduler dies logging the match (`TpModelWorker` has no `tp_rank`; seen on the H200,
    benchmarks/gpu-sglang-09560bc.tar.xz), taking the server down."""
    import torch

    config, tensors = adapter_files.read_adapter(folder)
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    named = {k: torch.frombuffer(bytearray(t.data), dtype=dtypes[t.dtype]).reshape(t.shape) if t.data
             else torch.empty(t.shape, dtype=dtypes[t.dtype]) for k, t in tensors.items()}
    return {"config_dict": config,
            "serialized_tensors": base64.b64encode(pickle.dumps(named, protocol=4)).decode("ascii")}


def require_servable(folder: Path) -> None:
    """Refuse (`ScoreError`) an adapter that `ADAPTER_NEEDS` rules out, before the server sees it: loaded,
    it would take the server down at its first use, a user's attached server too."""
    unpaired = lora_targets.unpaired_target(lora_targets.tensor_names(folder), ADAPTER_NEEDS)
    if unpaired is not None:
        path, kind, needed = unpaired
        raise ScoreError(f"SGLang {UNSERVABLE} {kind} but no {needed} in {path} (sglang stacks {kind} with "
                         f"{needed}; without it the load fails or the server dies at the first request): "
                         f"{folder.name} not loaded")


class ServerError(ScoreError):
    """The server answered with an error (its status and body are in the message)."""


def _entry(item: Any, what: str) -> tuple[float | None, int]:
    """A `[logprob, token_id, text]` entry of SGLang's logprob lists, as (logprob, token id)."""
    if not isinstance(item, list | tuple) or len(item) < 2 or not isinstance(item[1], int):
        raise ScoreError(f"SGLang server: {what}: expected [logprob, token_id, text], got {str(item)[:80]}")
    value = item[0]
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                              or not math.isfinite(value)):
        raise ScoreError(f"SGLang server: {what}: logprob {value!r} is not a finite number")
    return (None if value is None else float(value)), item[1]


def _prompt_logprobs(answer: Any, seq: list[int], s: int) -> list[float]:
    """The n - 1 logprobs of an n-token sequence from one `/generate` answer (the alignment rule in
    `backends/base.py`): entry 0 of `input_token_logprobs` is null and dropped; each entry's token
    must be the sequence's (SGLang reports ids >= vocab_size - 1 as 0, which is let through)."""
    entries = (answer.get("meta_info") or {}).get("input_token_logprobs") if isinstance(answer, dict) else None
    if not isinstance(entries, list) or len(entries) != len(seq):
        got = "none" if not isinstance(entries, list) else f"{len(entries)} entries"
        raise ScoreError(f"SGLang server input_token_logprobs for sequence {s}: expected {len(seq)} entries, got {got}")
    out: list[float] = []
    for t, item in enumerate(entries):
        value, token = _entry(item, f"input_token_logprobs[{t}] of sequence {s}")
        if token != seq[t] and token != 0:
            raise ScoreError(f"SGLang server input_token_logprobs for sequence {s}: entry {t} is for token {token}, "
                             f"the sequence has {seq[t]} (misaligned)")
        if (t == 0) != (value is None):
            raise ScoreError(f"SGLang server input_token_logprobs for sequence {s}: entry {t} is "
                             f"{'not ' if t == 0 else ''}null")
        if value is not None:
            out.append(value)
    return out


class SGLangSampler(SGLangEngineState, ServedAdapters, SamplerBackend):
    """SGLang's server with LoRA, started here or attached to by URL. It scores the way rollouts read the radix cache
    too (`score_cached`: a `CachedScoringSampler`), generates (`GeneratingSampler`), and sleeps and reports its
    weight version (`SGLangEngineState`)."""

    traits = BackendTraits(served_over_http=True, same_name_reload_refused=SAME_NAME_RELOAD_REFUSED,
                           reload_gets_fresh_cache=RELOAD_GETS_FRESH_CACHE, at_checkpoint_precision=True,
                           unload_reloads=UNLOAD_RELOADS, adapter_needs=ADAPTER_NEEDS, sleep_unavailable=None,
                           reads_prefix_cache=True)

    @classmethod
    def preflight(cls, opts: PreflightOptions) -> None:
        """`sglang_server.preflight`: installed, or a server at --sampler-url that answers."""
        sglang_server.preflight(opts)

    @classmethod
    def launch_early(cls, cfg: ModelConfig, model_dir: Path, options: BackendOptions) -> ServerProcess | None:
        """Launch the server `create` would (none when attaching to `options.sampler_url`)."""
        if options.sampler_url:
            return None
        return sglang_server.launch_server(cfg, model_dir, options.batch_invariant)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> Self:
        """Start a server for the run (adopt `options.server`, launched early), or attach to `options.sampler_url`."""
        return cls(cfg, model_dir, timings, url=options.sampler_url, api_key_env=options.api_key_env,
                   shared_dir=options.shared_dir, deterministic=options.batch_invariant, launched=options.server)

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], *,
                 url: str | None = None, api_key_env: str | None = None, shared_dir: Path | None = None,
                 deterministic: bool = True, launched: ServerProcess | None = None) -> None:
        self.cfg, self.timings, self.deterministic = cfg, timings, deterministic
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        remember_secret(self.api_key)
        # A folder of this sampler's own under --shared-dir: runs never overwrite each other's adapters.
        self.shared_dir = Path(tempfile.mkdtemp(prefix="lora-parity-", dir=shared_dir)) if shared_dir else None
        self.server: ServerProcess | None = None
        self.clock = InFlight(timings)
        # Served names carry this sampler's own suffix, so that runs attached to one server never
        # collide; `loaded` is what this sampler has on the server (unloaded again on close).
        self.suffix = f"-{os.getpid()}-{time.time_ns() % 10**9}"
        self.loaded: set[str] = set()
        self._ready_lock = threading.Lock()
        self._server_info: dict[str, Any] | None = None
        # Credentials, query and fragment are never sent or recorded: the key goes in a header.
        self.url = redact(url) if url else self._launch(model_dir, launched)
        if self.server is None:  # attached: the server answers now, or the run stops here
            try:
                self._info("model_info")
            except BaseException:
                self.close()
                raise
        self.moe_layers: list[int] = []
        self._route_shape = (0, 0)
        self.traits = replace(self.traits, routing_unavailable=self._routes_setup(model_dir),
                              sleep_unavailable=self._sleep_unavailable())

    def _launch(self, model_dir: Path | None, launched: ServerProcess | None) -> str:
        """Adopt the server the run launched early (unless already stopped), else launch one now; return
        at once: the run loads its trainer while the server starts, the first call waits."""
        if launched is not None and launched.pid is not None:
            self.server = launched
        elif model_dir is None:
            raise ConfigError("the sglang sampler needs a checkpoint to serve")
        else:
            self.server = sglang_server.launch_server(self.cfg, Path(model_dir), self.deterministic)
        return self.server.url

    def wait_ready(self) -> None:
        """Wait (once) for a server started here to answer `/health`; records `sampler.start` (launch to
        healthy) and `sampler.start_wait` (the part the run waited for). On failure the server is stopped."""
        with self._ready_lock:
            server = self.server
            if server is None or server.healthy_at is not None:
                return
            start = time.perf_counter()
            server.wait_healthy()
            self.timings["sampler.start_wait"] = time.perf_counter() - start
            healthy, launched = server.healthy_at, server.launched_at
            assert healthy is not None and launched is not None
            self.timings["sampler.start"] = healthy - launched

    def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any:
        """One HTTP call (`bounded_http`: timeouts, a total deadline, a size cap, no redirects), timed
        under `http.<label>`; an error status, or an answer with `success: false`, raises `ServerError`
        with its body, the API key's value cut out of it wherever the server echoed it."""
        self.wait_ready()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            with self.clock.call(f"http.{label}"):  # wall time: calls from a thread pool overlap
                answer = bounded_http.request(self.url + path, data, headers,
                                              timeout_s=sglang_server.REQUEST_TIMEOUT_S,
                                              deadline_s=sglang_server.REQUEST_DEADLINE_S)
        except bounded_http.HTTPCallError as e:
            raise ServerError(self._redact(self.exited(f"SGLang server: {path}: {e}"))) from None
        text = answer.body.decode("utf-8", errors="replace")
        if answer.status >= 400:
            raise ServerError(self._redact(f"SGLang server: {path} answered {answer.status}: {text[:500]}"))
        try:
            out = json.loads(text) if text.lstrip().startswith(("{", "[")) else text
        except ValueError:
            raise ServerError(self._redact(f"SGLang server: {path} answered {answer.status} with a body that is "
                                           f"not JSON: {text[:200]}")) from None
        if isinstance(out, dict) and out.get("success") is False:
            raise ServerError(self._redact(f"SGLang server: {path} answered success false: {text[:500]}"))
        return out

    def _info(self, name: str) -> Any:
        """GET `/model_info` or `/server_info`; a release before 0.5 has only `/get_<name>` (0.5.16 serves
        both, the old one deprecated), asked where the new one answers 404."""
        try:
            return self._call(f"/{name}", None, name)
        except ServerError as e:
            if f"/{name} answered 404" not in str(e):
                raise
        return self._call(f"/get_{name}", None, name)

    def _redact(self, text: str) -> str:
        return " ".join(redact_secrets(text, self.api_key).split())

    def _generate(self, input_ids: Any, sampling: dict[str, Any], adapter: AdapterHandle | None, label: str,
                  **extra: Any) -> Any:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                                "return_text_in_logprobs": False, **extra}
        if adapter is not None:
            body["lora_path"] = adapter.name if isinstance(input_ids[0], int) else [adapter.name] * len(input_ids)
        return self._call("/generate", body, label)

    def _routes_setup(self, model_dir: Path | None) -> str | None:
        """Why this server returns no routes (`served.route_setup`; None: it does): one started here gets
        --enable-return-routed-experts for an MoE model (`sglang_server.server_argv`); an attached one is asked once."""
        def ask() -> Any:
            answer = self._generate([0, 0], {"max_new_tokens": 1, "temperature": 0.0}, None, "routes_probe",
                                    return_routed_experts=True)
            return (answer.get("meta_info") or {}).get("routed_experts")

        why, fields, self.moe_layers = served.route_setup(self.cfg, model_dir, "", ask if self.server is None else None)
        if why is None:
            try:
                self._route_shape = (int(fields["num_hidden_layers"]), int(fields["num_experts_per_tok"]))
            except (KeyError, TypeError, ValueError):
                return "the checkpoint's config.json does not give its layers and top-k as numbers"
        return why

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Prompt logprobs per the alignment rule in `backends/base.py`: one `/generate` per sequence (or
        `scoring.batch_size` per request), `logprob_start_len: 0`, one greedy token (not used)."""
        return [_prompt_logprobs(a, seq, s) for s, (seq, a) in enumerate(self._answers(sequences, adapter, False))]

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`RouteReturningSampler`: `score`, and the experts the same requests routed each token to in every MoE
        layer (`meta_info.routed_experts`, `vllm_routes.decoded_raw`)."""
        if self.traits.routing_unavailable:
            raise ScoreError(f"SGLang server returns no routes here: {self.traits.routing_unavailable}")
        pairs = self._answers(sequences, adapter, True)
        arrays = [vllm_routes.decoded_raw((a.get("meta_info") or {}).get("routed_experts"), s, *self._route_shape)
                  for s, (_, a) in enumerate(pairs)]
        scores = [_prompt_logprobs(a, seq, s) for s, (seq, a) in enumerate(pairs)]
        return scores, vllm_routes.routes_of(arrays, sequences, self.moe_layers)

    def _answers(self, sequences: Sequences, adapter: AdapterHandle | None,
                 routes: bool) -> list[tuple[list[int], Any]]:
        batch = self.cfg.scoring.batch_size
        out: list[tuple[list[int], Any]] = []
        extra: dict[str, Any] = {"return_routed_experts": True} if routes else {}
        for start in range(0, len(sequences), batch):
            group = sequences[start:start + batch]
            answer = self._generate(group[0] if batch == 1 else group, {"max_new_tokens": 1, "temperature": 0.0},
                                    adapter, "generate", logprob_start_len=0, **extra)
            answers = [answer] if batch == 1 else answer
            if not isinstance(answers, list) or len(answers) != len(group):
                raise ScoreError(f"SGLang server: /generate answered {type(answers).__name__} for a batch of "
                                 f"{len(group)}")
            out += [(list(seq), a if isinstance(a, dict) else {}) for seq, a in zip(group, answers, strict=True)]
        return out

    def _forced_next(self, prefix: list[int], token: int, adapter: AdapterHandle | None) -> float:
        answer = self._generate(prefix, {"max_new_tokens": 1, "temperature": 0.0}, adapter, "generate_cached",
                                logprob_start_len=len(prefix) - 1, token_ids_logprob=[token])
        rows = (answer.get("meta_info") or {}).get("output_token_ids_logprobs") if isinstance(answer, dict) else None
        first = rows[0] if isinstance(rows, list) and rows else None
        for item in first if isinstance(first, list) else []:
            value, token_id = _entry(item, "output_token_ids_logprobs[0]")
            if token_id == token and value is not None:
                return value
        raise ScoreError(f"SGLang server: the logprob of token {token} after a {len(prefix)}-token prefix was not "
                         f"returned (output_token_ids_logprobs: {str(rows)[:80]})")

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Same values as `score` (entry t = log p(s[t+1] | s[:t+1])), computed as a rollout reads them:
        one request per prefix, through the radix cache, the next token's logprob asked for by id."""
        with ThreadPoolExecutor(CACHED_CONCURRENCY) as pool:
            return [list(pool.map(lambda t, seq=seq: self._forced_next(seq[:t + 1], seq[t + 1], adapter),
                                  range(len(seq) - 1))) for seq in sequences]

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """`GeneratingSampler.generate`: one `/generate` per prompt, temperature 1 over the whole vocabulary,
        EOS ignored, `sampling_seed` seed + i; the prompt's logprobs as `score`'s, then each generated
        token's (`output_token_logprobs`)."""
        sequences: Sequences = []
        scores: Scores = []
        for i, prompt in enumerate(prompts):
            sampling = {"max_new_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                        "ignore_eos": True, "sampling_seed": seed + i}
            answer = self._generate(list(prompt), sampling, adapter, "generate_sampled", logprob_start_len=0)
            rows = (answer.get("meta_info") or {}).get("output_token_logprobs") if isinstance(answer, dict) else None
            if not isinstance(rows, list) or len(rows) != max_tokens:
                got = "none" if not isinstance(rows, list) else f"{len(rows)}"
                raise ScoreError(f"SGLang server: prompt {i}: expected {max_tokens} generated tokens, got {got}")
            generated = [_entry(row, f"output_token_logprobs of prompt {i}") for row in rows]
            ids = [token for _, token in generated]
            if answer.get("output_ids") not in (None, ids):
                raise ScoreError(f"SGLang server: prompt {i}: output_ids differ from output_token_logprobs' tokens")
            if any(value is None for value, _ in generated):
                raise ScoreError(f"SGLang server: prompt {i}: a generated token has a null logprob")
            sequences.append(list(prompt) + ids)
            scores.append(_prompt_logprobs(answer, list(prompt), i) + [float(v) for v, _ in generated if v is not None])
        return sequences, scores

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """Load the PEFT folder under `name` (with this sampler's suffix). With `inplace`, a name this
        sampler has loaded is unloaded first: SGLang has no in-place reload."""
        require_servable(Path(directory))
        path = self._served_path(directory)
        return self._load("/load_lora_adapter", {"lora_path": str(path)}, name, adapter_id, path, inplace)

    def publish_tensors(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """`--sync tensors`: send the PEFT folder's tensors and config to `/load_lora_adapter_from_tensors`
        under `name` (with this sampler's suffix), the server never reading the folder: what an RL stack
        that holds the adapter in memory does. With `inplace`, a name this sampler has loaded is unloaded
        first."""
        require_servable(Path(directory))
        # The handle's path is the folder the tensors were read from (the changed-on-disk check reads it).
        return self._load("/load_lora_adapter_from_tensors", tensor_payload(Path(directory)), name, adapter_id,
                          Path(directory), inplace)

    def _load(self, endpoint: str, body: dict[str, Any], name: str, adapter_id: int, path: Path,
              inplace: bool) -> AdapterHandle:
        """POST `body` to `endpoint` under `name` with this sampler's suffix; with `inplace`, a name this
        sampler has loaded is unloaded first (SGLang has no in-place reload)."""
        served = name if name.endswith(self.suffix) else name + self.suffix
        if inplace and served in self.loaded:
            self.retire(AdapterHandle(served, adapter_id, path))
        self._call(endpoint, {"lora_name": served, **body}, f"{endpoint.lstrip('/')}.{name.removesuffix(self.suffix)}")
        self.loaded.add(served)
        return AdapterHandle(served, adapter_id, path)

    def retire(self, handle: AdapterHandle) -> None:
        """Unload `handle` from the server; a name the server no longer has is already retired."""
        try:
            self._call("/unload_lora_adapter", {"lora_name": handle.name},
                       f"unload_lora_adapter.{handle.name.removesuffix(self.suffix)}")
        except ServerError as e:
            if "does not exist" not in str(e):
                raise
        self.loaded.discard(handle.name)

    def _recorded_server_args(self) -> dict[str, Any]:
        """`SERVER_ARGS_RECORDED` and the version from `/server_info`, asked once."""
        if self._server_info is None:
            try:
                answer = self._info("server_info")
            except ScoreError:
                answer = {}
            answer = answer if isinstance(answer, dict) else {}
            args = {k: served.server_value(answer[k], self.api_key) for k in SERVER_ARGS_RECORDED
                    if k in answer and isinstance(answer[k], str | int | float | bool | None)}
            self._server_info = {"version": served.server_text(answer.get("version", "unknown"), self.api_key),
                                 "args": args}
        return self._server_info

    def info(self) -> BackendInfo:
        recorded = self._recorded_server_args()
        settings: dict[str, Any] = {
            "device": "cuda",
            "server": "started by lora-parity" if self.server else f"attached at {redact(self.url)}",
            "scoring": "/generate with input_ids, one request per "
                       + ("sequence" if self.cfg.scoring.batch_size == 1 else f"{self.cfg.scoring.batch_size} "
                          "sequences") + ", logprob_start_len=0; cached: one request per prefix, token_ids_logprob",
            "sync": "/load_lora_adapter or /load_lora_adapter_from_tensors (--sync tensors), /unload_lora_adapter "
                    "(inplace: unload, then load under the same name)",
            **{f"server.{k}": v for k, v in recorded["args"].items()}, **sglang_server.deployment(recorded["args"])}
        if self.cfg.sampler.engine_args:  # the user's server arguments, on the command line of the server started here
            settings["engine_args"] = engine_args.record(self.cfg.sampler.engine_args)
        if self.server is not None:
            settings["deterministic_inference"] = "--enable-deterministic-inference" in self.server.argv
            settings["argv"] = " ".join(a for a in self.server.argv[1:] if not a.startswith(("/", "\\")))
        return BackendInfo(backend="sglang", versions={"sglang": recorded["version"]}, settings=settings)
