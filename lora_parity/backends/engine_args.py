"""The user's vLLM engine arguments, as deployed (issue 44): `--engine-arg KEY=VALUE` (repeatable) and the
config's `sampler.engine_args`, passed to `vllm.LLM(...)` in process and as `vllm serve` flags, taken as
given. lora-parity's own defaults (enforce_eager, prefix caching off, ...) apply only where the user set
nothing; a user's value is never silently replaced.

Only the keys in `ALLOWED` are accepted, each with its kind; a key lora-parity sets for the check itself
(the model, LoRA on for the adapter's targets, safetensors only, ...) or that names code or a file the engine
would load (`trust_remote_code`: the project's `--trust-remote-code` flag; `worker_extension_cls`,
`logits_processors`, `hf_overrides`, ...) is refused in one line (`ConfigError`). Pure: no vllm import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lora_parity.util.errors import ConfigError

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

ALLOWED: dict[str, type | tuple[str, ...]] = {
    "enforce_eager": bool, "enable_prefix_caching": bool, "enable_chunked_prefill": bool,
    "enable_sleep_mode": bool, "async_scheduling": bool, "fully_sharded_loras": bool, "disable_cascade_attn": bool,
    "max_num_seqs": int, "max_num_batched_tokens": int, "block_size": int, "max_model_len": int, "max_loras": int,
    "max_cpu_loras": int, "tensor_parallel_size": int, "gpu_memory_utilization": float, "swap_space": float,
    "logprobs_mode": LOGPROBS_MODES, "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"),
    "lora_dtype": ("auto", "float16", "bfloat16", "float32"), "attention_backend": str,
    "enable_return_routed_experts": bool,
}
"""Keys a user may set, and the kind of each value (a tuple: one of these strings)."""

OWNED = {
    "model": "the checkpoint is the run's model (--model)", "dtype": "use --dtype",
    "enable_lora": "LoRA is what lora-parity checks", "max_lora_rank": "set from the adapter's rank",
    "lora_target_modules": "set from the adapter's targets", "skip_tokenizer_init": "scoring sends token ids",
    "seed": "lora-parity seeds the engine", "load_format": "safetensors only, never a pickle",
    "trust_remote_code": "runs the checkpoint's own Python code: use --trust-remote-code",
    "enable_mixed_moe_lora_format": "set for expert LoRA (adapter.target_parameters)",
}
"""Keys lora-parity sets itself, and why a user's value is refused."""

UNSAFE = ("worker_cls", "worker_extension_cls", "logits_processors", "hf_overrides", "tokenizer", "download_dir",
          "model_loader_extra_config", "speculative_config", "kv_transfer_config", "compilation_config",
          "override_generation_config", "allowed_local_media_path", "code_revision", "revision")
"""Keys naming code, a file or a folder the engine would load, or a nested config that can: refused."""

EXACTNESS = {
    "enforce_eager": (False, "CUDA graphs and compilation where the engine has them (the cuda_graphs setting says "
                             "what it did): repeats may not be exact; the sampler repeats measure the noise under "
                             "it, and X is skipped where they are not exact"),
    "enable_prefix_caching": (True, "prefix caching on: a prompt served from cached blocks may score differently "
                                    "from the same prompt computed whole; the repeats measure it"),
}
"""Settings that conflict with what an exact repeat needs: (the user's value, what the run says)."""


def value_of(key: str, raw: Any, allowed: Mapping[str, type | tuple[str, ...]] = ALLOWED) -> Any:
    """`raw` (a JSON text from the command line, or a YAML value) as the kind `allowed` gives `key`; `ConfigError`
    (one line) for a value of another kind."""
    kind = allowed[key]
    if isinstance(raw, str) and kind is not str:
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            pass
    ok = (isinstance(raw, str) and raw in kind if isinstance(kind, tuple)
          else isinstance(raw, bool) if kind is bool
          else isinstance(raw, int) and not isinstance(raw, bool) if kind is int
          else isinstance(raw, int | float) and not isinstance(raw, bool) if kind is float
          else isinstance(raw, str) and raw.replace("_", "").isalnum())
    if not ok:
        want = " or ".join(kind) if isinstance(kind, tuple) else kind.__name__
        raise ConfigError(f"engine argument {key}={raw!r}: expected {want}")
    return float(raw) if kind is float else raw


def check(args: Mapping[str, Any], allowed: Mapping[str, type | tuple[str, ...]] = ALLOWED,
          owned: Mapping[str, str] = OWNED, unsafe: tuple[str, ...] = UNSAFE,
          what: str = "engine argument", loader: str = "the engine") -> dict[str, Any]:
    """The user's engine arguments with normalized keys (`-` read as `_`) and typed values; `ConfigError`
    (one line) for an unknown, owned or unsafe key, or a value of the wrong kind. vLLM's tables by default
    (`sglang_args` passes SGLang's)."""
    out: dict[str, Any] = {}
    for given, raw in args.items():
        key = str(given).strip().replace("-", "_")
        if key in owned:
            raise ConfigError(f"{what} {key!r} is refused: {owned[key]}")
        if key in unsafe:
            raise ConfigError(f"{what} {key!r} is refused: it names code or files {loader} would load")
        if key not in allowed:
            raise ConfigError(f"unknown {what} {key!r}; allowed: {', '.join(sorted(allowed))}")
        out[key] = value_of(key, raw, allowed)
    return out


def parse(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """`--engine-arg KEY=VALUE` values as a dict, unchecked (`user_args.check_for` checks them for the sampler)."""
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        args[key.strip()] = value.strip()
    return args


ATTACHED = ("declared for the attached server, which lora-parity did not start: they say how it runs, lora-parity set "
            "none of them")
"""The note on the user's engine arguments where the sampler attached to a server (`--sampler-url`)."""


def record(args: Mapping[str, Any]) -> list[str]:
    """The receipt's words for the user's arguments: 'key=value' each, JSON values."""
    return [f"{k}={json.dumps(v)}" for k, v in args.items()]


def notes(args: Mapping[str, Any]) -> list[str]:
    """What the user's settings change about the checks, one line each."""
    return [f"{key}={json.dumps(value)}: {what}" for key, (value, what) in EXACTNESS.items() if args.get(key) == value]


def cached_scoring_off(args: Mapping[str, Any]) -> str | None:
    """Why a cached score cannot be read under the user's `logprobs_mode` (None: raw logprobs, it can). A cached
    score's next token is read on the decode path, forced by `allowed_token_ids`: processed logprobs are taken after
    that mask (the forced token's logprob is 0) and logits are not logprobs, so the P phases are left out."""
    mode = str(args.get("logprobs_mode", "raw_logprobs"))
    if mode == "raw_logprobs":
        return None
    what = "taken after the forcing mask (0 for the forced token)" if mode.startswith("processed") else "logits"
    return (f"off: logprobs_mode={mode}: a cached score's next token is read on the decode path, forced by "
            f"allowed_token_ids, where that mode's values are {what}, not the raw logprob (no P phases)")


def serve_flags(args: Mapping[str, Any]) -> list[str]:
    """The user's arguments as `vllm serve` flags (booleans as --flag / --no-flag)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def _name(value: Any) -> str:
    """An enum member's name ('NONE', not '0' for an IntEnum), else the text after its last dot."""
    return str(getattr(value, "name", None) or str(value).rsplit(".", 1)[-1])


def graphs_truth(compilation: Any, device: str) -> str:
    """Whether the started engine captures CUDA graphs, read off its compilation config (`cudagraph_mode`,
    `cudagraph_capture_sizes`, `mode`): 'on (...)' or 'off (why)'."""
    mode = _name(getattr(compilation, "cudagraph_mode", "NONE"))
    sizes = list(getattr(compilation, "cudagraph_capture_sizes", None) or [])
    compile_mode = _name(getattr(compilation, "mode", ""))
    if device == "cpu":
        return (f"off (vLLM-CPU captures no CUDA graphs: its platform empties cudagraph_capture_sizes; compilation "
                f"mode {compile_mode or 'unknown'}, which vLLM-CPU sets to NONE with LoRA on)")
    if mode == "NONE" or not sizes:
        return f"off (cudagraph_mode {mode}, {len(sizes)} capture sizes)"
    return f"on (cudagraph_mode {mode}, {len(sizes)} capture sizes up to {max(sizes)})"
