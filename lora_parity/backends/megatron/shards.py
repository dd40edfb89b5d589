"""One tensor-parallel rank's megatron-core GPTModel with LoRA (`Shard`): built from an HF checkpoint,
scored, perturbed, and its adapter shards gathered and exported in PEFT format.

Every seeded tensor is drawn whole and then sharded (`layout.tp_slice`, `layout.shard_fused`), so
TP=1 and TP=N hold the same adapter. The perturbation is defined on the PEFT tensors the export
writes: B's noise for q_proj, k_proj, v_proj (gate_proj, up_proj) is drawn with the seed and shape
the `hf` trainer uses for that name, then interleaved into the fused B exactly as the base weights
are. The export splits the fused B back, repeats the shared A for each part, and gathers the shards.
A user's adapter (`--adapter`) is held in the fused layers as blocks, one per part (`blocks`): the
noise then goes into each part's own block and the export takes each part's block back out.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lora_parity.backends.base import Scores, Sequences
from lora_parity.backends.megatron import blocks, cpu, model, routes
from lora_parity.backends.megatron import step as step_module
from lora_parity.backends.megatron.layout import (
    LORA_MODULES,
    MODULE_MAP,
    MODULE_OF_KIND,
    LoraModule,
    check_targets,
    full_a_name,
    hf_weight_plan,
    peft_name,
    read_shape,
    shard_weight,
    tp_slice,
    unshard_fused,
)
from lora_parity.backends.megatron.lora import LoRALinear
from lora_parity.backends.raw_tensors import to_raw_all
from lora_parity.evidence.receipt import Perturbation
from lora_parity.models import adapter_files as af
from lora_parity.models.config import ModelConfig
from lora_parity.models.perturb import add_noise, noise_seed
from lora_parity.util.errors import ConfigError, PhaseError

_PEFT_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _load_hf_tensors(model_dir: Path, names: set[str]) -> Callable[[str], torch.Tensor]:
    """A getter over the checkpoint's safetensors files (safetensors only; never pickles)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                where[k] = f
    missing = sorted(names - where.keys())
    if missing:
        raise ConfigError(f"{model_dir}: checkpoint lacks {missing[0]}" + (f" (+{len(missing) - 1} more)"
                                                                          if len(missing) > 1 else ""))
    extra = sorted(k for k in where if k not in names and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(f"{model_dir}: the megatron trainer would ignore {extra[0]}"
                          + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))

    def get(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name)

    return get


class Shard:
    """One tensor-parallel rank's GPTModel with LoRA. Every method is collective: all ranks call it
    with the same arguments (rank 0's answer is the one returned to the driver)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path, seed: int, tp: int = 1, control_group: Any = None) -> None:
        mcore = cpu.import_megatron()
        from megatron.core import parallel_state

        self._parallel_state = parallel_state
        self.owns_default_group = self.owns_parallel_state = False
        try:
            with cpu.quiet():
                self._build(cfg, model_dir, seed, tp, control_group)
        except BaseException:
            self._teardown()
            raise
        self.megatron_version = mcore.__version__

    def _build(self, cfg: ModelConfig, model_dir: Path, seed: int, tp: int, control_group: Any) -> None:
        from megatron.core import parallel_state

        self.cfg, self.seed = cfg, seed
        self.control_group = control_group
        if parallel_state.model_parallel_is_initialized():
            raise PhaseError("megatron-core's parallel state is already set up in this process: "
                             "one megatron trainer per process (close the other first)")
        self._join_default_group(tp)
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() \
            else torch.device("cpu")
        self.shape = read_shape(model_dir, self.tp)
        self.dtype: torch.dtype = getattr(torch, cfg.model.dtype)
        self.targets = list(cfg.adapter.targets)
        self.blocks = blocks.layer_blocks(self.targets, cfg.adapter.rank, imported=False)
        self.start_b: list[dict[str, torch.Tensor]] | None = None
        """Each layer's B of each module as the starting adapter left it (`load_start_adapter`); None: zero."""
        self.start_a: list[dict[str, torch.Tensor]] | None = None
        """Each layer's A of each module as the starting adapter left it; None: as initialized (`_init_a`)."""
        unknown = [t for t in self.targets if t not in MODULE_OF_KIND]
        if unknown:
            raise ConfigError(f"the megatron trainer has no LoRA target {unknown[0]!r}; "
                              f"targets: {', '.join(MODULE_OF_KIND)}")
        check_targets(self.shape, self.targets)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        self.owns_parallel_state = True
        cpu.install_rng_tracker()
        self.model = model.gpt_model(self.shape, self.tp, self.dtype, self.device)
        self.routing = routes.Routing(self.model, self.shape.num_experts, self.shape.top_k)
        # The local spec's torch norms are built without a dtype (fp32); Megatron's bf16/fp16
        # training runs the model under Float16Module, which casts every parameter to that dtype.
        for module in self.model.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.to(self.dtype)
        self._load_base(model_dir)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._wrap_lora(cfg)
        self.model.eval()

    def _join_default_group(self, tp: int) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            # In-process TP=1 without a sampler holding the default group (the hf sampler, tests).
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self.owns_default_group = True
        self.tp, self.rank = dist.get_world_size(), dist.get_rank()
        if self.tp != tp:
            raise PhaseError(f"this process's default process group has {self.tp} ranks, not the --tp {tp} "
                             "the trainer needs")

    def _wrap_lora(self, cfg: ModelConfig) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        self.layers: list[dict[str, LoRALinear]] = []
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for i, layer in enumerate(self.model.decoder.layers):
            wrapped = {}
            for m in LORA_MODULES:
                if not any(k in self.targets for k in m.kinds):
                    continue
                parent = getattr(layer, m.block)
                lora = LoRALinear(getattr(parent, m.name), m.column_parallel, cfg.adapter.rank, cfg.adapter.alpha,
                                  tp_group, reduce_from_tensor_model_parallel_region,
                                  copy_to_tensor_model_parallel_region)
                setattr(parent, m.name, lora)
                wrapped[m.name] = lora
                self._init_a(i, m, lora)
            self.layers.append(wrapped)

    # Loading and initialisation.

    def _load_base(self, model_dir: Path) -> None:
        plan = hf_weight_plan(self.shape)
        get = _load_hf_tensors(model_dir, {n for _, _, names in plan for n in names})
        params = dict(self.model.named_parameters())
        expected = {n for n in params if not n.endswith("_extra_state")}
        planned = {name for name, _, _ in plan}
        if expected != planned:
            raise PhaseError(f"megatron-core parameters differ from the HF mapping: "
                             f"{sorted(expected ^ planned)[:3]}")
        with torch.no_grad():
            for name, layout, hf_names in plan:
                local = shard_weight(layout, [get(n) for n in hf_names], self.rank, self.tp, self.shape)
                if tuple(local.shape) != tuple(params[name].shape):
                    raise PhaseError(f"{name}: HF gives {tuple(local.shape)}, megatron-core holds "
                                     f"{tuple(params[name].shape)}")
                params[name].copy_(local.to(params[name].dtype))

    @torch.no_grad()
    def _init_a(self, layer: int, module: LoraModule, lora: LoRALinear) -> None:
        a = lora.adapter.linear_in.weight
        fan_in = a.shape[1] * (1 if module.column_parallel else self.tp)
        generator = torch.Generator().manual_seed(noise_seed(full_a_name(layer, module), self.seed))
        bound = 1.0 / fan_in**0.5
        full_a = (torch.rand((a.shape[0], fan_in), generator=generator, dtype=torch.float32) * 2 - 1) * bound
        start, stop = tp_slice(fan_in, self.rank, self.tp)
        local = full_a if module.column_parallel else full_a[:, start:stop]
        a.copy_(local.to(device=a.device, dtype=a.dtype))
        lora.adapter.linear_out.weight.zero_()

    # Collectives over the control group (CPU tensors, gloo).

    def _sum_over_ranks(self, value: int) -> int:
        if self.control_group is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, group=self.control_group)
        return int(t.item())

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        if self.control_group is None:
            return [local.detach().cpu()]
        import torch.distributed as dist

        local = local.detach().cpu().contiguous()
        out = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(out, local, group=self.control_group)
        return out

    # The Trainer operations.

    def _logits(self, seq: list[int]) -> torch.Tensor:
        """[1, n, vocab]: one sequence's forward, explicit causal mask, logits gathered over the vocabulary."""
        ids = torch.tensor([seq], device=self.device)
        positions = torch.arange(len(seq), device=self.device)[None]
        return self.model(ids, positions, cpu.causal_mask(len(seq), self.device), runtime_gather_output=True)

    def logits(self, seq: list[int]) -> torch.Tensor:
        """`_logits`, the MoE routers replaying `seq`'s routes where routes are replayed (`replay`)."""
        with self.routing.forward(seq):
            return self._logits(seq)

    @torch.no_grad()
    def score(self, sequences: Sequences) -> Scores:
        """Entry t = log p(s[t+1] | s[:t+1]); one sequence per forward; fp32 log-softmax of the
        vocabulary-gathered logits."""
        out: Scores = []
        for seq in sequences:
            ids = torch.tensor(seq[1:], device=self.device)[:, None]
            logprobs = torch.log_softmax(self.logits(seq)[0, :-1].float(), dim=-1).gather(1, ids)[:, 0]
            out.append(logprobs.cpu().tolist())
        return out

    def replay(self, routes: list[list[Any]] | None) -> None:
        """From now on every forward replays `routes` ([[sequence, [token][MoE layer] -> experts], ...]) in the
        MoE routers (`routes.Routing`); None: the routers choose again."""
        self.routing.replay(routes)

    @torch.no_grad()
    def router_topk(self, sequences: Sequences) -> list[Any] | None:
        """Each token's own top-k experts per MoE layer under the current adapter, never replayed (None: dense)."""
        return self.routing.own(sequences, self._logits)

    def _noise(self, name: str, rows: int, std: float, seed: int) -> torch.Tensor:
        # Exactly the `hf` trainer's draw for the PEFT tensor `name`.
        generator = torch.Generator().manual_seed(noise_seed(name, seed))
        return torch.randn((rows, self.cfg.adapter.rank), generator=generator, dtype=torch.float32) * std

    def update_kinds(self, verb: str, only: str | None, what: str) -> list[str]:
        """The target kinds an update moves (every one, or `only`), after refusing (on every rank) one
        that would also move a non-adapter parameter left trainable."""
        trainable = [n for n, p in self.model.named_parameters() if p.requires_grad and ".adapter." not in n]
        if self._sum_over_ranks(len(trainable)):
            raise PhaseError(f"refusing to {verb}: non-adapter parameter {(trainable or ['?'])[0]} is trainable")
        kinds = [k for k in self.targets if only is None or k == only]
        if not kinds:
            raise PhaseError(f"no {what} of {only} to {verb}")
        return kinds

    @torch.no_grad()
    def perturb(self, std: float, seed: int, only: str | None = None) -> dict[str, Any]:
        """Add the seeded noise of each PEFT B tensor (or those of kind `only`) to this rank's B rows."""
        kinds = self.update_kinds("perturb", only, "LoRA B tensors")
        updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        names: list[str] = []
        num_elements = 0
        moved = torch.zeros((), dtype=torch.int64, device=self.device)  # one host sync, not one per module
        for i, wrapped in enumerate(self.layers):
            for m in LORA_MODULES:
                chosen = [k for k in m.kinds if k in kinds]
                if not chosen:
                    continue
                b = wrapped[m.name].adapter.linear_out.weight
                noise, mask = self._module_noise(i, m, chosen, std, seed)
                names += [peft_name(i, k, "lora_B") for k in chosen]
                num_elements += sum(self.shape.out_features(k) * self.cfg.adapter.rank for k in chosen)
                moved += torch.count_nonzero(b[mask] != self._start_b(i, m.name, b)[mask])
                updates.append((b, noise, mask))
        if self._sum_over_ranks(int(moved.item())):
            raise PhaseError("refusing to perturb: a LoRA B tensor is non-zero before the update"
                             + (" (relative to the starting adapter's B)" if self.start_b is not None else ""))
        add_noise([(b, noise) for b, noise, _ in updates])
        return Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=len(names),
                            num_elements=num_elements, tensors=names).model_dump(mode="json")

    def _module_noise(self, layer: int, m: LoraModule, chosen: list[str], std: float,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one module's B noise (each part in `chosen` in its own block, zero
        elsewhere) and the mask of the elements it changes (on the model's device)."""
        drawn = {k: self._noise(peft_name(layer, k, "lora_B"), self.shape.out_features(k), std, seed) for k in chosen}
        noise, mask = blocks.noise_and_mask(m, drawn, self.blocks[m.name], self.shape, self.rank, self.tp)
        return noise, mask.to(self.device)

    def _start_b(self, layer: int, module: str, b: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(b) if self.start_b is None else self.start_b[layer][module]

    @torch.no_grad()
    def zero_b(self) -> None:
        """Every B back to the starting adapter's (zero at zero-init), and A to the starting adapter's
        where there is one (a step moves A; at zero-init nothing does)."""
        for i, wrapped in enumerate(self.layers):
            for name, lora in wrapped.items():
                b = lora.adapter.linear_out.weight
                b.copy_(self._start_b(i, name, b))
                if self.start_a is not None:
                    lora.adapter.linear_in.weight.copy_(self.start_a[i][name])

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> dict[str, Any]:
        """`--update step`: one AdamW step on A and B (`megatron.step`)."""
        return step_module.step(self, sequences, learning_rate, seed, only)

    @torch.no_grad()
    def load_start_adapter(self, folder: str) -> dict[str, Any]:
        """Start from the PEFT adapter in `folder` (every rank reads it): each fused layer holds its
        parts as blocks (`blocks`), the others the adapter's A and B as they are. The settings it adds."""
        from safetensors.torch import load_file

        tensors = load_file(str(Path(folder) / af.WEIGHTS_FILE))
        expected = blocks.expected_shapes(self.shape, self.targets, self.cfg.adapter.rank)
        odd = sorted(set(tensors) ^ set(expected)) or [n for n, t in tensors.items() if list(t.shape) != expected[n]]
        if odd:
            raise PhaseError(f"the adapter's tensors do not match its config's LoRA layers ({len(odd)} differ, "
                             f"e.g. {odd[0]})")
        self.blocks = blocks.layer_blocks(self.targets, self.cfg.adapter.rank, imported=True)
        for i, wrapped in enumerate(self.layers):
            for m in LORA_MODULES:
                if m.name in wrapped:
                    a, b = blocks.import_module(m, tensors, i, self.blocks[m.name], self.shape, self.rank, self.tp)
                    lora = wrapped[m.name]
                    lora.set_rank(a.shape[0])
                    lora.adapter.linear_in.weight.copy_(a.to(device=self.device, dtype=self.dtype))
                    lora.adapter.linear_out.weight.copy_(b.to(device=self.device, dtype=self.dtype))
        self.start_b = [{n: lora.adapter.linear_out.weight.detach().clone() for n, lora in wrapped.items()}
                        for wrapped in self.layers]
        self.start_a = [{n: lora.adapter.linear_in.weight.detach().clone() for n, lora in wrapped.items()}
                        for wrapped in self.layers]
        return {"start_adapter": self._import_description()}

    def _import_description(self) -> list[str]:
        rank = self.cfg.adapter.rank
        return [f"{name}: rank {blocks.module_rank(b)} = {len(b)} x {rank}, " +
                ("A stacked, B block-diagonal, " if len(b) > 1 else "") + f"scale alpha/{rank}"
                for name, b in self.blocks.items()]

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The whole PEFT tensors (gathered over ranks; every rank gets them)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, wrapped in enumerate(self.layers):
            for m in LORA_MODULES:
                if m.name not in wrapped:
                    continue
                a = wrapped[m.name].adapter.linear_in.weight
                b = wrapped[m.name].adapter.linear_out.weight
                if m.column_parallel:
                    whole_a = a.detach().cpu()
                    whole_b = unshard_fused(m.name, self._gather(b), self.shape) if len(m.kinds) > 1 \
                        else {m.kinds[0]: torch.cat(self._gather(b))}
                else:
                    whole_a = torch.cat(self._gather(a), dim=1)
                    whole_b = {m.kinds[0]: b.detach().cpu()}
                # Each part's block: at zero-init the shared A (a copy per part) and the whole B.
                for k, (part_a, part_b) in blocks.export_module(whole_a, whole_b, self.blocks[m.name]).items():
                    tensors[peft_name(i, k, "lora_A")] = part_a
                    tensors[peft_name(i, k, "lora_B")] = part_b
        return tensors

    def lora_tensors(self) -> dict[str, list[Any]] | None:
        """The whole PEFT tensors as [dtype, shape, base64 bytes] (rank 0; every rank gathers)."""
        tensors = self.adapter_tensors()
        if self.rank != 0:
            return None
        return {n: [d, shape, base64.b64encode(data).decode()] for n, (d, shape, data) in
                to_raw_all(tensors.items()).items()}

    def export(self, directory: str) -> str | None:
        """Write the PEFT adapter (rank 0); every rank takes part in the gather."""
        tensors = self.adapter_tensors()
        if self.rank != 0:
            return None
        files = {n: af.Tensor(_PEFT_DTYPES[t.dtype], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                 for n, t in tensors.items()}
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
            "r": self.cfg.adapter.rank, "lora_alpha": self.cfg.adapter.alpha, "lora_dropout": 0.0,
            "target_modules": sorted(self.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None,
        }
        af.write_adapter(Path(directory), config, files)
        return directory

    def describe(self) -> dict[str, Any]:
        """Versions and settings for the receipt."""
        settings: dict[str, Any] = {
            "dtype": self.cfg.model.dtype,
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "architecture": self.shape.architecture,
            "layer_spec": "megatron-core local (no Transformer Engine)",
            "rank": self.cfg.adapter.rank, "alpha": self.cfg.adapter.alpha, "targets": self.targets,
            "dropout": 0.0,
            "module_map": MODULE_MAP,
            "adapter_params": "adapter.linear_in = lora_A, adapter.linear_out = lora_B",
            "lora_a_init": "uniform ±1/sqrt(fan_in), seeded by sha256(name, seed), drawn whole then sharded",
            "forward": "one sequence per forward, explicit causal mask, logits gathered over the vocabulary, "
                       "log-softmax in fp32",
        }
        if self.shape.moe:
            settings.update(moe_experts=self.shape.num_experts, moe_top_k=self.shape.top_k,
                            moe_layers=len(self.routing.routers), moe_norm_topk_prob=self.shape.norm_topk_prob,
                            moe_layer="TopKRouter, allgather dispatcher, SequentialMLP, no aux loss, no capacity",
                            moe_router_replay="megatron-core RouterReplay (moe_enable_routing_replay)")
        if self.device.type == "cpu":
            settings["cpu_workarounds"] = ["inference rng tracker", "current_device -> cpu in trainer calls",
                                           "explicit causal mask", "gloo over loopback, cores / ranks threads"]
        return {"versions": {"torch": torch.__version__, "megatron-core": self.megatron_version},
                "settings": settings}

    def close(self) -> None:
        """Free the model and Megatron's process groups."""
        self.model = None
        self.layers = []
        self._teardown()

    def _teardown(self) -> None:
        import torch.distributed as dist

        if hasattr(self, "routing"):
            self.routing.close()

        if self.owns_parallel_state:
            self._parallel_state.destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_default_group = False

