"""Stand-ins with the shapes of TRL 1.16.0's objects (names as in trl/generation/vllm_generation.py and
trl/trainer/grpo_trainer.py), for testing the TRL plugin's wiring on a CPU without TRL's vLLM engine (vLLM's CPU
build cannot take TRL's colocate sync: docs/trl.md).

- `StandInLLM`: `vllm.LLM` as TRL uses it: `generate` (prompt logprobs; sampled tokens with `logprobs`,
  `logprob_token_ids` or `allowed_token_ids`), a prefix cache of KV blocks (`BLOCK` tokens) that prompt-logprob
  requests fill but never read, as vLLM's V1 engine does, and other requests read; `reset_prefix_cache`,
  `collective_rpc('reload_weights')` (the checkpoint from disk), `sleep` / `wake_up`; the model at
  `llm_engine.model_executor.driver_worker.model_runner.model` with `load_weights`. Its model is a real HF
  transformers model of the checkpoint, fp32: no LoRA, it serves what is pushed into it.
- `StandInVLLMGeneration`: `VLLMGeneration` in colocate mode, its `sync_weights` the PEFT branch of TRL 1.16.0's
  (merge_adapter, names without `base_model.model.` and `.base_layer`, `load_weights`, unmerge_adapter,
  `reset_prefix_cache`); `real_generation` builds TRL's own `VLLMGeneration` around a `StandInLLM` instead.
- `StandInGRPOTrainer`: the GRPOTrainer attributes the plugin reads (`model`: a PEFT LoRA policy, `accelerator`,
  `use_vllm`, `vllm_mode`, `vllm_generation`, `state.global_step`, `add_callback`), and `train(steps)`: a loop that
  syncs once per step as `GRPOTrainer._generate` does, rolls out, moves the LoRA B tensors and calls the callbacks'
  `on_step_end`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

BLOCK = 4
"""Tokens per KV block of the stand-in's prefix cache."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 checkpoint (fp32, 3 layers, vocab 64), saved with `save_pretrained`; weights drawn wide
    (std 0.25), so that each target module alone moves the logprobs well above fp32 rounding (per-target checks)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.25)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # next-token distributions far from uniform
    model.save_pretrained(folder)
    return folder


def load_hf(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@dataclass
class SamplingParams:
    """The fields of `vllm.SamplingParams` the plugin and TRL set."""

    max_tokens: int = 16
    temperature: float = 1.0
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True
    n: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class Logprob(SimpleNamespace):
    logprob: float


class StandInVLLMModel(torch.nn.Module):
    """vLLM's model in the worker: `load_weights` takes (HF name, tensor) pairs, as TRL's colocate sync pushes them."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf = hf

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.hf.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"vLLM's model has no weight {name}")
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class StandInLLM:
    """`vllm.LLM` as TRL's colocate mode uses it (see the module docstring)."""

    def __init__(self, folder: Path, logprobs_mode: str = "processed_logprobs",
                 dtype: torch.dtype = torch.float32) -> None:
        self.folder = folder
        self.model = StandInVLLMModel(load_hf(folder, dtype))
        runner = SimpleNamespace(model=self.model)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
            vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True)),
            model_config=SimpleNamespace(logprobs_mode=logprobs_mode, max_model_len=128, dtype=dtype))
        self.cache: dict[tuple[int, ...], Any] = {}
        self.asleep: set[str] = set()
        self.cache_hits = 0

    # --- what TRL calls ---
    def reset_prefix_cache(self) -> bool:
        self.cache.clear()
        return True

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if method != "reload_weights":
            raise NotImplementedError(method)
        from safetensors.torch import load_file

        self.model.hf.load_state_dict(load_file(str(self.folder / "model.safetensors")), strict=False)
        return [None]

    def sleep(self, level: int = 1) -> None:
        self.asleep = {"weights", "kv_cache"}
        self.cache.clear()
        if level == 2:  # the weights are dropped: what a wake finds is garbage until weights are pushed again
            generator = torch.Generator().manual_seed(2)  # finite, as the GPU's reused memory was (A 3.4 nats off)
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or ["weights", "kv_cache"])

    def generate(self, prompts: list[Any], sampling_params: Any = None, use_tqdm: bool = False, **_: Any) -> list[Any]:
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)})")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [self._one(list(p["prompt_token_ids"]), sp) for p, sp in zip(prompts, params, strict=True)]

    # --- the engine ---
    def _forward(self, ids: list[int], read_cache: bool) -> torch.Tensor:
        """Logits of every position computed here; with `read_cache`, the longest cached prefix of whole blocks
        (at least one token left to compute) is read instead of computed. Whole blocks are cached after, the first
        KV of a block kept (as vLLM keeps the block it has)."""
        start, past = 0, None
        if read_cache:
            for end in range((len(ids) - 1) // BLOCK * BLOCK, 0, -BLOCK):
                if tuple(ids[:end]) in self.cache:
                    start, past = end, copy.deepcopy(self.cache[tuple(ids[:end])])
                    self.cache_hits += 1
                    break
        with torch.no_grad():
            out = self.model.hf(input_ids=torch.tensor([ids[start:]]), past_key_values=past, use_cache=True)
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            if tuple(ids[:end]) not in self.cache and end > start:
                kept = copy.deepcopy(out.past_key_values)
                if end < len(ids):
                    kept.crop(end - len(ids))  # drop the tokens after the block's end
                self.cache[tuple(ids[:end])] = kept
        return out.logits[0].float()

    def _one(self, ids: list[int], sp: Any) -> Any:
        prompt_logprobs = None
        if sp.prompt_logprobs is not None:
            logits = self._forward(ids, read_cache=False)  # vLLM never reads the cache for prompt logprobs
            lp = torch.log_softmax(logits, dim=-1)
            prompt_logprobs = [None] + [{ids[t]: Logprob(logprob=float(lp[t - 1, ids[t]]))} for t in range(1, len(ids))]
            last = logits[-1]
        else:
            last = self._forward(ids, read_cache=True)[-1]
        raw = torch.log_softmax(last, dim=-1)
        processed = raw
        if sp.allowed_token_ids is not None:
            mask = torch.full_like(last, float("-inf"))
            mask[sp.allowed_token_ids] = 0.0
            processed = torch.log_softmax(last + mask, dim=-1)
        token = int(processed.argmax())
        reported = processed if self.llm_engine.model_config.logprobs_mode == "processed_logprobs" else raw
        logprobs = None
        wanted_ids = getattr(sp, "logprob_token_ids", None) or []  # an older vLLM has no such field
        if sp.logprobs is not None or wanted_ids:
            wanted = {token, *wanted_ids}
            logprobs = [{t: Logprob(logprob=float(reported[t])) for t in wanted}]
        completion = SimpleNamespace(token_ids=[token], logprobs=logprobs)
        return SimpleNamespace(prompt_token_ids=ids, prompt_logprobs=prompt_logprobs, outputs=[completion])


class StandInAccelerator:
    """What TRL's sync reads of an `accelerate.Accelerator` on one process."""

    is_main_process = True
    device = torch.device("cpu")
    num_processes = 1
    state = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None)

    def unwrap_model(self, model: Any) -> Any:
        return model

    def wait_for_everyone(self) -> None:
        pass


class StandInVLLMGeneration:
    """`VLLMGeneration` in colocate mode with a PEFT policy, its `sync_weights` that of TRL 1.16.0."""

    def __init__(self, model: Any, llm: StandInLLM, enable_sleep_mode: bool = False) -> None:
        self.model, self.llm, self.mode = model, llm, "colocate"
        self.accelerator = StandInAccelerator()
        self.enable_sleep_mode = enable_sleep_mode
        self._llm_weights_sleeping = enable_sleep_mode

    def sync_weights(self) -> None:
        if self.mode == "colocate" and self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        model = self.model
        model.merge_adapter()
        for name, param in model.named_parameters():
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if model.prefix in name or "original_module" in name:
                continue
            name = name.replace("modules_to_save.default.", "")
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param.data)])
        model.unmerge_adapter()
        self.llm.reset_prefix_cache()



def rollout(generation: Any, prompts: list[list[int]]) -> list[Any]:
    """A rollout the way TRL 1.16.0's colocate `VLLMGeneration.generate` drives the engine: in sleep mode, push the
    weights if they sleep, wake the KV cache, generate, sleep at level 2."""
    if generation.enable_sleep_mode and generation._llm_weights_sleeping:
        generation.sync_weights()
    if generation.enable_sleep_mode:
        generation.llm.wake_up(tags=["kv_cache"])
    outputs = generation.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                      SamplingParams(max_tokens=1, logprobs=0))
    if generation.enable_sleep_mode:
        generation.llm.sleep(level=2)
        generation._llm_weights_sleeping = True
    return outputs


def real_generation(model: Any, llm: StandInLLM, enable_sleep_mode: bool = False) -> Any:
    """TRL's own `VLLMGeneration` (its `sync_weights`, `_iter_named_params`, `generate`), built around a `StandInLLM`
    without starting vLLM (its `__init__` would)."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.model, generation.llm, generation.mode = model, llm, "colocate"
    generation.accelerator = StandInAccelerator()
    generation._dist = DistributedBackend(generation.accelerator)
    generation.enable_sleep_mode = enable_sleep_mode
    generation._llm_weights_sleeping = enable_sleep_mode
    generation._weight_metadata = None
    return generation


class StandInGRPOTrainer:
    """The GRPOTrainer attributes the plugin reads, and a training loop shaped like TRL's (see the module docstring)."""

    def __init__(self, folder: Path, generation: Any = StandInVLLMGeneration, enable_sleep_mode: bool = False,
                 rank: int = 4, alpha: float = 8.0, dtype: torch.dtype = torch.float32,
                 engine_dtype: torch.dtype | None = None) -> None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS)
        self.model = get_peft_model(load_hf(folder, dtype), lora)
        self.model.name_or_path = str(folder)
        self.accelerator = StandInAccelerator()
        self.use_vllm, self.vllm_mode = True, "colocate"
        self.llm = StandInLLM(folder, dtype=engine_dtype or dtype)
        self.vllm_generation = generation(self.model, self.llm, enable_sleep_mode=enable_sleep_mode)
        if enable_sleep_mode:
            self.llm.sleep(level=2)
        self._last_loaded_step = -1
        self.state = SimpleNamespace(global_step=0)
        self.args = SimpleNamespace(vllm_enable_sleep_mode=enable_sleep_mode)
        self.callbacks: list[Any] = []

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def train(self, steps: int, prompts: list[list[int]] | None = None) -> None:
        """`steps` optimizer steps: sync when the step changed (`GRPOTrainer._generate`), a rollout, a seeded move of
        every lora_B (the optimizer's), then `on_step_end` of each callback."""
        prompts = prompts or [[3, 5, 7, 9, 11, 13, 2], [4, 6, 8, 10, 12]]
        for _ in range(steps):
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            rollout(self.vllm_generation, prompts)
            generator = torch.Generator().manual_seed(100 + self.state.global_step)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if ".lora_B." in name:
                        p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            self.state.global_step += 1
            for callback in self.callbacks:
                callback.on_step_end(self.args, self.state, SimpleNamespace())
