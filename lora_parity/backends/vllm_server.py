"""The `vllm-server` sampler: vLLM's OpenAI-compatible server, over HTTP, as most RL stacks run it.

lora-parity starts `vllm serve` itself (see `server_process`) with the engine options of the in-process `vllm` sampler,
or attaches to a server the user runs (`--sampler-url`; nothing is started or stopped). Adapters are pushed with
`/v1/load_lora_adapter` (a new name per version, or the same name with `load_inplace`) and retired with
`/v1/unload_lora_adapter` (the server must allow runtime LoRA updating: `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).

Scoring follows the alignment rule in `backends/base.py`: `/v1/completions` with token-id prompts, `max_tokens: 1` and
`prompt_logprobs: 0`, the adapter chosen by its name as `model`; the server's entry 0 is null and dropped. vLLM never
reads the prefix cache for a prompt_logprobs request, so `score_cached` scores the same positions the way a rollout
reads them: one request per prefix, the next token forced with `allowed_token_ids` and its raw logprob returned
(`logprobs: 0`), which does read the cache. On an MoE model each choice also carries its tokens' experts
(`routed_experts`; a server started here on CUDA gets --enable-return-routed-experts), for route replay.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

from lora_parity.backends import bounded_http, engine_args, moe, served, sleep, vllm_routes, vllm_server_state
from lora_parity.backends.base import (
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
from lora_parity.backends.server_process import ServerProcess, free_port
from lora_parity.backends.vllm_options import expert_lora, lora_modules, max_lora_rank, returns_routes
from lora_parity.backends.vllm_server_cached import VLLMServerCachedScoring, server_flags
from lora_parity.backends.vllm_server_generate import VLLMServerGeneration, prompt_row
from lora_parity.backends.vllm_server_mixed import VLLMServerMixedBatch
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.evidence.receipt_io import one_line
from lora_parity.models.config import DTYPES, TARGET_NAME, ModelConfig
from lora_parity.models.provenance import redact_secrets, remember_secret
from lora_parity.models.provenance import redact_url as redact
from lora_parity.util import env, scratch
from lora_parity.util.errors import ConfigError, ScoreError
from lora_parity.util.in_flight import InFlight

REQUEST_TIMEOUT_S = 300.0
"""Longest wait on the socket within one call (the first scoring calls on a fresh CPU server compile)."""
REQUEST_DEADLINE_S = 900.0
"""Longest one call may take in all: a server that trickles bytes cannot hold the run longer."""
START_TIMEOUT_S = env.seconds(os.environ, "LORA_PARITY_VLLM_SERVER_START_TIMEOUT", 600.0)
"""Requests in flight at once when scoring through the prefix cache (one per prefix)."""
SAME_NAME_RELOAD_REFUSED = ("refuses a reload under a loaded name without load_inplace (vLLM answers 400: an "
                            "error receipt, not a silent keep of the old adapter)")


class ServerError(ScoreError):
    """The server answered with an error status (its status and body are in the message)."""


def preflight(opts: PreflightOptions) -> None:
    """--sampler-url is http(s) and answers `/health` within seconds; --api-key-env names a set
    variable; --shared-dir exists. Raises `ConfigError`."""
    served.check_options(opts)
    if opts.sampler_url is not None:
        served.check_reachable(opts.sampler_url, "vLLM server")


def refuse_sleep_without_mode(cfg: ModelConfig) -> None:
    """Preflight of a server started here, before its early launch: sleep levels asked on CUDA need the user's
    enable_sleep_mode=true (`sleep.require_sleep_mode`)."""
    sleep.require_sleep_mode(cfg, _has_cuda())


def check_server_args(cfg: ModelConfig) -> None:
    """Every value from a config or an adapter that goes onto `vllm serve`'s command line is what it
    should be (a module name, a dtype), never an option: `ConfigError` otherwise. The configs and
    adapters are checked when read (`config.TARGET_NAME`); this is the last look before a launch."""
    bad = [t for t in cfg.adapter.targets if not TARGET_NAME.fullmatch(t)]
    if bad:
        raise ConfigError(f"LoRA target {one_line(repr(bad[0]))} is not a module name; it would go onto the "
                          "vllm serve command line")
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"dtype {one_line(repr(cfg.model.dtype))} is not one of {', '.join(DTYPES)}")


def server_argv(cfg: ModelConfig, model_dir: Path, port: int, cuda: bool) -> list[str]:
    """`vllm serve` with the run's rank, targets and dtype; LoRA limited to the adapter's own targets
    (the CPU build crashes on batched prompt_logprobs otherwise), prefix caching on (as served). The user's
    `sampler.engine_args` replace lora-parity's defaults key by key (`engine_args.serve_flags`)."""
    check_server_args(cfg)
    rank = max_lora_rank(cfg.adapter.rank)
    user = cfg.sampler.engine_args
    # An absolute path: a folder named like an option (`-x`) can never read as one.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).absolute()),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.model.dtype,
            "--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *lora_modules(cfg),
            *(["--enable-mixed-moe-lora-format"] if expert_lora(cfg) else []),
            "--skip-tokenizer-init", "--seed", "0", *server_flags(),
            # As the in-process engine (`vllm.LLM` logs no stats); no access-log line per request.
            "--disable-log-stats", "--disable-uvicorn-access-log"]
    defaults: dict[str, Any] = {"max_loras": 1, "max_model_len": cfg.sampler.max_model_len,
                                "enable_prefix_caching": True}
    if not cuda:
        # The CPU build's default block of 128 tokens would leave the probes' prefixes (64 to 128
        # tokens) almost no full block to read back, and the prefix-cache phases nothing to test.
        defaults["block_size"] = 32
    if cfg.sampler.enforce_eager:
        defaults["enforce_eager"] = True
    if cfg.sampler.lora_dtype is not None:
        defaults["lora_dtype"] = cfg.sampler.lora_dtype
    if cuda:
        # The in-process engine's GPU settings (vllm_options): without them the server asks for vLLM's default
        # 0.9 of the GPU, which a GPU shared with the trainer (or other runs) does not have free.
        defaults.update(gpu_memory_utilization=cfg.sampler.gpu_memory_utilization,
                        tensor_parallel_size=cfg.sampler.tensor_parallel_size)
        if cfg.sampler.gpu_kv_cache_gib is not None:
            defaults["kv_cache_memory_bytes"] = int(cfg.sampler.gpu_kv_cache_gib * 2**30)
        if returns_routes(cfg, str(model_dir)):  # each request's routes, which the trainer replays (R3)
            defaults[vllm_routes.ENGINE_ARG] = True
    argv += engine_args.serve_flags({**defaults, **user})
    if cfg.model.trust_remote_code:
        argv.append("--trust-remote-code")
    extra = os.environ.get("LORA_PARITY_VLLM_SERVER_ARGS")
    if extra:
        import shlex

        argv += shlex.split(extra)
    return argv + vllm_server_state.server_flags(cfg, cuda, argv)  # the base reload after a level-2 wake


def server_env(cfg: ModelConfig, cuda: bool, batch_invariant: bool = True) -> dict[str, str]:
    """The environment of the server: runtime LoRA updating allowed; on CUDA batch-invariant kernels
    (`VLLM_BATCH_INVARIANT=1`, as the in-process sampler; a value the user set wins); on the CPU the
    in-process sampler's settings (none reserved, an explicit KV cache size) and its uniproc executor,
    its OpenMP threads bound to one core (the last this process may use); a temp dir of its own in
    the run's scratch. The server keeps its engine core in a process of its own (always)."""
    env = dict(os.environ)
    # Its own temp dir, removed with the run's scratch: the IPC sockets vLLM makes there are left
    # behind when the server is ended by a signal.
    env["TMPDIR"] = str(scratch.folder("lora-parity-server-"))
    if cuda and batch_invariant and cfg.sampler.batch_invariant:
        env.setdefault("VLLM_BATCH_INVARIANT", "1")
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(vllm_server_state.server_env(cfg, cuda))  # dev mode where it sleeps: /sleep, /wake_up
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if not cuda:
        # The API server always keeps its engine core in a process of its own; with this unset the
        # CPU build also moves the model into a third process (the multiproc executor), which imports
        # vLLM and torch once more (about 6 s on 2 cores). Set, the model runs in the engine core's
        # process (the uniproc executor), as in the in-process sampler.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # One core for the server's OpenMP threads: it shares the cores with the trainer's process
        # (one torch thread there, see `_one_torch_thread`), and a thread team spread over cores that
        # other processes hold waits at every barrier (the served scoring passes measured about 2x
        # slower with every core bound on 2 loaded cores; one request scores a tiny batch).
        cores = sorted(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[-1]))
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.sampler.kv_cache_gib))))
    return env


def _one_torch_thread() -> None:
    """One torch thread in this process (the trainer's) beside a CPU server: a multi-threaded torch
    here waits at each parallel region for a core the server or another process holds (the
    trainer's forwards measured 10-100x slower on 2 shared cores; one thread: milliseconds, as
    in-process)."""
    import torch

    torch.set_num_threads(1)


def _has_cuda() -> bool:
    if _cpu_only_torch():  # known without importing torch (0.7-0.9 s on 2 cores), which an early launch precedes
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build, read from its `version.py` (`cuda` and `hip`
    both None) without importing it; False where that cannot be told (torch is then asked)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return False
    return len(re.findall(r"^(?:cuda|hip)\b[^=\n]*=\s*None\s*$", text, re.MULTILINE)) == 2


def launch_server(cfg: ModelConfig, model_dir: Path, cuda: bool, batch_invariant: bool = True) -> ServerProcess:
    """Launch `vllm serve` for `cfg` on 127.0.0.1 (port: $LORA_PARITY_VLLM_SERVER_PORT, else a free
    one) and return at once; `ServerProcess.wait_healthy` waits for it."""
    port = int(os.environ.get("LORA_PARITY_VLLM_SERVER_PORT") or free_port())
    server = ServerProcess(server_argv(cfg, Path(model_dir), port, cuda), server_env(cfg, cuda, batch_invariant),
                           port, START_TIMEOUT_S)
    server.launch()
    return server


class VLLMServerSampler(vllm_server_state.VLLMServerEngineState, VLLMServerGeneration, VLLMServerMixedBatch,
                        VLLMServerCachedScoring, ServedAdapters, SamplerBackend):
    """A vLLM OpenAI-compatible server with LoRA, started here or attached to by URL. It scores the way rollouts read
    the prefix cache too (`score_cached`), generates and records its CUDA graphs (`VLLMServerGeneration`), mixes routes
    in a batch (`VLLMServerMixedBatch`), sleeps and reports its weight version (`VLLMServerEngineState`)."""

    traits = BackendTraits(served_over_http=True, same_name_reload_refused=SAME_NAME_RELOAD_REFUSED,
                           at_checkpoint_precision=True, sleep_unavailable=None, mixed_batch_unavailable=None,
                           reads_prefix_cache=True)

    @classmethod
    def preflight(cls, opts: PreflightOptions) -> None:
        """The module's `preflight`."""
        preflight(opts)

    @classmethod
    def built_traits(cls, cfg: ModelConfig) -> BackendTraits:
        """`SamplerBackend.built_traits`: no cached scoring where the logprobs mode hides it (`cached_scoring_off`)."""
        return replace(cls.traits, reads_prefix_cache=engine_args.cached_scoring_off(cfg.sampler.engine_args) is None)

    @classmethod
    def launch_early(cls, cfg: ModelConfig, model_dir: Path, options: BackendOptions) -> ServerProcess | None:
        """Launch the server `create` would (none when attaching to `options.sampler_url`)."""
        if options.sampler_url:
            return None
        return launch_server(cfg, model_dir, _has_cuda(), options.batch_invariant)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> Self:
        """Start a server for the run (adopt `options.server`, launched early), or attach to
        `options.sampler_url`."""
        return cls(cfg, model_dir, timings, url=options.sampler_url, api_key_env=options.api_key_env,
                   shared_dir=options.shared_dir, batch_invariant=options.batch_invariant, launched=options.server)

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], *,
                 url: str | None = None, api_key_env: str | None = None, shared_dir: Path | None = None,
                 batch_invariant: bool = True, launched: ServerProcess | None = None) -> None:
        self.cfg, self.timings, self.batch_invariant = cfg, timings, batch_invariant
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        remember_secret(self.api_key)
        # A folder of this sampler's own under --shared-dir: runs never overwrite each other's adapters.
        self.shared_dir = Path(tempfile.mkdtemp(prefix="lora-parity-", dir=shared_dir)) if shared_dir else None
        self.cuda = _has_cuda()
        self.server: ServerProcess | None = None
        self.clock = InFlight(timings)
        # Served names carry this sampler's own suffix, so that runs attached to one server never
        # collide; `loaded` is what this sampler has on the server (unloaded again on close).
        self.suffix = f"-{os.getpid()}-{time.time_ns() % 10**9}"
        self.loaded: set[str] = set()
        self._ready_lock = threading.Lock()
        self._base_model_id: str | None = None
        # Credentials, query and fragment are never sent or recorded: the key goes in a header.
        self.url = redact(url) if url else self._launch(model_dir, launched)
        if self.server is None:  # attached: the server answers now, or the run stops here
            try:
                self._base_model_id = self._base_model()
            except BaseException:
                self.close()
                raise
        self.moe_layers: list[int] = []
        self.traits = replace(self.built_traits(cfg), routing_unavailable=self._routes_setup(model_dir),
                              sleep_unavailable=self._sleep_unavailable(), mixed_batch_unavailable=self._unmixed())

    def _launch(self, model_dir: Path | None, launched: ServerProcess | None) -> str:
        """Adopt the server the run launched early (`launched`, unless already stopped), else launch
        one now; return at once: the run loads its trainer while the server starts, the first call waits."""
        if launched is not None and launched.pid is not None:
            self.server = launched
        elif model_dir is None:
            raise ConfigError("the vllm-server sampler needs a checkpoint to serve")
        else:
            self.server = launch_server(self.cfg, Path(model_dir), self.cuda, self.batch_invariant)
        if not self.cuda:
            _one_torch_thread()
        return self.server.url

    def wait_ready(self) -> None:
        """Wait (once) for a server started here to answer `/health`. Records `sampler.start`, from
        launch to healthy, and `sampler.start_wait`, the part of it the run spent waiting (the rest
        overlapped the run's own work). On failure the server is stopped and the error raised."""
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

    @property
    def base_model(self) -> str:
        """The served base model's name (asked of the server once)."""
        if self._base_model_id is None:
            self._base_model_id = self._base_model()
        return self._base_model_id

    def _call(self, path: str, body: dict[str, Any] | None, label: str) -> Any:
        """One HTTP call (`bounded_http`: timeouts, a total deadline, a size cap, no redirects), timed
        under `http.<label>`; an error status raises `ServerError` with its body, the API key's value
        cut out of it wherever the server echoed it."""
        self.wait_ready()
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            with self.clock.call(f"http.{label}"):  # wall time: calls from a thread pool overlap
                answer = bounded_http.request(self.url + path, data, headers, timeout_s=REQUEST_TIMEOUT_S,
                                              deadline_s=REQUEST_DEADLINE_S)
        except bounded_http.HTTPCallError as e:
            raise ServerError(self._redact(self.exited(f"vLLM server: {path}: {e}"))) from None
        text = answer.body.decode("utf-8", errors="replace")
        if answer.status >= 400:
            raise ServerError(self._redact(f"vLLM server: {path} answered {answer.status}: {text[:500]}"))
        try:
            return json.loads(text) if text.startswith(("{", "[")) else text
        except ValueError:  # malformed, or a number past Python's digit limit: a stranger's body, one line
            raise ServerError(self._redact(f"vLLM server: {path} answered non-JSON: {text[:200]}")) from None

    def _redact(self, text: str) -> str:
        return redact_secrets(text, self.api_key)

    def _base_model(self) -> str:
        models = self._call("/v1/models", None, "models")
        return str(models["data"][0]["id"])

    def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]:
        out = self._call("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                             "temperature": 1.0, **extra}, label)
        return list(out["choices"])

    def _routes_setup(self, model_dir: Path | None) -> str | None:
        """Why this server returns no routes (`served.route_setup`; None: it does): one started here returns them on
        CUDA for an MoE model (`server_argv`); an attached one is asked once."""
        def ask() -> Any:
            return self._completion([0, 0], self.base_model, "routes_probe")[0].get("routed_experts")

        started_here = ""
        if self.server is None:
            pass  # attached: asked once
        elif not self.cuda:
            started_here = moe.VLLM_ROUTING_UNAVAILABLE
        elif self.cfg.sampler.engine_args.get(vllm_routes.ENGINE_ARG, True) is not True:
            started_here = f"the server was started without {served.ROUTES_FLAG} (the user's engine arguments)"
        why, _, self.moe_layers = served.route_setup(self.cfg, model_dir, started_here,
                                                     ask if self.server is None else None)
        return why

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        return self._scored(sequences, adapter, routes=False)[0]

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`RouteReturningSampler`: `score`, and the experts the same requests routed each token to in every MoE
        layer (vLLM 0.26's `routed_experts` of each choice, `vllm_routes.decoded`)."""
        if self.traits.routing_unavailable:
            raise ScoreError(f"vLLM server returns no routes here: {self.traits.routing_unavailable}")
        scores, arrays = self._scored(sequences, adapter, routes=True)
        return scores, vllm_routes.routes_of(arrays, sequences, self.moe_layers)

    def _scored(self, sequences: Sequences, adapter: AdapterHandle | None, routes: bool) -> tuple[Scores, list[Any]]:
        model = adapter.name if adapter is not None else self.base_model
        batch = self.cfg.scoring.batch_size
        out: Scores = []
        arrays: list[Any] = []
        for start in range(0, len(sequences), batch):
            group = sequences[start:start + batch]
            choices = sorted(self._completion(group, model, "completions", prompt_logprobs=0),
                             key=lambda c: c["index"])
            for s, (seq, choice) in enumerate(zip(group, choices, strict=True), start=start):
                out.append(prompt_row(seq, choice, f"sequence {s}"))
                if routes:
                    arrays.append(vllm_routes.decoded(choice.get("routed_experts"), s))
        return out, arrays

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        path = self._served_path(directory)
        served = name if name.endswith(self.suffix) else name + self.suffix
        self._call("/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(path), "load_inplace": inplace,
                                             **({"is_3d_lora_weight": True} if expert_lora(self.cfg) else {})},
                   f"load_lora_adapter.{name.removesuffix(self.suffix)}")
        self.loaded.add(served)
        return AdapterHandle(served, adapter_id, path)

    def retire(self, handle: AdapterHandle) -> None:
        """Unload `handle` from the server; one the server no longer has (404) is already retired."""
        try:
            self._call("/v1/unload_lora_adapter", {"lora_name": handle.name},
                       f"unload_lora_adapter.{handle.name.removesuffix(self.suffix)}")
        except ServerError as e:
            if " answered 404:" not in str(e):
                raise
        self.loaded.discard(handle.name)

    def info(self) -> BackendInfo:
        settings: dict[str, Any] = {
            "device": "cuda" if self.cuda else "cpu",
            "server": "started by lora-parity" if self.server else f"attached at {redact(self.url)}",
            "scoring": "/v1/completions, one request per "
                       + ("sequence" if self.cfg.scoring.batch_size == 1 else f"{self.cfg.scoring.batch_size} "
                          "sequences") + ", prompt_logprobs=0",
            "cached_scoring": self.cached_scoring(),
            "sync": "/v1/load_lora_adapter, /v1/unload_lora_adapter", "sampling": self.cfg.sampler.sampling.describe(),
        }
        if self.server is not None and not self.cuda:
            settings["trainer_torch_threads"] = "1 (the trainer shares the cores with the server)"
        if self.server is not None:
            settings["batch_invariant"] = self.server.env.get("VLLM_BATCH_INVARIANT", "unset")
            settings["argv"] = " ".join(a for a in self.server.argv[1:] if not a.startswith(("/", "\\")))
        if self.cfg.sampler.engine_args:  # an attached server's are the user's word for how it runs, not lora-parity's
            settings["engine_args"] = engine_args.record(self.cfg.sampler.engine_args)
            settings["engine_args_effect"] = engine_args.notes(self.cfg.sampler.engine_args) + (
                [] if self.server is not None else [engine_args.ATTACHED])
        settings.update(self._sleep_settings(), cuda_graphs=self._graphs_setting(), mixed_batch=self._mixed())
        versions: dict[str, str] = {}
        try:
            versions["vllm"] = served.server_text(self._call("/version", None, "version")["version"], self.api_key)
        except (ScoreError, KeyError, TypeError):
            versions["vllm"] = "unknown"
        return BackendInfo(backend="vllm-server", versions=versions, settings=settings)
