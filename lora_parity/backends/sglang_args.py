"""SGLang's server arguments as the user deploys them (issue 44): `--engine-arg KEY=VALUE` (repeatable) and the
config's `sampler.engine_args` with `--sampler sglang`, put as given on the `sglang.launch_server` command line of a
server lora-parity starts (`sglang_server.server_argv`). lora-parity's own choices (deterministic inference, CUDA
graphs off, its static memory fraction) apply only where the user set nothing; a user's value is never silently
replaced. The server's `/server_info` then says what it runs with, and the lifecycle table reads that
(`sglang_server.deployment`).

Only the keys in `ALLOWED` are accepted, each with its kind; a key lora-parity sets for the check itself, or one that
names code or a file the server would load, is refused in one line (`ConfigError`). SGLang's boolean options are
switches: true puts the flag on, false leaves it off (and keeps lora-parity's own off). Pure: no sglang import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.backends import engine_args

ALLOWED: dict[str, type | tuple[str, ...]] = {
    "disable_cuda_graph": bool, "enable_deterministic_inference": bool, "disable_radix_cache": bool,
    "enable_memory_saver": bool, "enable_weights_cpu_backup": bool, "disable_overlap_schedule": bool,
    "enable_torch_compile": bool, "max_loras_per_batch": int, "max_running_requests": int,
    "chunked_prefill_size": int, "cuda_graph_max_bs": int, "page_size": int, "mem_fraction_static": float,
    "attention_backend": str, "lora_backend": str, "sampling_backend": str, "schedule_policy": str,
    "kv_cache_dtype": ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"),
}
"""Keys a user may set, and the kind of each value (a tuple: one of these strings)."""

OWNED = {
    "model_path": "the checkpoint is the run's model (--model)", "dtype": "use --dtype",
    "enable_lora": "LoRA is what lora-parity checks", "max_lora_rank": "set from the adapter's rank",
    "lora_target_modules": "set from the adapter's targets", "skip_tokenizer_init": "scoring sends token ids",
    "random_seed": "lora-parity seeds the server", "load_format": "safetensors only, never a pickle",
    "host": "the server listens on 127.0.0.1", "port": "LORA_PARITY_SGLANG_PORT, else a free port",
    "context_length": "sampler.max_model_len", "tp_size": "sampler.tensor_parallel_size",
    "trust_remote_code": "runs the checkpoint's own Python code: use --trust-remote-code",
}
"""Keys lora-parity sets itself, and why a user's value is refused."""

UNSAFE = ("tokenizer_path", "lora_paths", "json_model_override_args", "preferred_sampling_params",
          "custom_weight_loader", "download_dir", "revision", "speculative_draft_model_path", "chat_template")
"""Keys naming code, a file or a folder the server would load, or a nested config that can: refused."""


def check(args: Mapping[str, Any]) -> dict[str, Any]:
    """The user's SGLang server arguments with normalized keys (`-` read as `_`) and typed values; `ConfigError`
    (one line) for an unknown, owned or unsafe key, or a value of the wrong kind (`engine_args.check`)."""
    return engine_args.check(args, ALLOWED, OWNED, UNSAFE, "SGLang server argument", "the server")


def flags(args: Mapping[str, Any]) -> list[str]:
    """The user's arguments as `sglang.launch_server` flags: a true boolean as its switch, a false one as nothing,
    any other value as `--key value`."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    return out
