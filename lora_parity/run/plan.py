"""Launch plans and preflight for models too big for one process (`lora-parity run --plan`).

A config with a `launch` section (configs/glm-5.3.yaml) says how many nodes and GPUs the run needs
and how the trainer and the sampler are spread over them. `render` turns that into the resources
and the exact commands, as text, without touching a GPU; `preflight` checks, in well under a second
and without importing torch, whether this machine can start the run at all, so that a run that
cannot work stops with one line instead of after minutes of loading.

Everything here is pure except the look-ups `preflight` needs: environment variables, the
Hugging Face cache folders and `nvidia-smi` (or torch, only once `nvidia-smi` says there are GPUs).
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lora_parity.backends import vllm_options
from lora_parity.models.checkpoint import hub_problem
from lora_parity.models.config import ModelConfig
from lora_parity.models.hub import hub_checkpoint
from lora_parity.models.launch import LaunchSpec
from lora_parity.models.provenance import source
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

__all__ = ["engine_options", "hub_checkpoint", "num_nodes", "preflight", "render", "sampler_command",
           "trainer_command", "weights_gib"]

GIB = 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


_HEADER_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                 "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def checkpoint_gib(folder: Path) -> float:
    """The weights of a checkpoint folder in GiB, from its safetensors headers alone (nothing loaded)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        for name, entry in safe_read.safetensors_header(path).items():
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                total += math.prod(int(d) for d in entry["shape"]) * _HEADER_BYTES.get(str(entry.get("dtype")), 4)
    return total / GIB


def _memory_line(cfg: ModelConfig) -> str:
    """What one process holds: the base weights once per side, and the fp32 reference (twice that in bf16)."""
    from lora_parity.models import synthetic

    folder = synthetic.cached(cfg)
    if folder is None:
        return "not estimated: the checkpoint is built or fetched on the first run (then --plan says)"
    gib = checkpoint_gib(folder)
    dtype = cfg.model.dtype
    fp32 = gib * 4 / _BYTES.get(dtype, 4)
    return (f"base weights {gib:.3g} GiB ({dtype}) held by the trainer and by the sampler, {2 * gib:.3g} GiB; "
            f"the fp32 reference, where scored, {fp32:.3g} GiB more, one point at a time")


def weights_gib(cfg: ModelConfig) -> float:
    """Size of the base weights in the config's dtype, in GiB."""
    launch = _launch(cfg)
    return launch.num_params * _BYTES[cfg.model.dtype] / GIB


def trainer_gib_per_gpu(cfg: ModelConfig) -> float:
    """Base weights per trainer GPU: dense parts split tp x pp ways, experts ep x pp ways; with no
    split of the two in the config, the smaller of tp and ep bounds it from above."""
    t = _launch(cfg).trainer
    return weights_gib(cfg) / (min(t.tp, t.ep) * t.pp)


def sampler_gib_per_gpu(cfg: ModelConfig) -> float:
    """Base weights per sampler GPU: everything split over its tensor-parallel ranks (experts too:
    with expert parallel they are sharded over the same ranks)."""
    return weights_gib(cfg) / _launch(cfg).sampler.tp


def num_nodes(launch: LaunchSpec) -> int:
    """Nodes the whole run needs: the trainer's, plus one for a sampler on its own node."""
    return launch.trainer.nodes + (1 if launch.sampler.own_node else 0)


def _launch(cfg: ModelConfig) -> LaunchSpec:
    if cfg.launch is None:
        raise ConfigError(f"{cfg.name} has no launch section: it runs in one process (no plan needed)")
    return cfg.launch


def _model_ref(cfg: ModelConfig) -> str:
    """What a launch command loads: the hub id or the local folder."""
    m = cfg.model
    return m.hf_id or m.path or source(cfg)


def engine_options(cfg: ModelConfig) -> dict[str, Any]:
    """The sampler engine's options on the plan's GPUs (the same builder the `vllm` sampler uses)."""
    return vllm_options.engine_options(cfg, _model_ref(cfg), cuda=True)


def with_trainer(cfg: ModelConfig, trainer: str | None, tp: int | None) -> ModelConfig:
    """`cfg` with its launch plan's trainer backend and tensor-parallel size replaced where given
    (`run --plan --trainer X --tp N`); a layout that no longer divides its GPUs is a `ConfigError`."""
    if cfg.launch is None or (trainer is None and tp is None):
        return cfg
    data = cfg.launch.model_dump()
    data["trainer"].update({k: v for k, v in (("backend", trainer), ("tp", tp)) if v is not None})
    try:
        launch = LaunchSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"--plan for {cfg.name}: {e.errors()[0].get('msg')}") from None
    return cfg.model_copy(update={"launch": launch})


def _run_command(model_ref: str, flags: dict[str, str | int | None], prog: str = "lora-parity") -> str:
    given = [f"--{k} {shlex.quote(str(v))}" for k, v in flags.items() if v is not None]
    return " ".join([prog, "run --model", shlex.quote(model_ref), *given])


DEMO_RDZV = "127.0.0.1:29500"
"""The rendezvous of the multi-node commands printed for a one-process config: torchrun's default
port on this machine, so that the commands run as printed with every "node" here."""


def _torchrun_lines(name: str, model_ref: str, flags: dict[str, str | int | None], tp: int) -> list[str]:
    """Megatron at TP > 1 for a config without a launch section: torchrun on this machine, and over
    `tp` nodes with one trainer rank each (docs/multinode.md)."""
    run = _run_command(model_ref, flags, prog=f"-m {_entry('megatron')}")
    host = DEMO_RDZV.split(":")[0]
    nodes = [f"    node {r}:  torchrun --nnodes {tp} --nproc-per-node 1 --node-rank {r} --rdzv-backend c10d "
             f"--rdzv-endpoint {DEMO_RDZV} --rdzv-id lora-parity-{name} --local-addr {host} {run}" for r in range(tp)]
    return [f"  under torchrun on this machine:  torchrun --nproc-per-node {tp} {run}",
            f"  over {tp} nodes, one trainer rank each (the node torchrun ranks 0 runs the sequence and the "
            "sampler and writes the receipt):",
            *nodes,
            f"    as printed every node runs on this machine; across machines, the endpoint's {host} becomes node "
            "0's address, --local-addr each node's own (or leave it out), and GLOO_SOCKET_IFNAME / "
            "NCCL_SOCKET_IFNAME name the interface they share (docs/multinode.md)"]


def render(cfg: ModelConfig, model_ref: str | None = None, trainer: str | None = None, tp: int | None = None,
           sampler: str | None = None) -> str:
    """The plan: resources, memory estimate and launch commands of a config with a launch section
    (one line for a config that runs in one process). Every command runs as printed: `--model` is
    `model_ref` (the name, YAML file or folder as the user gave it; default the config's name), and
    `trainer` and `tp`, where given, replace the plan's trainer backend and tensor-parallel size
    (`sampler`, where given, is kept in the one-process command)."""
    ref = model_ref or cfg.name
    if cfg.launch is None:
        flags: dict[str, str | int | None] = {"trainer": trainer, "sampler": sampler, "tp": tp}
        where = ("in one process beside SGLang's server, on one GPU (SGLang has no CPU build)" if sampler == "sglang"
                 else "in one process (the CPU or one GPU)")
        lines = [f"lora-parity plan: {cfg.name}", f"  runs {where} on this machine: {_run_command(ref, flags)}",
                 f"  memory: {_memory_line(cfg)}"]
        if trainer == "megatron" and tp is not None and tp > 1:
            lines += _torchrun_lines(cfg.name, ref, flags, tp)
        return "\n".join(lines) + "\n"
    cfg = with_trainer(cfg, trainer, tp)
    assert cfg.launch is not None
    launch = cfg.launch
    t, s = launch.trainer, launch.sampler
    world = t.nodes * launch.gpus_per_node
    nodes = num_nodes(launch)
    total, tr, sa = weights_gib(cfg), trainer_gib_per_gpu(cfg), sampler_gib_per_gpu(cfg)
    fits = "fits" if max(tr, sa) <= launch.gpu_memory_gib else "DOES NOT FIT"
    trainer_nodes = "node 0" if t.nodes == 1 else f"nodes 0-{t.nodes - 1}"
    sampler_node = f"node {t.nodes}" if s.own_node else "node 0"
    ep = f", expert parallel (EP {s.tp})" if s.expert_parallel else ""
    hf = cfg.model.hf_id
    lines = [
        f"lora-parity plan: {cfg.name}",
        f"  model       {source(cfg)}, {cfg.model.dtype}, {launch.num_params / 1e9:,.1f}B parameters "
        f"= {total:,.0f} GiB of weights",
        f"  adapter     LoRA r{cfg.adapter.rank} alpha {cfg.adapter.alpha:g} on {', '.join(cfg.adapter.kinds)}",
        *([f"  routing     route replay {cfg.route_replay}: the trainer's routers replay the experts the engine's "
           "pass at each point chose (R3; docs/moe.md)"] if cfg.route_replay else []),
        "",
        f"resources: {nodes} nodes x {launch.gpus_per_node} GPUs ({nodes * launch.gpus_per_node} GPUs), "
        f"{launch.gpu_memory_gib:g} GiB each",
        f"  trainer     {t.backend} on {trainer_nodes}: TP {t.tp} x EP {t.ep} x PP {t.pp} = {world} ranks "
        f"(data parallel {world // (t.tp * t.pp)}, expert data parallel {world // (t.ep * t.pp)})",
        f"              about {tr:,.1f} GiB of base weights per GPU",
        f"  sampler     vllm on {sampler_node}: TP {s.tp}{ep}, one engine driven by trainer rank 0"
        + (" through Ray" if s.own_node else ""),
        f"              about {sa:,.1f} GiB of base weights per GPU",
        f"  memory      {fits}: {max(tr, sa):,.1f} of {launch.gpu_memory_gib:g} GiB per GPU before activations, "
        "KV cache and adapter",
    ]
    if sampler is not None and sampler != "vllm":
        lines.append(f"              (--sampler {sampler} does not run a launch plan: its sampler is vLLM in "
                     "trainer rank 0)")
    if hf:
        lines.append(f"  checkpoint  {hf} in the Hugging Face cache of nodes 0-{nodes - 1} (HF_HUB_CACHE or HF_HOME); "
                     "lora-parity never downloads")
    lines += ["", "launch"]
    step = 1
    if hf:
        lines.append(f"  {step}. every node:  hf download {hf}")
        step += 1
    if s.own_node:
        lines.append(f"  {step}. {sampler_node} (sampler):  ray start --head --port 6379 "
                     f"--num-gpus {launch.gpus_per_node}")
        lines.append(f"  {step + 1}. node 0:  ray start --address $SAMPLER_ADDR:6379 --num-gpus 0")
        step += 2
    who = "node 0" if t.nodes == 1 else f"{trainer_nodes} (NODE_RANK=0..{t.nodes - 1}; MASTER_ADDR = node 0's address)"
    lines.append(f"  {step}. {who}:")
    lines.append("     " + trainer_command(cfg, ref))
    if launch.requires:
        lines += ["", "not built or not run yet (the plan cannot run until these exist)"]
        lines += [f"  - {r}" for r in launch.requires]
    lines += ["", "sampler engine (in trainer rank 0)",
              "  " + vllm_options.llm_call(engine_options(cfg)).replace(
                  f"model={_model_ref(cfg)!r}", f"model=<local snapshot of {_model_ref(cfg)}>"),
              "the same engine as a server, to check on its own that it loads",
              "  " + sampler_command(cfg)]
    return "\n".join(lines) + "\n"


def trainer_command(cfg: ModelConfig, model_ref: str | None = None) -> str:
    """The torchrun command every trainer node runs (NODE_RANK and MASTER_ADDR from the environment);
    `--model` is `model_ref` as the user gave it (default the config's name)."""
    launch = _launch(cfg)
    t = launch.trainer
    return (f"torchrun --nnodes {t.nodes} --nproc-per-node {launch.gpus_per_node} --node-rank $NODE_RANK "
            f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{launch.rdzv_port} --rdzv-id lora-parity-{cfg.name} "
            f"-m {_entry(t.backend)} run --model {shlex.quote(model_ref or cfg.name)} --trainer {t.backend} "
            f"--tp {t.tp} --sampler vllm")


def _entry(backend: str) -> str:
    """torchrun's module: `lora_parity.launch` for the Megatron trainer (its rank 0 runs the CLI), else the CLI."""
    return "lora_parity.launch" if backend == "megatron" else "lora_parity"


def sampler_command(cfg: ModelConfig) -> str:
    """`vllm serve` with the sampler's engine options."""
    _launch(cfg)
    return vllm_options.serve_command(engine_options(cfg))


def _visible_gpus() -> tuple[int, str]:
    """(number of CUDA GPUs this process can use, how it was found), checking the cheap signs first:
    CUDA_VISIBLE_DEVICES set empty, no `nvidia-smi`, then `nvidia-smi -L`, then torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0, "CUDA_VISIBLE_DEVICES hides every GPU"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no CUDA GPU (nvidia-smi not found)"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return 0, "nvidia-smi failed"
    count = sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))
    if count == 0:
        return 0, "nvidia-smi lists no GPU"
    import torch  # only now: CUDA is likely there, and torch's count honours CUDA_VISIBLE_DEVICES

    return torch.cuda.device_count(), "torch.cuda.device_count()"


# Backends whose weights live elsewhere (a service) or nowhere (fakes): no local checkpoint needed.
_NO_LOCAL_WEIGHTS = ("tinker", "fake")


def preflight(cfg: ModelConfig, trainer: str, sampler: str) -> None:
    """Raise a one-line `ConfigError` naming every resource this machine lacks for `cfg`; return if
    the run can start here. Configs without a launch section and without a hub id need nothing."""
    missing: list[str] = []
    launch = cfg.launch
    hf = cfg.model.hf_id
    local = not (trainer in _NO_LOCAL_WEIGHTS and sampler in _NO_LOCAL_WEIGHTS)
    if hf is not None and local and hub_checkpoint(hf) is None:
        missing.append(hub_problem(hf) or
                       f"{hf} is not in the local Hugging Face cache (download it first; lora-parity never downloads)")
    if launch is not None:
        gpus, how = _visible_gpus()
        if gpus < launch.gpus_per_node:
            missing.append(f"{launch.gpus_per_node} GPUs per node, found {gpus} ({how})")
        world = os.environ.get("WORLD_SIZE")
        want = launch.trainer.nodes * launch.gpus_per_node
        if launch.trainer.nodes > 1 and world != str(want):
            missing.append(f"a torchrun job of {want} ranks over {launch.trainer.nodes} nodes "
                           f"(WORLD_SIZE is {world or 'unset'})")
        if trainer != launch.trainer.backend:
            missing.append(f"--trainer {launch.trainer.backend} (the plan's trainer; {trainer} cannot hold it)")
        if sampler == "sglang":
            missing.append("--sampler vllm (the plan's sampler; sglang serves from one GPU, not over a launch plan)")
    if missing:
        nodes = num_nodes(launch) if launch else 1
        need = f"{cfg.name} needs " + (f"{nodes} nodes x {launch.gpus_per_node} GPUs; " if launch else "")
        raise ConfigError(f"preflight: {need}missing: {'; '.join(missing)}; see `lora-parity run --model {cfg.name} "
                          "--plan`")

