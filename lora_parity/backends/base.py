"""The two roles (a trainer owns the LoRA adapter being trained; a sampler serves its published versions), what each
backend declares about itself, and how every backend is built.

Token alignment (the rule every other module points to as "the alignment rule in backends/base.py"): for a sequence of n
token ids, every `score` returns n - 1 values, and entry t is log p(tokens[t+1] | tokens[:t+1]), computed in fp32 from
the model's logits. There is no value for the first token; an engine that returns one for it (vLLM's `prompt_logprobs`
entry 0 is None) drops it and checks the length. Sequences are grouped into forwards or requests by the config
(`scoring`, `groups`), the same way in every phase, because batching changes numbers on real backends.

A backend class states its capabilities once, in `traits` (a `BackendTraits`); its optional parts are the small
runtime-checkable protocols below (and `mixed_batch.MixedBatchSampler`, `sleep.SleepingSampler`), which callers test
with `isinstance`/`issubclass`, never by probing attributes. Every backend is built through `create(cfg, model_dir,
timings, options)`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from lora_parity.backends.grouping import groups as groups
from lora_parity.evidence.receipt import BackendInfo, Perturbation
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor

if TYPE_CHECKING:
    from lora_parity.backends.server_process import ServerProcess

Sequences = list[list[int]]
Scores = list[list[float]]
Routes = list[list[list[list[int]]]]
"""[sequence][token][MoE layer] -> the token's top-k expert ids, ascending."""
RouteTable = Mapping[tuple[int, ...], list[list[list[int]]]]
"""Each sequence's routes by its tokens ([token][MoE layer] -> expert ids): what a trainer replays."""


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json fields naming experts


def routes_experts(config: Mapping[str, object]) -> bool:
    """Whether a model's config (config.json's fields) names experts: routing can depend on what else is
    in the batch, so such a model is scored one sequence per forward or request, never packed."""
    return any(config.get(key) for key in MOE_KEYS)


@dataclass(frozen=True)
class AdapterHandle:
    """An adapter version the sampler has loaded."""

    name: str
    adapter_id: int
    path: Path


UNSERVABLE = "cannot serve an adapter with"
"""The words a sampler's refusal of an adapter its `adapter_needs` rules out carries."""


@dataclass(frozen=True)
class BackendTraits:
    """What a backend can do and needs, stated once per class (an instance may refine it when what it found at
    start-up decides, e.g. a service that cannot sample the base model)."""

    needs_checkpoint: bool = True
    """Loads the model from a local checkpoint folder (False: a service or a fake holds it)."""
    supports_tp: bool = False
    """Runs tensor parallel (`--tp N`)."""
    takes_service_options: bool = False
    """Talks to a service: built with the run's `url` and `base_model`."""
    shares_trainer_state: bool = False
    """Its adapters are handles on the trainer's own service: an old one may serve the trainer's current weights or
    write its own back into them (the sequence then re-checks both)."""
    releases_nothing_at_exit: bool = False
    """Holds only this process's memory: a process about to exit may skip `close`."""
    base_unavailable: str | None = None
    """Why the base model cannot be scored (the base phase is skipped), or None."""
    per_target_unavailable: str | None = None
    """Why per-target coverage cannot run (every target updates together), or None."""
    routing_unavailable: str | None = None
    """Why router top-k cannot be read from this backend, or None."""
    start_adapter_unavailable: str | None = "it cannot start from a user's adapter"
    """Why this trainer cannot start from a user's PEFT adapter (`--adapter`), or None (a trainer that can is also a
    `StartAdapterTrainer`)."""
    served_over_http: bool = False
    """A sampler served over HTTP (vllm-server, sglang): built with `sampler_url`, `api_key_env` and `shared_dir`, and
    the only one the serving-layer faults apply to."""
    rounding_unresolved: str | None = None
    """Why a fault that only rounds the adapter's values (fp16-export) stays below what this trainer's runs resolve,
    so the selftest leaves it out; or None."""
    same_name_reload_refused: str | None = None
    """Why reloading a loaded name without `load_inplace` is an error here (not a silent keep of the old adapter), so
    the faults that do only that do not apply; or None."""
    at_checkpoint_precision: bool = False
    """Scores in the checkpoint's own dtype on this machine (not fp32-exact, not a service of unknown precision):
    two such sides are about equally far from fp32, so `fp32_balance` applies only when trainer and sampler are."""
    mixed_batch_unavailable: str | None = "it scores one route per call (no `MixedBatchSampler`)"
    """Why this sampler cannot score routes mixed in one batch (that phase and its fault do not apply), or None."""
    sleep_unavailable: str | None = "it has no sleep mode lora-parity drives (no `SleepingSampler`)"
    """Why this sampler cannot sleep and wake (the sleep phases and their faults do not apply), or None."""
    reads_prefix_cache: bool = False
    """Its phases also score through its prefix cache (a `CachedScoringSampler` as built): the faults on it apply."""
    reload_gets_fresh_cache: str | None = None
    """Why a reload under a loaded name and path never reads the old adapter's prefix-cache blocks here (each load
    gets a cache namespace of its own), so the fault that counts on them (warm-prefix-cache) does not apply; or None."""
    unload_reloads: str | None = None
    """Why a request naming an adapter this sampler unloaded does not fail here (the server loads it again from its
    path), so the fault that counts on that failure (unload-before-score) does not apply; or None."""
    adapter_needs: tuple[tuple[str, str], ...] = ()
    """(kind, needed kind): this sampler cannot serve an adapter whose module path has a LoRA on the first
    kind but none on the second (SGLang stacks q/k/v and gate/up itself); such an adapter is refused
    before it is loaded, with an error that says `UNSERVABLE` (`lora_targets.unpaired_target`)."""


@dataclass(frozen=True)
class BackendOptions:
    """Run options a backend may use when it is built; each backend takes what applies to it."""

    seed: int = 0
    """Run seed (trainer: LoRA A init)."""
    tp: int = 1
    """Tensor-parallel size (a trainer with `supports_tp`)."""
    url: str | None = None
    """Service URL (backends with `takes_service_options`)."""
    base_model: str | None = None
    """Base model name on the service (backends with `takes_service_options`)."""
    lora: bool = True
    """Sampler: serve with LoRA enabled (False in the merged sync modes: merged base weights alone)."""
    sampler_url: str | None = None
    """URL of a running server to attach to, instead of starting one (`served_over_http`)."""
    api_key_env: str | None = None
    """Environment variable holding that server's API key (`served_over_http`; never recorded)."""
    shared_dir: Path | None = None
    """Folder the attached server can read; adapters are copied there (`served_over_http`)."""
    batch_invariant: bool = True
    """Sampler: batch-invariant kernels where the build has them (vLLM on CUDA), SGLang's deterministic
    inference (`--no-batch-invariant` turns either off)."""
    server: ServerProcess | None = None
    """A server the run launched early for this sampler (`EarlyLaunchingSampler.launch_early`), which it adopts
    instead of launching its own (one already stopped is not adopted)."""


@dataclass(frozen=True)
class PreflightOptions:
    """What a backend's `preflight` may check before anything is loaded."""

    trainer: str
    sampler: str
    inject: str | None = None
    inject_rewrites_files: bool = False
    """The injected fault rewrites exported PEFT files (`FaultSpec.rewrites_files`): a trainer that exports none
    refuses it."""
    url: str | None = None
    base_model: str | None = None
    tp: int = 1
    sync: str = "new-id"
    sampler_url: str | None = None
    api_key_env: str | None = None
    shared_dir: Path | None = None


class Trainer(Protocol):
    """The side that updates the adapter."""

    traits: BackendTraits

    def score(self, sequences: Sequences) -> Scores:
        """Logprobs of the current model (base + adapter), per the alignment rule above."""
        ...

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        """Add seeded Gaussian noise N(0, std²) to every LoRA B tensor (or only those of target
        kind `only`), each seeded by sha256 of its logical name and `seed`; no optimizer. Refuses
        if a B tensor is non-zero before, or a non-adapter parameter is trainable."""
        ...

    def zero_b(self) -> None:
        """Set every LoRA B tensor back to zero (A unchanged)."""
        ...

    def export_adapter(self, directory: Path) -> Path:
        """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors) into a
        new folder `directory`; return it."""
        ...

    def info(self) -> BackendInfo:
        """Backend name, package versions and the settings that change numbers."""
        ...

    def close(self) -> None:
        """Free the model."""
        ...


class Sampler(Protocol):
    """The side that serves published adapter versions."""

    traits: BackendTraits

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Prompt logprobs of each sequence under `adapter` (None: the base model), per the alignment rule above."""
        ...

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """Load the PEFT adapter in `directory` under `name` and `adapter_id`. With `inplace`, an
        adapter already loaded under that id is replaced; without it, the engine may keep
        serving what it has under that id (the real engines do)."""
        ...

    def retire(self, handle: AdapterHandle) -> None:
        """Unload an adapter version and drop cached state (prefix cache)."""
        ...

    def info(self) -> BackendInfo:
        """Backend name, package versions and the settings that change numbers."""
        ...

    def close(self) -> None:
        """Shut the engine down."""
        ...


@runtime_checkable
class MergingTrainer(Protocol):
    """A trainer that can merge alpha/r·BA into its base weights (the merged sync modes)."""

    def merged_tensors(self) -> Any:
        """The base weights with the adapter merged in (fp32 merge, cast back), under the base
        model's names; the trainer itself stays unmerged."""
        ...

    def export_merged(self, directory: Path) -> Path:
        """Write the merged weights as a checkpoint folder `directory`; return it."""
        ...


@runtime_checkable
class BaseResettingSampler(Protocol):
    """A sampler that loads its checkpoint's own base weights again in place (after a level-2 sleep)."""

    def reset_base(self) -> None: ...


@runtime_checkable
class BaseReloadingSampler(BaseResettingSampler, Protocol):
    """A sampler that also replaces its base weights in place (the merged sync modes): from a checkpoint folder, or
    from tensors in memory."""

    def reload_base(self, folder: Path | None = None, tensors: Any = None) -> None: ...


@runtime_checkable
class TensorAdapterSampler(Protocol):
    """A sampler that loads an adapter from tensors sent in memory (`--sync tensors`) rather than from a
    folder it reads itself."""

    def publish_tensors(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """Send the PEFT folder's tensors and config under `name` (as `Sampler.publish`, without the
        sampler reading the folder); with `inplace`, replace what it serves under that name."""
        ...


@runtime_checkable
class CachedScoringSampler(Protocol):
    """A sampler that can also score the way rollouts read its prefix cache (the sequence then adds
    the phases stale_cached and updated_cached)."""

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """The same values as `score` (the alignment rule above), computed as a rollout reads them: through
        the prefix cache (a request per prefix, its next token forced; in-process vLLM, per block of the cache)."""
        ...


@runtime_checkable
class RoutingIntrospection(Protocol):
    """A backend that reports MoE routing."""

    def router_topk(self, sequences: Sequences) -> Routes | None:
        """Each token's top-k expert ids per MoE layer ([sequence][token][layer]); None for a dense model."""
        ...


@runtime_checkable
class RouteReturningSampler(Protocol):
    """A sampler that returns the experts each scoring pass routed every token to (route replay, docs/moe.md);
    `traits.routing_unavailable`, where an instance sets it, says why this one cannot after all."""

    def score_with_routes(self, sequences: Sequences, adapter: AdapterHandle | None) -> tuple[Scores, Routes]:
        """`score`'s values, and the top-k experts of every token in each MoE layer of the same pass."""
        ...


@runtime_checkable
class RouteReplayingTrainer(Protocol):
    """A trainer whose MoE routers can be made to take given experts (route replay, R3)."""

    def moe_layers(self) -> int:
        """The model's MoE layers (0: a dense model, nothing to replay)."""
        ...

    def replayed_weights(self) -> str:
        """How the routing weights of replayed experts are computed (for the receipt)."""
        ...

    def replaying(self, routes: RouteTable) -> AbstractContextManager[None]:
        """Within: every forward (score, step) of a sequence in `routes` sends each token to those experts in each
        MoE layer, the routing weights still its own router's over them; any other sequence is refused."""
        ...


@runtime_checkable
class GeneratingSampler(Protocol):
    """A sampler that also generates (the `sampled` probes and the generation path after sync)."""

    def generate(self, prompts: Sequences, max_tokens: int, seed: int,
                 adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
        """Sample exactly `max_tokens` tokens after each prompt (the config's `sampler.sampling` where the sampler takes
        it, else temperature 1; no stop token, request i seeded with `seed + i`) under `adapter` (None: the base model).
        Returns each prompt + completion, and its raw logprobs by the alignment rule above: entry t is what the same
        request gave token t+1, its prompt logprob for a prompt token, the one it was drawn with for a generated one."""
        ...


@runtime_checkable
class SteppingTrainer(Protocol):
    """A trainer that takes one optimizer step on its LoRA A and B tensors (`--update step`)."""

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> Perturbation:
        """One AdamW step (fresh state, no weight decay) on every lora_A and lora_B (or target kind `only`'s),
        raising the mean logprob of `sequences` over their scored positions (the alignment rule above);
        dropout 0. Refuses unless every LoRA tensor is at the start point; `zero_b` puts them all back."""
        ...


@runtime_checkable
class TensorReadingTrainer(Protocol):
    """A trainer whose current LoRA tensors can be read as they are (the exact sync check, X)."""

    def lora_tensors(self) -> dict[str, RawTensor]:
        """Every LoRA A and B the model holds now, whole (gathered over ranks), in PEFT's saved names
        and the trainer's own dtype, read from the model itself, not through `export_adapter`."""
        ...


@runtime_checkable
class WeightVersionSampler(Protocol):
    """A sampler whose engine reports its weight version now (vLLM's `get_weight_version`, `GET /weight_info`;
    SGLang's `/model_info`), or None where this engine reports none."""

    def weight_version(self) -> str | None: ...


PointScores = list[list[list[float]]]
"""Scores of one probe set at each of several points (one `Scores` per set of LoRA tensors)."""


@runtime_checkable
class MirroredSampler(Protocol):
    """A sampler whose arithmetic can be reproduced outside it, bit for bit (the exact reference, E)."""

    def exact_scorer(self, base: Any = None) -> Callable[[Sequences, list[Mapping[str, RawTensor]]], PointScores]:
        """A scorer of the sampler's own model (from the run's fp32 load `base` where it may) with each given set of
        LoRA tensors (PEFT's saved names), as the sampler computes; `ConfigError` with the reason where it cannot."""
        ...


@runtime_checkable
class LayerSubsetTrainer(Protocol):
    """A trainer whose update can be restricted to some decoder layers (per-layer coverage)."""

    def layers(self) -> list[int]:
        """The decoder layers that hold LoRA tensors, ascending."""
        ...

    def restricted_to(self, layers: Collection[int]) -> AbstractContextManager[None]:
        """Within: `perturb` (and so the calibration's) updates only those layers' tensors."""
        ...


@runtime_checkable
class StartAdapterTrainer(Protocol):
    """A trainer that can start from a user's PEFT adapter (`--adapter`) instead of zero-init."""

    def load_start_adapter(self, folder: Path) -> None:
        """Load the adapter's A and B (rank, alpha and targets already match it: the run's config is taken from its
        adapter_config.json). From then on `zero_b` restores this B, and `perturb` accepts a B equal to it."""
        ...


@runtime_checkable
class EarlyLaunchingSampler(Protocol):
    """A sampler that runs a server of its own, which the run may launch before it imports the
    trainer's libraries, so that the two overlap (`lora_parity.run.early_launch`)."""

    @classmethod
    def launch_early(cls, cfg: ModelConfig, model_dir: Path, options: BackendOptions) -> ServerProcess | None:
        """Launch the server this sampler would launch for `cfg` and the checkpoint `model_dir`, and
        return at once (None where it would start none: attached to a server by URL). Given back
        in `BackendOptions.server`, `create` adopts it; the caller stops it if no sampler does."""
        ...


class Backend:
    """Base class of every backend: its traits, its preflight, and the one factory signature."""

    traits: BackendTraits = BackendTraits()

    @classmethod
    def preflight(cls, opts: PreflightOptions) -> None:
        """Check, before anything is loaded, that this run can work; raise `ConfigError` if not.
        Nothing to check by default."""


class TrainerBackend(Backend, Trainer):
    """Base class of the trainer backends (a backend still defines every `Trainer` method)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, seed: int, timings: dict[str, float]) -> None:
        """Load the model (each backend defines it; this states the signature `create` calls)."""

    @classmethod
    def check_config(cls, hf_config: dict[str, Any], tp: int) -> None:
        """Preflight: raise `ConfigError` if the checkpoint's config.json (a dict) cannot be built at
        tensor-parallel size `tp`. Nothing to check by default."""

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> Self:
        """Build the trainer for a run (`timings` receives its load times)."""
        return cls(cfg, model_dir, options.seed, timings)


class SamplerBackend(Backend, Sampler):
    """Base class of the sampler backends (a backend still defines every `Sampler` method)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
                 lora: bool = True) -> None:
        """Start the engine (each backend defines it; this states the signature `create` calls)."""

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> Self:
        """Build the sampler for a run (`timings` receives its start times)."""
        return cls(cfg, model_dir, timings, lora=options.lora)

    @classmethod
    def built_traits(cls, cfg: ModelConfig) -> BackendTraits:
        """The traits of the sampler `create` builds for `cfg` (preflight's: a class may build a subclass)."""
        return cls.traits
