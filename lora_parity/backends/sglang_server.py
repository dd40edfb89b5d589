"""SGLang's server for the `sglang` sampler: what is checked before a run, and the command line and
environment of `python -m sglang.launch_server`. Nothing of SGLang is imported here (it runs in the
server's own process); whether it is installed is read from the import system alone.

The flags are `ServerArgs` fields of SGLang's `python/sglang/srt/server_args.py` (each field's flag is
its name with dashes): `--model-path`, `--host`, `--port`, `--dtype`, `--enable-lora`,
`--max-lora-rank`, `--lora-target-modules`, `--skip-tokenizer-init`, `--context-length`,
`--random-seed`, `--mem-fraction-static`, `--load-format`, `--trust-remote-code`, `--tp-size`,
`--enable-deterministic-inference`, `--disable-cuda-graph` (`sampler.enforce_eager`, as for vLLM), and
`--enable-memory-saver` with `--enable-weights-cpu-backup` where the run sleeps (`backends.sglang_state`).
The radix (prefix) cache stays on, as rollouts are served: SGLang never reads it for a request whose
logprobs start at 0, and `score_cached` reads it as a rollout does.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from lora_parity.backends import served, sglang_args, sglang_state, sleep
from lora_parity.backends.base import PreflightOptions
from lora_parity.backends.server_process import ServerProcess, free_port
from lora_parity.backends.vllm_options import returns_routes
from lora_parity.evidence.receipt_io import one_line
from lora_parity.evidence.receipt_models import GRAPHS_DECODE_ONLY
from lora_parity.models.config import DTYPES, TARGET_NAME, ModelConfig
from lora_parity.util import env, scratch
from lora_parity.util.errors import ConfigError

SGLANG_PIN = "sglang==0.5.16"
"""The release the GPU evidence is for (scripts/gpu-sglang-wheels.txt pins what it needs)."""
SERVER_NAME = "sglang.launch_server"
REQUEST_TIMEOUT_S = 300.0
"""Longest wait on the socket within one call."""
REQUEST_DEADLINE_S = 900.0
"""Longest one call may take in all: a server that trickles bytes cannot hold the run longer."""
START_TIMEOUT_S = env.seconds(os.environ, "LORA_PARITY_SGLANG_START_TIMEOUT", 900.0)
"""Longest wait for a started server's `/health` (its first start JIT-compiles kernels)."""


def installed() -> bool:
    """Whether `import sglang` would find a package, asked of the import system without importing it."""
    return importlib.util.find_spec("sglang") is not None


def preflight(opts: PreflightOptions) -> None:
    """SGLang is installed, or --sampler-url names a server (http(s), answering `/health` within
    seconds); --api-key-env names a set variable; --shared-dir exists. Raises `ConfigError`."""
    served.check_options(opts)
    if opts.sampler_url is not None:
        served.check_reachable(opts.sampler_url, "SGLang server")
    elif not installed():
        raise ConfigError("--sampler sglang: SGLang is not installed in this Python (it has no CPU build; on a "
                          f"GPU machine install {SGLANG_PIN}, see scripts/gpu-sglang-wheels.txt), or attach to a "
                          "running SGLang server with --sampler-url")


def check_server_args(cfg: ModelConfig) -> None:
    """Every value from a config or an adapter that goes onto the server's command line is what it
    should be (a module name, a dtype), never an option: `ConfigError` otherwise."""
    bad = [t for t in cfg.adapter.targets if not TARGET_NAME.fullmatch(t)]
    if bad:
        raise ConfigError(f"LoRA target {one_line(repr(bad[0]))} is not a module name; it would go onto the "
                          "sglang.launch_server command line")
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"dtype {one_line(repr(cfg.model.dtype))} is not one of {', '.join(DTYPES)}")


def server_argv(cfg: ModelConfig, model_dir: Path, port: int, deterministic: bool = True) -> list[str]:
    """`python -m sglang.launch_server` with the run's rank, targets and dtype, token ids in and out
    (no tokenizer: a synthetic checkpoint has none), safetensors only, the static memory fraction the
    config gives the sampler (the trainer shares the GPU), and deterministic inference unless turned off;
    then the user's server arguments as given (`sglang_args`: where they set one, lora-parity's own is left out)."""
    check_server_args(cfg)
    user = cfg.sampler.engine_args
    memory = user.get("mem_fraction_static", cfg.sampler.gpu_memory_utilization)
    # An absolute path: a folder named like an option (`-x`) can never read as one.
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(Path(model_dir).absolute()),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.model.dtype,
            "--enable-lora", "--max-lora-rank", str(cfg.adapter.rank), "--lora-target-modules", *cfg.adapter.targets,
            "--skip-tokenizer-init", "--context-length", str(cfg.sampler.max_model_len), "--random-seed", "0",
            "--mem-fraction-static", str(memory), "--load-format", "safetensors"]
    if cfg.sampler.tensor_parallel_size > 1:
        argv += ["--tp-size", str(cfg.sampler.tensor_parallel_size)]
    if deterministic and cfg.sampler.batch_invariant and "enable_deterministic_inference" not in user:
        argv.append("--enable-deterministic-inference")
    if cfg.sampler.enforce_eager and "disable_cuda_graph" not in user:  # no CUDA graph capture (decode runs eager)
        argv.append("--disable-cuda-graph")
    argv += sglang_args.flags({k: v for k, v in user.items() if k != "mem_fraction_static"})
    argv += sglang_state.server_flags(cfg.sampler.sleep_levels)  # the memory saver, where the run sleeps
    if returns_routes(cfg, str(model_dir)):  # each request's routes, which the trainer replays (R3)
        argv.append(served.ROUTES_FLAG)
    if cfg.model.trust_remote_code:
        argv.append("--trust-remote-code")
    extra = os.environ.get("LORA_PARITY_SGLANG_ARGS")
    if extra:
        argv += shlex.split(extra)
    return argv


def deployment(args: dict[str, Any]) -> dict[str, str]:
    """What the server does about the deployment conditions (`verdict.lifecycle`), read off the settings it reported
    (`/server_info`), not off the options given: CUDA graphs (`disable_cuda_graph`), batch invariance
    (`enable_deterministic_inference`), and sleep mode (its memory saver, and the level its CPU copy of the weights
    gives: `sglang_state.levels_of`). A setting the server did not report stays out (the table says "not
    recorded")."""
    levels = sglang_state.levels_of(args)
    out = {"sleep_mode": sleep.setting(None if levels else sglang_state.NO_SAVER, levels)}
    if isinstance(args.get("disable_cuda_graph"), bool):
        out["cuda_graphs"] = ("off (disable_cuda_graph: true)" if args["disable_cuda_graph"]
                              else f"{GRAPHS_DECODE_ONLY} (disable_cuda_graph: false; SGLang turns its prefill graphs "
                              "off with LoRA and with deterministic inference, so the scored prompts run eager)")
    if isinstance(args.get("enable_deterministic_inference"), bool):
        out["batch_invariant"] = ("on (enable_deterministic_inference: true)" if args["enable_deterministic_inference"]
                                  else "off (enable_deterministic_inference: false)")
    return out


def server_env() -> dict[str, str]:
    """The server's environment: this process's, with a temp dir of its own in the run's scratch
    (what the server leaves there when a signal ends it goes with the run)."""
    env = dict(os.environ)
    env["TMPDIR"] = str(scratch.folder("lora-parity-sglang-"))
    return env


def launch_server(cfg: ModelConfig, model_dir: Path, deterministic: bool = True) -> ServerProcess:
    """Launch SGLang's server for `cfg` on 127.0.0.1 (port: $LORA_PARITY_SGLANG_PORT, else a free one)
    and return at once; `ServerProcess.wait_healthy` waits for it."""
    port = int(os.environ.get("LORA_PARITY_SGLANG_PORT") or free_port())
    server = ServerProcess(server_argv(cfg, Path(model_dir), port, deterministic), server_env(), port,
                           START_TIMEOUT_S, name=SERVER_NAME)
    server.launch()
    return server
