"""Commands about model configs: `models` (what there is, the default, what each needs) and `init`
(a commented config to start from for a local checkpoint folder)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from lora_parity.cli import output
from lora_parity.util.errors import ConfigError


def needs(cfg: Any) -> dict[str, Any]:
    """What a config needs to run: 'CPU', 'GPU' or 'N nodes x M GPUs', the pip extras, and a
    checkpoint in the Hugging Face cache where it names a hub id."""
    m, launch = cfg.model, cfg.launch
    gpu = launch is not None or m.dtype != "float32" or (m.synthetic is not None and m.synthetic.generate_on == "cuda")
    from lora_parity.run.plan import num_nodes

    device = f"{num_nodes(launch)} nodes x {launch.gpus_per_node} GPUs" if launch else ("GPU" if gpu else "CPU")
    extras = ["gpu" if gpu else "cpu"]
    if launch is not None and launch.trainer.backend not in ("hf", *extras):
        extras.append(launch.trainer.backend)
    return {"device": device, "extras": extras, "checkpoint": m.hf_id}


def sglang_support(cfg: Any) -> str:
    """Whether `--sampler sglang` can serve a config: on one GPU (SGLang has no CPU build), and not a
    config with a launch plan (its sampler is vLLM in trainer rank 0)."""
    return "no (launch plan: the sampler is vLLM)" if cfg.launch is not None else "one GPU"


def _needs_text(n: dict[str, Any]) -> str:
    return f"{n['device']}, [{','.join(n['extras'])}]"


def models(json_: Annotated[bool, typer.Option("--json", help="Print the configs as JSON on stdout.")] = False,
           ) -> None:
    """The model configs, one line each: name (* the default), source, dtype, adapter, what it needs
    (CPU or GPU, the pip extra: `pip install 'lora-parity[EXTRA]'`), description."""
    from lora_parity.models import config

    rows = []
    for p in config.available():
        cfg = config.load(str(p))
        rows.append({**config.config_summary(cfg), "default": cfg.name == config.DEFAULT_MODEL, "needs": needs(cfg),
                     "sglang": sglang_support(cfg)})
    if json_:
        output.print_json(rows)
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        output.line(f"{r['name']:<{width}} {'*' if r['default'] else ' '} {r['source']:<21} {r['dtype']:<9} "
                    f"r{r['rank']:<2} x{r['targets']}  {_needs_text(r['needs']):<32} {r['description']}")
    output.hint(f"* the default (run without --model: {config.DEFAULT_MODEL}); [extra]: pip install "
                "'lora-parity[extra]'; a hub id as source must be in the local Hugging Face cache; --sampler sglang "
                "serves any config without a launch plan, on one GPU (`--json`: key sglang)")


def init(
    folder: Annotated[Path, typer.Argument(help="Local HF checkpoint folder (config.json + safetensors).")],
    out: Annotated[Path | None, typer.Option("--out", help="Write the config here (default: stdout).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing --out file.")] = False,
) -> None:
    """Write a commented config YAML for a checkpoint folder to start from; run it with --model FILE."""
    from lora_parity.models.init_config import config_yaml
    from lora_parity.report.files import write_atomic

    text = config_yaml(folder)
    if out is None:
        output.print_text(text)
        return
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it")
    try:
        write_atomic(out, text)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write: {e.strerror or e}") from None
    output.line(str(out))
    output.hint(f"next: lora-parity run --model {shlex.quote(str(out))}")
