"""Sampled tokens: prompts, seeded generation through a `GeneratingSampler`, and the published-folder
folders' states that catch an adapter changed on disk after it was handed to the sampler.

`--probes sampled` takes the text probes' windows, keeps each one's first `prompt_length(n)` tokens (half)
as a prompt, and has the sampler generate the rest (temperature 1, or the user's `--sampling` where the sampler
takes it; no stop token, so every sequence keeps its configured length). After sync the sampler generates from
the same prompts again with the synced adapter. See docs/probes-and-adapters.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.backends.base import AdapterHandle, GeneratingSampler, Scores, Sequences
from lora_parity.backends.tempering import TemperingTrainer
from lora_parity.evidence.receipt import Probes, sha256_json
from lora_parity.models import sampling
from lora_parity.run.fault_spec import FaultSpec
from lora_parity.util.errors import ConfigError, PhaseError

UPDATED_SEED_OFFSET = 1_000_003
"""The generation after sync is seeded with the run seed plus this (the first sampling uses the run seed)."""


def prompt_length(n: int) -> int:
    """Tokens of an n-token probe kept as the prompt: half, at least 2, leaving at least 1 to generate
    (on the CPU each generated token costs about what scoring a whole sequence does)."""
    return min(max(2, n // 2), n - 1)


def prompts(sequences: Sequences) -> Sequences:
    """Each sequence's prompt (its first `prompt_length` tokens)."""
    return [list(seq[:prompt_length(len(seq))]) for seq in sequences]


def require(probes: Probes, sampler_cls: type, sampler: str) -> bool:
    """Preflight: whether the probes are sampled; if so, the sampler must generate (`ConfigError` if not)."""
    sampled = probes.source is not None and probes.source.kind == "sampled"
    if sampled and not issubclass(sampler_cls, GeneratingSampler):
        raise ConfigError(f"--probes sampled needs a sampler that generates; {sampler!r} does not")
    return sampled


def scored_probes(probes: Probes, sequences: Sequences | None) -> Probes:
    """The probes the phases scored: with `--probes sampled`, the prompts + what the sampler generated."""
    if sequences is None or sequences == probes.sequences:
        return probes
    return probes.model_copy(update={"sequences": sequences, "digest": sha256_json(sequences)})


def generating(sampler: object) -> GeneratingSampler:
    """`sampler` as a `GeneratingSampler` (preflight checked it; this guards direct callers)."""
    if not isinstance(sampler, GeneratingSampler):
        raise ConfigError(f"{type(sampler).__name__} cannot generate")
    return sampler


def generate(sampler: object, prompt_ids: Sequences, lengths: list[int], seed: int,
             adapter: AdapterHandle | None) -> tuple[Sequences, Scores]:
    """Prompt s completed to `lengths[s]` tokens, request s seeded with `seed + s`, one request per
    sequence (as scoring does); the logprobs as `GeneratingSampler.generate` states them."""
    gen = generating(sampler)
    sequences: Sequences = []
    logprobs: Scores = []
    for s, (prompt, n) in enumerate(zip(prompt_ids, lengths, strict=True)):
        seqs, lps = gen.generate([prompt], n - len(prompt), seed + s, adapter)
        if len(seqs) != 1 or len(seqs[0]) != n or seqs[0][:len(prompt)] != prompt or len(lps[0]) != n - 1:
            raise PhaseError(f"generation for sequence {s}: expected the prompt + {n - len(prompt)} tokens "
                             f"and {n - 1} logprobs")
        sequences.append(seqs[0])
        logprobs.append(lps[0])
    return sequences, logprobs


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def folder_digest(folder: Path) -> str:
    """sha256 over the names and bytes of a folder's files, in name order (read in chunks)."""
    h = hashlib.sha256()
    for path in _files(folder):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


KEPT_BYTES = 256 << 20
"""A run keeps the published folders' bytes up to this much in all, to compare byte for byte at each check (a read
and a compare: about a tenth of a sha256's time); a folder past it is kept as its sha256 (`folder_digest`)."""


@dataclass(frozen=True)
class FolderState:
    """What a published folder held: its files' names and sizes, and their bytes or their sha256."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    contents: tuple[bytes, ...] | None
    digest: str | None

    @staticmethod
    def _listing(folder: Path) -> tuple[list[Path], tuple[str, ...], tuple[int, ...]]:
        files = _files(folder)
        return files, tuple(p.relative_to(folder).as_posix() for p in files), tuple(p.stat().st_size for p in files)

    @classmethod
    def of(cls, folder: Path, keep: int) -> FolderState:
        """The folder's state now: its bytes where they come to at most `keep`, else its sha256."""
        files, names, sizes = cls._listing(folder)
        if sum(sizes) <= keep:
            return cls(names, sizes, tuple(p.read_bytes() for p in files), None)
        return cls(names, sizes, None, folder_digest(folder))

    def held_by(self, folder: Path) -> bool:
        """Whether `folder` holds the same files, byte for byte (or by sha256), as it did (names and sizes first:
        a file that grew is not read)."""
        files, names, sizes = self._listing(folder)
        if (names, sizes) != (self.names, self.sizes):
            return False
        if self.contents is not None:
            return all(p.read_bytes() == kept for p, kept in zip(files, self.contents, strict=True))
        return folder_digest(folder) == self.digest


def remember(published: dict[Path, FolderState], folder: Path) -> None:
    """Keep `folder`'s state now in `published` (its bytes while the run's kept bytes stay within `KEPT_BYTES`)."""
    published.pop(Path(folder), None)
    kept = sum(len(b) for state in published.values() for b in state.contents or ())
    published[Path(folder)] = FolderState.of(folder, KEPT_BYTES - kept)


def check_unchanged(folder: Path, published: dict[Path, FolderState]) -> None:
    """Raise `PhaseError` if the adapter folder the sampler was handed changed on disk since (an
    engine may read it again: vLLM reloads an evicted adapter from its path)."""
    expected = published.get(Path(folder))
    if expected is not None and not expected.held_by(folder):
        raise PhaseError(f"the published adapter {Path(folder).name} changed on disk after it was published")


TEMPERED_FAULTS = (
    # TRL #4873: one side processed, the other raw. Planted as the engine's drawn tokens' logprobs coming back raw
    # (its prompt logprobs of them) where processed ones at the run's temperature were asked.
    FaultSpec("raw-decode-logprobs", "processed logprobs at a temperature were asked; the engine's drawn tokens' "
              "logprobs come back raw (TRL #4873: colocated processed, server raw)", ("G.trainer.parity.mean",), "fail",
              must_pass=("C.parity.mean",), needs_sampled=True),
)
"""Faults that act only where the decode logprobs are tempered (`tempered`)."""
TEMPERED_FAULT_NAMES = tuple(spec.name for spec in TEMPERED_FAULTS)

UNTEMPERED_FAULTS = {"prompt-no-adapter": "it drops the adapter from the engine's prompt logprobs of the drawn tokens, "
                                         "which a run with tempered decode logprobs does not take"}
"""Faults that cannot act where the decode logprobs are tempered, and why."""


def tempered(run: Any) -> float | None:
    """The temperature of the engine's decode logprobs in this run (`models.sampling.tempered`; None: raw)."""
    return sampling.tempered(run.cfg.sampler.sampling, run.cfg.sampler.engine_args)


def sampled_name(run: Any) -> str:
    """The name the sampled probes' decode logprobs are recorded under: `sampled_generation`, which G.sampled compares
    with the prompt logprobs, or where they are tempered (the prompt's stay raw) `sampled_generation_tempered`, which
    no check reads."""
    return "sampled_generation" if tempered(run) is None else "sampled_generation_tempered"


def after_sync(run: Any) -> None:
    """The generation path after sync, for `phases.Run` `run`: the sampler generates from the same prompts with
    the synced adapter; its rollout logprobs, its prompt logprobs and the trainer's scores of those tokens (the
    trainer's own routing on an MoE model: route replay covers the probes' passes, not the generated tokens).
    Where the decode logprobs are tempered (`tempered`), the trainer scores the drawn tokens at that temperature and
    the engine's prompt logprobs of them are not taken (raw: no check could compare them)."""
    lengths = [len(s) for s in run.sequences]
    handle = run.faults.generation_handle(run.handle, run.kept)
    seed = run.seed + UPDATED_SEED_OFFSET
    run.generated, logprobs = run._timed("updated_generation", lambda: generate(
        run.sampler, run.prompts, lengths, seed, handle))
    if run.faults.is_("raw-decode-logprobs"):  # the drawn tokens' logprobs as the engine's raw prompt logprobs
        raw = run.sampler.score(run.generated, handle)
        logprobs = [row[:len(p) - 1] + r[len(p) - 1:] for row, r, p in zip(logprobs, raw, run.prompts, strict=True)]
    run._record("updated_generation", logprobs)
    temperature = tempered(run)
    if temperature is None:
        prompt_handle = run.faults.generation_prompt_handle(run.handle)
        scored = run._timed("updated_generation_prompt", lambda: run.sampler.score(run.generated, prompt_handle))
        run._record("updated_generation_prompt", run.faults.sampler_scores(scored))
        trainer_scores = run._timed("updated_generation_trainer", lambda: run.trainer.score(run.generated))
    else:
        starts = [len(p) for p in run.prompts]
        spec = run.cfg.sampler.sampling
        trainer_scores = run._timed("updated_generation_trainer", lambda: tempering_trainer(run.trainer).score_tempered(
            run.generated, temperature, starts, spec.top_k, spec.top_p))
    run._record("updated_generation_trainer", trainer_scores)


def tempering_trainer(trainer: object) -> TemperingTrainer:
    """`trainer` as a `TemperingTrainer` (preflight refused the others: `models.sampling.refusal`)."""
    if not isinstance(trainer, TemperingTrainer):
        raise ConfigError(f"{type(trainer).__name__} cannot score drawn tokens at a temperature")
    return trainer
