"""The receipt: a strict, self-describing JSON record of one run, and how it is written and read.

Every model is frozen and forbids extra fields; every field carries a docstring, so that
`lora-parity schema` documents itself. The digest is the sha256 of the canonical JSON of the
receipt without its `digest` field (sorted keys, no spaces, ASCII).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError, field_validator

from lora_parity.evidence.receipt_io import MAX_RECEIPT_BYTES as MAX_RECEIPT_BYTES
from lora_parity.evidence.receipt_io import one_line, parse_json, read_bounded, write_text_atomic
from lora_parity.evidence.receipt_models import ATriangulation as ATriangulation
from lora_parity.evidence.receipt_models import (
    BucketStats as BucketStats,
)
from lora_parity.evidence.receipt_models import Budgets as Budgets
from lora_parity.evidence.receipt_models import Calibration as Calibration
from lora_parity.evidence.receipt_models import CalibrationStep as CalibrationStep
from lora_parity.evidence.receipt_models import (
    CheckStatus as CheckStatus,
)
from lora_parity.evidence.receipt_models import CRelative as CRelative
from lora_parity.evidence.receipt_models import (
    ErrorBreakdown as ErrorBreakdown,
)
from lora_parity.evidence.receipt_models import ErrorDetail as ErrorDetail
from lora_parity.evidence.receipt_models import GroupVerdict as GroupVerdict
from lora_parity.evidence.receipt_models import JsonScalar as JsonScalar
from lora_parity.evidence.receipt_models import LifecycleRow as LifecycleRow
from lora_parity.evidence.receipt_models import NoiseModel as NoiseModel
from lora_parity.evidence.receipt_models import NoiseRule as NoiseRule
from lora_parity.evidence.receipt_models import (
    PhaseStatus as PhaseStatus,
)
from lora_parity.evidence.receipt_models import Reference as Reference
from lora_parity.evidence.receipt_models import (
    RouterAgreement as RouterAgreement,
)
from lora_parity.evidence.receipt_models import (  # re-exported: callers import them from here
    Strict as Strict,
)
from lora_parity.evidence.receipt_models import ThresholdRecord as ThresholdRecord
from lora_parity.evidence.receipt_models import (
    Verdict as Verdict,
)
from lora_parity.evidence.receipt_models import Verdicts as Verdicts
from lora_parity.evidence.receipt_routes import RouteReplay as RouteReplay
from lora_parity.evidence.receipt_stats import Check as Check
from lora_parity.evidence.receipt_stats import ComparisonStats as ComparisonStats
from lora_parity.evidence.receipt_stats import DeltaStats as DeltaStats
from lora_parity.evidence.receipt_stats import WorstPosition as WorstPosition
from lora_parity.util.errors import ReceiptError

SCHEMA_VERSION = 1


class StartAdapter(Strict):
    """A user's PEFT adapter both sides start from (`--adapter`)."""

    name: str
    """The adapter folder's name (never its path on the machine)."""
    sha256: str
    """sha256 of adapter_config.json and adapter_model.safetensors (`lora_parity.run.start_adapter.digest`)."""
    base_model: str | None = None
    """base_model_name_or_path from its adapter_config.json, as written there."""


class Revision(Strict):
    """The commit under test."""

    commit: str
    """Commit id, or 'unknown'."""
    source: Literal["flag", "git", "unknown"]
    """Where the commit id came from: --revision, git in the working directory, or nowhere."""
    dirty: bool | None = None
    """Whether the git working tree had uncommitted changes (None when not from git)."""
    reason: str | None = None
    """Why the revision is unknown, when it is."""


class ModelInfo(Strict):
    """The base model both sides load."""

    name: str
    """Config name (or the checkpoint folder's name)."""
    source: str
    """Where the weights came from: 'synthetic:<config>' or a checkpoint folder's name."""
    config_digest: str
    """sha256 of the model config as loaded (the YAML's data, canonical JSON)."""
    weights_digest: str | None = None
    """sha256 of the checkpoint's safetensors files, when computed."""
    dtype: str
    """Weights and compute dtype, e.g. 'float32' or 'bfloat16'."""
    architecture: str | None = None
    """The HF architecture class name from config.json."""
    source_sha256: str | None = None
    """sha256 of the file the checkpoint was built from (the GGUF a registry package ships), when it
    was built from one."""


class BackendInfo(Strict):
    """One side of the comparison."""

    backend: str
    """Registered backend name, e.g. 'hf' or 'vllm'."""
    versions: dict[str, str]
    """Package versions the backend ran with."""
    settings: dict[str, JsonScalar | list[str]]
    """Settings that change numbers (dtype, LoRA rank, alpha, targets, engine options)."""


class Environment(Strict):
    """Where the run ran."""

    python: str
    """Python version."""
    platform: str
    """OS and machine."""
    torch: str | None = None
    """torch version, if loaded."""
    device: str
    """Compute device, e.g. 'cpu' or 'NVIDIA H200'."""
    hostname_digest: str | None = None
    """sha256 prefix of the host name: tells machines apart without naming them."""


class ProbeSource(Strict):
    """Where the probe token ids came from (`--probes`)."""

    kind: Literal["random", "text", "file", "sampled", "given"]
    """random: ids drawn uniformly from the vocabulary, seeded; text: windows of the public-domain
    text shipped with lora-parity, tokenized; file: a `.jsonl` file given on the command line;
    sampled: the text windows' first half as prompts, completed by the sampler at the start of
    the run (temperature 1, seeded, zero-init adapter); given: the ids the caller of the Python API
    handed in (`lora_parity.api.check`)."""
    file_name: str | None = None
    """The text or probe file's name (text and file)."""
    file_sha256: str | None = None
    """sha256 of the text (header removed) or of the probe file's bytes."""
    tokenizer: str | None = None
    """The tokenizer that turned text into ids ('tokenizer.json sha256 ...'); None when no text
    was tokenized."""


class Probes(Strict):
    """The fixed token sequences every phase scores."""

    set: str
    """Probe set name: 'default' or 'held-out'."""
    seed: int
    """Seed the sequences were drawn with."""
    sequences: list[list[int]]
    """Token ids per sequence; sequence s yields len(s) - 1 scored positions."""
    digest: str
    """sha256 of the canonical JSON of `sequences`."""
    num_scored_positions: int
    """Sum over sequences of len(s) - 1."""
    source: ProbeSource | None = None
    """Where the ids came from; None: the random source (receipts made before sources existed,
    and runs that name a random set)."""


class TensorChange(Strict):
    """How much one group of LoRA tensors (one target kind's lora_A, or its lora_B) moved in the update."""

    num_tensors: int
    """Tensors in the group (one per layer)."""
    l2_before: float
    """L2 norm of the group before the update (over all its elements)."""
    l2_change: float
    """L2 norm of the group's change (after − before)."""
    l2_change_bf16: float | None = None
    """L2 norm of the change once both ends are rounded to bf16 (to nearest even): what an engine that holds the
    adapter in bf16 (vLLM's default for a bf16 model) keeps of it; None in receipts made before it. A step finer
    than bf16 resolves at the start adapter's values keeps less than its L2, and the engine applies another update."""


class Perturbation(Strict):
    """The deterministic trainer-only update: seeded noise on LoRA B, or one optimizer step on A and B."""

    kind: Literal["lora_b_noise", "optimizer_step"]
    """What the update is: seeded Gaussian noise added to B, or one optimizer step."""
    seed: int
    """Run seed; each tensor's noise is seeded by sha256(name, seed)."""
    std: float
    """Standard deviation of the noise, fixed in the config before the run."""
    num_tensors: int
    """Number of B tensors changed."""
    num_elements: int
    """Number of elements changed."""
    tensors: list[str]
    """Names of the changed tensors."""
    learning_rate: float | None = None
    """Learning rate of the optimizer step (kind optimizer_step), fixed before the run; std is 0 then."""
    update_tokens: list[int] | None = None
    """Token ids of the fixed datum the optimizer step trained on (kind optimizer_step)."""
    scope: str | None = None
    """What the update changed, in words, where the backend cannot list the tensors (a Tinker service:
    num_tensors and num_elements are 0 and tensors is empty then)."""
    calibration: Calibration | None = None
    """How std was chosen (`perturbation.std: auto`); None: the config fixed it."""
    target_calibrations: dict[str, Calibration] | None = None
    """Per-target coverage: each target kind's own std search (`perturbation.std: auto`)."""
    recipe: str | None = None
    """How to rebuild the update from this record alone (kind lora_b_noise: the generator, the per-tensor
    seed and the noise's dtype; `lora_parity.models.perturb.RECIPE`). None in receipts made before it."""
    optimizer: str | None = None
    """The optimizer step's optimizer and its settings, in words (kind optimizer_step, `--update step`)."""
    objective: str | None = None
    """What the optimizer step maximised, in words (kind optimizer_step, `--update step`)."""
    tensor_changes: dict[str, TensorChange] | None = None
    """Per target kind and side ('q_proj.lora_A', 'q_proj.lora_B', ...): how far the step moved those
    tensors (a trainer that exposes them; None for a service, or noise)."""
    warm_std: float | None = None
    """`--update step`: std of the seeded warm start's B (A as initialized), the start point and adapter
    version 0; None for a run that starts from zero-init or the user's adapter."""


class AdapterVersion(Strict):
    """One adapter version published to the sampler."""

    version: int
    """0 = zero-init, 1 = updated, then per-target versions."""
    name: str
    """Adapter name the sampler knows it by."""
    adapter_id: int
    """Integer id the sampler knows it by."""
    mode: str
    """How it reached the sampler (e.g. 'new-id')."""
    seconds: float
    """Time to publish (export + load)."""
    weight_version: str | None = None
    """The engine's reported weight version once this version was published; None where it reports none (it
    never proves delivery: an adapter-only sync need not move it)."""
    file_differences: list[str] | None = None
    """The synced version's adapter file, read by lora-parity, against the trainer's tensors in memory: what differs
    beyond the rounding to the file's dtype ([]: exactly the trainer's adapter); None where not compared."""
    buckets: list[int] | None = None
    """The merged weights handed over in the user's buckets (`--loop bucket_mb`): each bucket's bytes, in the order
    sent (one the sender lost too: it believes it sent it); None where they went over at once."""
    split_modules: list[str] | None = None
    """The modules the engine packs into one (q/k/v, gate/up) whose parts went over in different buckets."""


HANDED_NOTHING = "the trainer handed no LoRA tensors"
"""Why a comparison with the trainer's tensors compared nothing (X's reason, the file side's entry end with it)."""
NOTHING_COMPARED = f"nothing compared: {HANDED_NOTHING}"
"""The `file_differences` entry where the trainer handed no tensors (then nothing is said of the file's tensors)."""


class PhaseRecord(Strict):
    """One step of the sequence."""

    name: str
    """Phase name."""
    status: PhaseStatus
    """ok or error."""
    seconds: float
    """Wall time of the phase."""
    message: str | None = None
    """The error message, when the phase failed."""
    error_type: str | None = None
    """The exception's type name, when the phase failed."""
    frames: list[str] | None = None
    """Its innermost frames, 'path:line function' (see `ErrorDetail.frames`), when the phase failed."""


SyncModeName = Literal["new-id", "inplace", "merged", "memory", "tensors", "user"]
"""The `--sync` modes (`lora_parity.run.sync`), and `user`: the caller's own sync (`lora_parity.api.check`)."""


class Receipt(Strict):
    """Everything one run did and saw; `lora-parity verify` re-derives every statistic from it."""

    schema_version: Literal[1]
    """Receipt schema version."""

    @field_validator("schema_version", mode="before")
    @classmethod
    def _integer_version(cls, value: Any) -> Any:
        # Literal[1] alone accepts true and 1.0 (they compare equal to 1).
        if type(value) is not int:
            raise ValueError("schema_version must be the integer 1")
        return value
    tool_version: str
    """lora-parity version."""
    created_at: str
    """UTC time the run started (ISO 8601)."""
    command: list[str]
    """The lora-parity arguments the run was started with."""
    revision: Revision
    """The commit under test."""
    model: ModelInfo
    """The base model."""
    trainer: BackendInfo
    """The trainer side."""
    sampler: BackendInfo
    """The sampler side."""
    environment: Environment
    """Where it ran."""
    budgets: Budgets
    """Thresholds applied."""
    probes: Probes
    """Token sequences scored."""
    perturbation: Perturbation | None
    """The update applied, once it was."""
    sync_mode: SyncModeName
    """How adapters reach the sampler."""
    adapters: list[AdapterVersion]
    """Adapter versions published, in order."""
    injected_fault: str | None
    """Fault injected on purpose (`--inject`), else None."""
    phases: list[PhaseRecord]
    """Phases run, in order, with status and time."""
    scores: dict[str, list[list[float]]]
    """Raw scores per phase: one list per probe sequence, entry t = log p(token t+1 | tokens ≤ t); `fresh` alone
    may be empty (no sequence: the trainer handed the exact sync check no tensors, so X compared nothing)."""
    comparisons: dict[str, ComparisonStats]
    """Statistics per comparison, recomputable from `scores`."""
    deltas: dict[str, DeltaStats]
    """Delta agreement per comparison, recomputable from `scores`."""
    checks: list[Check]
    """Checks, recomputable from `comparisons`, `deltas` and `budgets`."""
    verdict: Verdict
    """pass, fail, inconclusive, or error."""
    error: str | None
    """The error that stopped the run, if one did."""
    timings: dict[str, float]
    """Seconds per step: phases plus engine start, model load, each scoring pass, sync."""
    worst_positions: dict[str, list[WorstPosition]] | None = None
    """Per comparison, the positions with the largest |diff| (largest first), recomputable from
    `scores` and the probes; None in receipts made before it was recorded."""
    router: RouterAgreement | None = None
    """Router top-k agreement between trainer and sampler (MoE models); None for dense models."""
    route_replay: RouteReplay | None = None
    """Whether the trainer replayed the engine's expert routes, and which (MoE models); None: a dense model, or a
    receipt made before route replay."""
    breakdown: dict[str, ErrorBreakdown] | None = None
    """|diff| of A and C (trainer vs sampler) by probability bucket and position quartile; None in
    receipts made before it was recorded."""
    verdicts: Verdicts | None = None
    """The sync and numerics verdicts the run's verdict is made of; None in receipts made before."""
    error_detail: ErrorDetail | None = None
    """Where the error that stopped the run was raised; None: no error (or a receipt made before)."""
    reference: Reference | None = None
    """Whether the fp32 reference was scored, and why (not); None in receipts made before it was recorded."""
    exact_reference: Reference | None = None
    """Whether the exact reference (scores `exact.*`, checks E.*) was scored, and why (not); None in receipts made
    before it existed."""
    noise: NoiseModel | None = None
    """The noise measured at the start point, every threshold's input (`budgets.noise`); recomputable from
    `scores`. None: no start point was scored, or a receipt made before the noise model."""
    thresholds: dict[str, ThresholdRecord] | None = None
    """Per check id, the threshold derived before the checks ran and how; recomputable from `scores` and
    `budgets`. None in receipts made before it was recorded."""
    start_adapter: StartAdapter | None = None
    """The user's adapter both sides started from (`--adapter`); None: zero-init."""
    lifecycle: list[LifecycleRow] | None = None
    """The engine as deployed: each condition (graphs, sleep, prefix cache, decode path, ...) and whether this
    run covered it; recomputable from `phases` and `sampler.settings`. None in receipts made before it."""
    digest: str
    """sha256 of the canonical JSON of this receipt without `digest`."""


def canonical_json(data: Any) -> bytes:
    """The bytes the digest is computed over: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sha256_json(data: Any) -> str:
    """sha256 hex digest of `canonical_json(data)`."""
    return hashlib.sha256(canonical_json(data)).hexdigest()


def compute_digest(receipt_data: dict[str, Any]) -> str:
    """Digest of a receipt's JSON data, ignoring its `digest` field."""
    return sha256_json({k: v for k, v in receipt_data.items() if k != "digest"})


def seal(fields: dict[str, Any]) -> Receipt:
    """Validate receipt fields (without digest) and return the receipt with its digest set."""
    unsealed = Receipt.model_validate({**fields, "digest": "0" * 64}, strict=False)
    data = unsealed.model_dump(mode="json")
    return Receipt.model_validate({**data, "digest": compute_digest(data)}, strict=False)


def write_atomic(receipt: Receipt, path: Path, force: bool = False) -> Path:
    """Write the receipt to `path` atomically; refuse to overwrite an existing file unless `force`.
    If the write fails, the receipt goes to a fallback path, printed on stderr; returns the path
    written (see `receipt_io.write_text_atomic`)."""
    text = json.dumps(receipt.model_dump(mode="json"), indent=1, ensure_ascii=True, allow_nan=False) + "\n"
    return write_text_atomic(text, Path(path), force)


def load(path: Path) -> tuple[Receipt, dict[str, Any]]:
    """Read and validate a receipt file (a regular file of at most `MAX_RECEIPT_BYTES`); return it
    and its raw JSON data. Raises `ReceiptError` with a one-line message for an unreadable, non-UTF-8,
    truncated or malformed file (duplicate keys, non-finite numbers), schema-invalid data, and a
    digest mismatch."""
    text, data = parse_json(read_bounded(Path(path)), str(path))
    return validate(text, data, str(path)), data


def validate(text: str, data: dict[str, Any], name: str) -> Receipt:
    """The receipt in JSON `text` already parsed strictly into `data` (`receipt_io.parse_json`);
    `ReceiptError` (one line) if it does not match the schema or its digest."""
    try:
        receipt = Receipt.model_validate_json(text, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        where = one_line(".".join(str(p) for p in first.get("loc", ())) or "(top)")
        raise ReceiptError(
            f"{name}: does not match the receipt schema: {where}: {one_line(str(first.get('msg')))} "
            f"({e.error_count()} error(s))"
        ) from None
    except (RecursionError, OverflowError) as e:
        raise ReceiptError(f"{name}: does not match the receipt schema: {type(e).__name__}") from None
    expected = compute_digest(data)
    if receipt.digest != expected:
        raise ReceiptError(f"{name}: digest mismatch (recorded {receipt.digest[:12]}…, computed {expected[:12]}…)")
    return receipt
