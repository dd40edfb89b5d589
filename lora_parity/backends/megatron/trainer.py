"""The `megatron` trainer (`MegatronTrainer`): a megatron-core `GPTModel` (local layer spec, no
Transformer Engine) built from an HF checkpoint, with the project's own tensor-parallel LoRA,
exported in PEFT format. The package docstring describes the layout; this module is the calling
process's side.

Token alignment: as `backends.base.Trainer.score` states it; one sequence per forward, fp32
log-softmax of the logits gathered over the vocabulary shards.

Processes: at TP=1 the model lives in the calling process. At TP=N it lives in N rank processes
(`ranks`, `serve`) that this process drives over a pipe to rank 0. Under torchrun the entry point
is `python -m lora_parity.launch`: its rank 0 runs the CLI, the other ranks serve the trainer.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lora_parity.backends.base import (
    BackendOptions,
    BackendTraits,
    Routes,
    RouteTable,
    Scores,
    Sequences,
    TrainerBackend,
)
from lora_parity.evidence.receipt import BackendInfo, Perturbation
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.util.errors import ConfigError

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    raise ModuleNotFoundError("No module named 'megatron.core'", name="megatron-core")

# Imported after the check above, so that a missing megatron-core names the extra to install.
from lora_parity.backends.megatron import cpu, protocol
from lora_parity.backends.megatron.layout import Shape, check_targets, read_shape
from lora_parity.backends.megatron.ranks import RankProcesses
from lora_parity.backends.megatron.routes import REPLAYED_WEIGHTS
from lora_parity.backends.megatron.shards import Shard


def _torchrun_world() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (or another env:// launcher), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


class MegatronTrainer(TrainerBackend):
    """megatron-core GPTModel with LoRA; TP=1 in this process, TP=N in N rank processes it drives."""

    traits = BackendTraits(supports_tp=True, start_adapter_unavailable=None, at_checkpoint_precision=True)

    @classmethod
    def check_config(cls, hf_config: dict[str, Any], tp: int) -> None:
        """The checkpoint's shape divides at `--tp` (heads, KV heads, intermediate_size, vocabulary)."""
        Shape.from_hf(hf_config, tp)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> MegatronTrainer:
        """Build the trainer with the run's tensor-parallel size."""
        assert model_dir is not None
        return cls(cfg, model_dir, options.seed, timings, tp=options.tp)

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, timings: dict[str, float], tp: int = 1) -> None:
        self.cfg, self.tp = cfg, tp
        start = time.perf_counter()
        self.shape = read_shape(model_dir, tp)  # bad input fails here, before any process starts
        check_targets(self.shape, cfg.adapter.targets)
        protocol.rank_timeout(os.environ)
        torchrun = _torchrun_world()
        if torchrun is not None and os.environ.get("RANK") != "0":
            raise ConfigError("under torchrun, launch `-m lora_parity.launch`: its rank 0 runs the "
                              "sequence, the other ranks serve the trainer")
        if torchrun is not None and torchrun != tp:
            raise ConfigError(f"--tp {tp}, but torchrun started {torchrun} processes: they must match")
        self.shard: Shard | None = None
        self.ranks: RankProcesses | None = None
        request = {"config": cfg.model_dump(mode="json"), "model_dir": str(model_dir), "seed": seed}
        if tp == 1:
            self.layout = "in-process"
            with cpu.cpu_current_device():
                self.shard = Shard(cfg, Path(model_dir), seed)
            described = self.shard.describe()
        else:
            self.layout = "torchrun" if torchrun is not None else "spawned"
            self.ranks = RankProcesses(tp, torchrun=torchrun is not None)
            try:
                described = self.ranks.call("init", request)
            except BaseException:
                self.ranks.close()
                raise
        self.described = described
        timings["trainer.load"] = time.perf_counter() - start

    def _call(self, method: str, **args: Any) -> Any:
        if self.ranks is not None:
            return self.ranks.call(method, args)
        assert self.shard is not None
        with cpu.cpu_current_device():
            return getattr(self.shard, method)(**args)

    def score(self, sequences: Sequences) -> Scores:
        """Entry t = log p(s[t+1] | s[:t+1]); len(s) - 1 values per sequence."""
        scores: Scores = self._call("score", sequences=sequences)
        return scores

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """Each token's own top-k experts per MoE layer under the current adapter (None: a dense model), read
        by megatron-core's router replay (RECORD), never replayed."""
        routes: Routes | None = self._call("router_topk", sequences=sequences)
        return routes

    def moe_layers(self) -> int:
        """The model's MoE layers (0: dense)."""
        return int(self.described["settings"].get("moe_layers", 0))

    def replayed_weights(self) -> str:
        """How replayed experts are weighed (`routes.REPLAYED_WEIGHTS`), with this model's norm_topk_prob."""
        return f"{REPLAYED_WEIGHTS}; this model: Qwen3-MoE norm_topk_prob={self.shape.norm_topk_prob}"

    @contextlib.contextmanager
    def replaying(self, routes: RouteTable) -> Iterator[None]:
        """Every forward within (score, step) routes the tokens of `routes`' sequences as given, through
        megatron-core's router replay (`routes.Routing`); the routes cross to the ranks as JSON."""
        self._call("replay", routes=[[list(seq), token_routes] for seq, token_routes in routes.items()])
        try:
            yield
        finally:
            self._call("replay", routes=None)

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        """Seeded noise on every B (or kind `only`'s rows), seeded per PEFT tensor name."""
        return Perturbation.model_validate(self._call("perturb", std=std, seed=seed, only=only))

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> Perturbation:
        """`--update step`: one AdamW step on every LoRA A and B (or kind `only`'s), autograd through
        megatron-core at any TP (`megatron.step`); the start adapter must be loaded (the warm start)."""
        return Perturbation.model_validate(self._call("step", sequences=sequences, learning_rate=learning_rate,
                                                      seed=seed, only=only))

    def zero_b(self) -> None:
        """Every LoRA tensor back to the start point: B to zero or the start adapter's, A to the start
        adapter's (a step moves it)."""
        self._call("zero_b")

    def load_start_adapter(self, folder: Path) -> None:
        """Start from a PEFT adapter: its fused parts become blocks of the fused layers (`blocks`), so
        `zero_b` restores it, `perturb` moves each part's own block, and the export gives it back."""
        added = self._call("load_start_adapter", folder=str(Path(folder).resolve()))
        self.described["settings"].update(added)

    def lora_tensors(self) -> dict[str, RawTensor]:
        """The whole PEFT tensors as the ranks hold them (fused layers split, shards gathered), read from
        the model, not through the export's writer."""
        raw = self._call("lora_tensors")
        return {n: (d, list(shape), base64.b64decode(data)) for n, (d, shape, data) in raw.items()}

    def export_adapter(self, directory: Path) -> Path:
        """PEFT folder: fused tensors split, shards gathered, `base_model.model.` names."""
        self._call("export", directory=str(directory))
        return Path(directory)

    def info(self) -> BackendInfo:
        """Versions and settings, with the process layout."""
        settings = {**self.described["settings"], "tensor_parallel": self.tp, "processes": self.layout}
        return BackendInfo(backend="megatron", versions=self.described["versions"], settings=settings)

    def close(self) -> None:
        """Stop the rank processes, or free the in-process model."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.shard is not None:
            self.shard.close()
            self.shard = None
