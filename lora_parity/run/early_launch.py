"""A served sampler's server launched early (issue 17): as soon as the sampler's own preflight has
passed and the checkpoint is on disk, before the trainer's libraries are imported (torch,
transformers, PEFT: about 3 s on 2 cores), so that their import overlaps the server's start.

`runner.prepare(..., launch_early=True)` calls `launch` and keeps the server in `Plan.server`; a
later refusal stops it there, the sampler adopts it (`BackendOptions.server`), and `runner.execute`
stops it at the end if no sampler did. Nothing here is global: the handle is the plan's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_parity.backends.base import BackendOptions, EarlyLaunchingSampler, SamplerBackend
from lora_parity.models import synthetic
from lora_parity.models.config import ModelConfig

if TYPE_CHECKING:
    from lora_parity.backends.server_process import ServerProcess


def launch(cfg: ModelConfig, sampler_cls: type[SamplerBackend], options: BackendOptions) -> ServerProcess | None:
    """The sampler's server, launched now (not waited for), where the sampler launches one
    (`EarlyLaunchingSampler`) and `synthetic.cached` finds the checkpoint already on disk; else
    None (the sampler then launches its own when it is created, after the checkpoint is built)."""
    if not issubclass(sampler_cls, EarlyLaunchingSampler):
        return None
    model_dir = synthetic.cached(cfg)
    return None if model_dir is None else sampler_cls.launch_early(cfg, model_dir, options)


def stop(server: ServerProcess | None) -> None:
    """Stop a server launched early (a no-op for None or one already stopped by its sampler)."""
    if server is not None:
        server.stop()
