"""The `tinker` trainer and sampler: a Tinker service (hosted, or a Tinker-compatible one such as
SkyRL's) driven through the official `tinker` SDK, pinned to 0.24.1 (the `tinker` extra).

Both sides of a run share one `ServiceClient` (one connection per service URL and base model):
the trainer is a LoRA training client, the sampler holds the sampling clients the trainer
published, plus one for the base model.

Token alignment (the rule in backends/base.py), for a sequence of n tokens:
- trainer: `forward([datum], "cross_entropy")`, one datum per call, with input tokens[:-1] and
  target tokens[1:]; its per-target `logprobs` follow the rule. Any other length is refused.
- sampler: `compute_logprobs(tokens)`. Hosted Tinker returns n values, entry 0 None (no context);
  SkyRL's server returns n - 1 values without the None. Both are accepted and recorded (the first
  is dropped); anything else is refused with a `ScoreError`, and so is a service that changes
  between calls. A shift by one position with the right length cannot be seen here: check A
  catches it (the `misalign` fault).

How this maps onto the core sequence (`lora_parity.run.phases`):
- The SDK cannot write parameters, so the update is an optimizer step: `forward_backward` on a
  fixed, seeded datum plus one Adam `optim_step` with a fixed learning rate, recorded as
  `Perturbation(kind="optimizer_step")`.
- Publishing is `save_weights_and_get_sampling_client()`. `export_adapter` does it and writes a
  reference to the new sampling client into the export folder instead of PEFT files; the
  sampler's `publish` resolves that reference. The sequence's publish step (export, then load on
  the sampler) and the sync faults at that seam (skip-sync, reuse-adapter-id, leak) stay as they
  are; the faults that rewrite PEFT files cannot apply and are refused before the run.
- A sampling client is never unloaded (the SDK has no call for it): `retire` keeps it, so the
  sequence can query the old client again after the newer one was used (see
  `shares_trainer_state`).
- No per-target coverage: a Tinker training client trains every LoRA target together.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tinker
from tinker import types

from lora_parity.backends import bounded_http
from lora_parity.backends.base import (
    AdapterHandle,
    BackendOptions,
    BackendTraits,
    PreflightOptions,
    SamplerBackend,
    Scores,
    Sequences,
    TrainerBackend,
)
from lora_parity.evidence.receipt import BackendInfo, Perturbation
from lora_parity.models import update_step
from lora_parity.models.config import ModelConfig
from lora_parity.models.provenance import redact_url, remember_secret
from lora_parity.util.errors import ConfigError, PhaseError, ScoreError

UPDATE_NUM_TOKENS = 64
"""Length of the fixed datum the update trains on."""
CALL_TIMEOUT_S = 600.0
"""Longest wait for one SDK call (the first calls on a fresh server compile for tens of seconds)."""
PREFLIGHT_TIMEOUT_S = 5.0
"""Longest wait for the service to answer at all before the run starts."""
REFERENCE_FILE = "tinker-sampling-client.json"
"""What `export_adapter` writes: a reference to the published sampling client, not weights."""
PER_TARGET_UNAVAILABLE = ("a Tinker training client trains every LoRA target together; "
                          "the SDK has no per-module update")


def preflight(opts: PreflightOptions) -> None:
    """Before anything is loaded: both roles are tinker, the URL is usable and answers within
    seconds, an API key is set, and the injected fault (if any) applies. Raises `ConfigError`."""
    if opts.trainer != "tinker" or opts.sampler != "tinker":
        raise ConfigError("the tinker backends work as a pair: --trainer tinker --sampler tinker")
    if not opts.url:
        raise ConfigError("the tinker backends need --tinker-url URL (the Tinker service to test)")
    parts = urllib.parse.urlsplit(opts.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--tinker-url {redact_url(opts.url)!r} is not an http(s) URL")
    if not (os.environ.get("TINKER_API_KEY") or os.environ.get("TINKER_CREDENTIAL_CMD")):
        raise ConfigError("set TINKER_API_KEY (a local server without auth accepts any key that starts with 'tml-')")
    if opts.inject and opts.inject_rewrites_files:
        raise ConfigError(f"fault {opts.inject!r} rewrites exported PEFT files; the tinker trainer publishes "
                          "through the service and exports none")
    remember_secret(os.environ.get("TINKER_API_KEY"))  # never into a receipt, whatever a server echoes
    health = redact_url(opts.url) + "/api/v1/healthz"
    try:  # any status is an answer: reachable (a hosted service may want credentials even here)
        bounded_http.request(health, timeout_s=PREFLIGHT_TIMEOUT_S, deadline_s=PREFLIGHT_TIMEOUT_S)
    except bounded_http.HTTPCallError as e:
        if "redirect" not in str(e):
            raise ConfigError(f"cannot reach the Tinker service at {redact_url(opts.url)}: {e}") from None


def _datum(tokens: list[int]) -> Any:
    """Input tokens[:-1], targets tokens[1:]: per-target logprobs follow the alignment rule."""
    targets = types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": targets})


def update_tokens(seed: int, vocab_size: int) -> list[int]:
    """The fixed datum of the update: `UPDATE_NUM_TOKENS` ids in [0, vocab_size), seeded by sha256 of the run seed."""
    digest = hashlib.sha256(f"lora-parity tinker update datum:{seed}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    return [rng.randrange(vocab_size) for _ in range(UPDATE_NUM_TOKENS)]


def align_sampler_logprobs(values: list[float | None], num_tokens: int, where: str) -> tuple[list[float], str]:
    """`compute_logprobs` output -> n - 1 values (the alignment rule in backends/base.py) and the
    alignment seen: 'leading None' (n values, entry 0 None: hosted Tinker) or 'n - 1' (SkyRL's
    server). Anything else raises `ScoreError`."""
    n = len(values)
    numeric = [isinstance(v, int | float) and not isinstance(v, bool) for v in values]
    if n == num_tokens and n > 0 and values[0] is None and all(numeric[1:]):
        return [float(v) for v in values[1:]], "leading None"  # type: ignore[arg-type]
    if n == num_tokens - 1 and all(numeric):
        return [float(v) for v in values], "n - 1"  # type: ignore[arg-type]
    first = "None" if n and values[0] is None else "a number" if n else "nothing"
    raise ScoreError(f"{where}: compute_logprobs returned {n} values starting with {first} for {num_tokens} tokens; "
                     f"expected {num_tokens} starting with None, or {num_tokens - 1}")


@dataclass
class _Service:
    """One ServiceClient per (URL, base model), shared by the trainer and sampler of a run."""

    url: str
    service: Any
    base_model: str
    service_models: list[str]
    published: dict[str, Any] = field(default_factory=dict)
    """Sampling clients the trainer published, by reference key."""
    users: int = 0


_SERVICES: dict[tuple[str, str | None], _Service] = {}


def _connect(url: str | None, base_model: str | None, timings: dict[str, float]) -> _Service:
    if not url:
        raise ConfigError("the tinker backends need --tinker-url URL")
    key = (url, base_model)
    if key not in _SERVICES:
        start = time.perf_counter()
        try:
            service = tinker.ServiceClient(base_url=url)
            capabilities = service.get_server_capabilities()
        except tinker.TinkerError as e:
            raise ConfigError(f"Tinker service at {redact_url(url)}: {e}") from None
        models = [m.model_name for m in capabilities.supported_models if m.model_name]
        if base_model is None:
            if len(models) != 1:
                raise ConfigError(f"the Tinker service at {redact_url(url)} serves {len(models)} models; "
                                  f"pick one with --base-model: {', '.join(models[:20])}")
            base_model = models[0]
        elif models and base_model not in models:
            raise ConfigError(f"the Tinker service at {redact_url(url)} does not serve {base_model!r}; "
                              f"it serves: {', '.join(models[:20])}")
        _SERVICES[key] = _Service(url, service, base_model, models)
        timings["tinker.connect"] = time.perf_counter() - start
    link = _SERVICES[key]
    link.users += 1
    return link


def _release(link: _Service) -> None:
    link.users -= 1
    if link.users <= 0:
        _SERVICES.pop(next((k for k, v in _SERVICES.items() if v is link), ("", None)), None)


def _common_settings(link: _Service, cfg: ModelConfig) -> dict[str, Any]:
    return {"device": f"Tinker service at {redact_url(link.url)}", "service_url": redact_url(link.url),
            "base_model": link.base_model,
            "service_models": link.service_models[:50], "rank": cfg.adapter.rank,
            "per_target": f"skipped: {PER_TARGET_UNAVAILABLE}"}


class TinkerTrainer(TrainerBackend):
    """A LoRA training client on the service: rank from the config, seeded init (A random, B zero)."""

    traits = BackendTraits(needs_checkpoint=False, takes_service_options=True,
                           per_target_unavailable=PER_TARGET_UNAVAILABLE)
    """The service holds the model; built with the run's `url` and `base_model`."""

    @classmethod
    def preflight(cls, opts: PreflightOptions) -> None:
        """The module's `preflight`."""
        preflight(opts)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> TinkerTrainer:
        """A training client on the service at `options.url`."""
        return cls(cfg, model_dir, options.seed, timings, url=options.url, base_model=options.base_model)

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, seed: int, timings: dict[str, float], *,
                 url: str | None = None, base_model: str | None = None) -> None:
        self.cfg, self.seed = cfg, seed
        self.link = _connect(url, base_model, timings)
        self.vocab_size = cfg.model.synthetic.vocab_size if cfg.model.synthetic else 256
        self.num_versions = 0
        start = time.perf_counter()
        self._new_client()
        timings["trainer.load"] = time.perf_counter() - start

    def _new_client(self) -> None:
        try:
            self.client = self.link.service.create_lora_training_client(
                base_model=self.link.base_model, rank=self.cfg.adapter.rank, seed=self.seed)
            self.model_id = str(self.client.get_info().model_id)
        except tinker.TinkerError as e:
            raise PhaseError(f"creating a LoRA training client on {self.link.base_model!r}: {e}") from None
        self.updated = False

    def score(self, sequences: Sequences) -> Scores:
        out: Scores = []
        for s, seq in enumerate(sequences):
            result = self.client.forward([_datum(seq)], "cross_entropy").result(timeout=CALL_TIMEOUT_S)
            values = result.loss_fn_outputs[0]["logprobs"].tolist()
            if len(values) != len(seq) - 1:
                raise ScoreError(f"tinker forward for sequence {s}: {len(values)} target logprobs for "
                                 f"{len(seq)} tokens; expected {len(seq) - 1}")
            out.append([float(v) for v in values])
        return out

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        """`forward_backward` (cross-entropy) on the fixed datum of `seed`, then one Adam step at the
        config's `perturbation.learning_rate`; `std` does not apply. Refuses a second update without
        a fresh client."""
        if only is not None:
            raise PhaseError(f"per-target update of {only}: {PER_TARGET_UNAVAILABLE}")
        if self.updated:
            raise PhaseError("refusing to update: the training client was already updated (not at zero-init)")
        tokens = update_tokens(seed, self.vocab_size)
        lr = self.cfg.perturbation.learning_rate
        adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-12,
                                weight_decay=0.0, grad_clip_norm=0.0)
        self.client.forward_backward([_datum(tokens)], "cross_entropy").result(timeout=CALL_TIMEOUT_S)
        self.client.optim_step(adam).result(timeout=CALL_TIMEOUT_S)
        self.updated = True
        return Perturbation(
            kind="optimizer_step", seed=seed, std=0.0, num_tensors=0, num_elements=0, tensors=[],
            learning_rate=lr, update_tokens=tokens,
            scope=(f"every LoRA tensor of training client {self.model_id} (rank {self.cfg.adapter.rank}); the "
                   "service does not list them. forward_backward(cross_entropy) on update_tokens (input [:-1], "
                   "targets [1:]), then optim_step(Adam, beta1 0.9, beta2 0.95, eps 1e-12, no weight decay, "
                   "no clipping)"),
        )

    def step(self, sequences: Sequences, learning_rate: float, seed: int, only: str | None = None) -> Perturbation:
        """`--update step`: `forward_backward` (cross-entropy) on the probe sequences themselves, then one
        `optim_step` (Adam, betas 0.9/0.999, eps 1e-8, no weight decay) at `learning_rate`, so the step
        raises the probes' logprobs (the service sums the loss over tokens; Adam's first step from zero
        moments does not depend on the gradient's scale). Refuses a second update without a fresh client."""
        if only is not None:
            raise PhaseError(f"per-target update of {only}: {PER_TARGET_UNAVAILABLE}")
        if self.updated:
            raise PhaseError("refusing to step: the training client was already updated (not at the start point)")
        adam = types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.0, grad_clip_norm=0.0)
        self.client.forward_backward([_datum(seq) for seq in sequences], "cross_entropy").result(timeout=CALL_TIMEOUT_S)
        self.client.optim_step(adam).result(timeout=CALL_TIMEOUT_S)
        self.updated = True
        return Perturbation(
            kind="optimizer_step", seed=seed, std=0.0, num_tensors=0, num_elements=0, tensors=[],
            learning_rate=learning_rate, optimizer=update_step.OPTIMIZER.replace("AdamW (torch.optim.AdamW semantics",
                                                                                "Adam (the service's optim_step"),
            objective=update_step.OBJECTIVE,
            scope=f"every LoRA tensor of training client {self.model_id} (rank {self.cfg.adapter.rank}); the "
                  "service does not list them")

    def zero_b(self) -> None:
        """A fresh training client (same seed) if this one was updated: the SDK cannot write weights."""
        if self.updated:
            self._new_client()

    def export_adapter(self, directory: Path) -> Path:
        """Publish the current weights (`save_weights_and_get_sampling_client`) and write a reference
        to the new sampling client into the new folder `directory` (no PEFT files)."""
        client = self.client.save_weights_and_get_sampling_client()
        self.num_versions += 1
        key = f"{self.model_id}/v{self.num_versions}"
        self.link.published[key] = client
        directory = Path(directory)
        directory.mkdir(parents=True)
        (directory / REFERENCE_FILE).write_text(json.dumps({"sampling_client": key}) + "\n", encoding="utf-8")
        return directory

    def info(self) -> BackendInfo:
        settings = _common_settings(self.link, self.cfg)
        settings.update(seed=self.seed, training_client=self.model_id,
                        forward="forward(cross_entropy), one datum per call, input [:-1], targets [1:]",
                        update=f"forward_backward(cross_entropy) on a fixed datum + optim_step(Adam, "
                               f"lr {self.cfg.perturbation.learning_rate})",
                        publish="save_weights_and_get_sampling_client")
        return BackendInfo(backend="tinker", versions={"tinker": tinker.__version__}, settings=settings)

    def close(self) -> None:
        _release(self.link)


class TinkerSampler(SamplerBackend):
    """Sampling clients of the service, by adapter id; a base-model client for the base phase."""

    traits = BackendTraits(needs_checkpoint=False, takes_service_options=True, shares_trainer_state=True)
    """The service holds the model; built with the run's `url` and `base_model`. A sampling client is a
    handle on the service, which may serve it from the training client's own weights: the sequence
    queries the old client again after the newer one was used and re-scores the trainer
    (`stale_after_sync`, `trainer_after_stale`)."""

    @classmethod
    def preflight(cls, opts: PreflightOptions) -> None:
        """The module's `preflight`, unless the tinker trainer's already checks the pair."""
        if opts.trainer != "tinker":
            preflight(opts)

    @classmethod
    def create(cls, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float],
               options: BackendOptions) -> TinkerSampler:
        """Sampling clients of the service at `options.url`."""
        return cls(cfg, model_dir, timings, url=options.url, base_model=options.base_model)

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], *,
                 url: str | None = None, base_model: str | None = None) -> None:
        self.cfg = cfg
        self.link = _connect(url, base_model, timings)
        self.clients: dict[int, Any] = {}
        self.alignment: str | None = None
        start = time.perf_counter()
        self.base_client: Any = None
        try:
            client = self.link.service.create_sampling_client(base_model=self.link.base_model)
            self._logprobs(client, [0, 1], "base-model probe")
            self.base_client = client
        except tinker.TinkerError as e:
            # The service cannot sample the base model: the base phase is skipped.
            self.traits = replace(self.traits, base_unavailable=f"{type(e).__name__}: {e}"[:300])
        timings["sampler.start"] = time.perf_counter() - start

    def _logprobs(self, client: Any, seq: list[int], where: str) -> list[float]:
        raw = client.compute_logprobs(types.ModelInput.from_ints(seq)).result(timeout=CALL_TIMEOUT_S)
        values, alignment = align_sampler_logprobs(list(raw), len(seq), where)
        if self.alignment is None:
            self.alignment = alignment
        elif alignment != self.alignment:
            raise ScoreError(f"{where}: compute_logprobs alignment changed from {self.alignment!r} to {alignment!r}")
        return values

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        if adapter is None:
            if self.base_client is None:
                raise ScoreError(f"the service cannot sample the base model: {self.traits.base_unavailable}")
            client = self.base_client
        else:
            client = self.clients[adapter.adapter_id]
        return [self._logprobs(client, seq, f"tinker sequence {s}") for s, seq in enumerate(sequences)]

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """Take the sampling client `export_adapter` published; like an engine, an id already in
        use keeps its client unless `inplace`."""
        if adapter_id not in self.clients or inplace:
            try:
                key = json.loads((Path(directory) / REFERENCE_FILE).read_text(encoding="utf-8"))["sampling_client"]
                self.clients[adapter_id] = self.link.published[key]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise PhaseError(f"{directory}: not a tinker sampling-client reference ({type(e).__name__})") from None
        return AdapterHandle(name, adapter_id, Path(directory))

    def retire(self, handle: AdapterHandle) -> None:
        """Nothing to unload: the SDK has no call for it. The client stays queryable, as it does for
        an RL loop that still holds it."""

    def info(self) -> BackendInfo:
        settings = _common_settings(self.link, self.cfg)
        settings.update(
            scoring="compute_logprobs, one request per sequence",
            alignment=self.alignment or "not probed",
            base_model_sampling=("ok" if self.traits.base_unavailable is None
                                 else f"unavailable: {self.traits.base_unavailable}"),
            publish="save_weights_and_get_sampling_client (by the trainer)",
        )
        return BackendInfo(backend="tinker", versions={"tinker": tinker.__version__}, settings=settings)

    def close(self) -> None:
        _release(self.link)
