"""Probe sources: the token sequences every phase scores, and where they come from.

`--probes` takes one of:
- `random`, `random:SET`, or a bare set name (`default`, `held-out`, `SET-xN`): token ids drawn
  uniformly from the vocabulary, seeded per set (the embedded default's source); on a real checkpoint
  whose config names a BOS token, each sequence starts with it (`checkpoint.bos_token`);
- `text`, `text:SET`: a public-domain English text shipped with the package, tokenized with the
  checkpoint's tokenizer and cut into the configured lengths at a seeded offset per set;
- `sampled`, `sampled:SET`: the text windows, each cut to a prompt (its first half) that the
  sampler completes to the same length at the start of the run (`lora_parity.run.generation`);
- `PATH.jsonl`: one JSON object per line, `{"tokens": [ids]}` or `{"text": "..."}` (text needs the
  checkpoint's tokenizer). Every line is checked here, at preflight, before any model loads.

A synthetic checkpoint has no tokenizer: the text and sampled sources are refused for it with one line.
The Python API hands its own token ids in (`given`).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity.evidence.receipt import Probes, ProbeSource, sha256_json
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

if TYPE_CHECKING:
    from lora_parity.models.config import ModelConfig, ProbeSpec

TEXT_FILE = "probe_text.txt"
"""The shipped text (lora_parity/data/); its header names the source."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""A probe file larger than this is refused before it is read."""

MAX_TOKENS = 1 << 18
"""Most tokens the probes of one run may hold (every phase scores them all, each sequence on its own)."""

Tokenize = Callable[[str], list[int]]
SOURCES = ("random", "text", "sampled")
"""The named probe sources (besides a FILE.jsonl)."""


def parse_ref(ref: str) -> tuple[str, str]:
    """Split a `--probes` value into (kind, set or path): kind is random, text or file."""
    if ref.endswith(".jsonl"):
        return "file", ref
    kind, sep, rest = ref.partition(":")
    if sep and kind in SOURCES:
        return kind, rest or "default"
    if ref in SOURCES:
        return ref, "default"
    if sep:
        raise ConfigError(f"unknown probe source {kind!r}; choose random[:SET], text[:SET], sampled[:SET] "
                          "or a FILE.jsonl")
    return "random", ref


def label(ref: str) -> str:
    """The probe part of a default receipt name: the set, `text-SET`, or the file's stem."""
    kind, where = parse_ref(ref)
    if kind == "file":
        return Path(where).stem
    return where if kind == "random" else f"{kind}-{where}" if where != "default" else kind


def _set_seed(spec: ProbeSpec, set_name: str) -> tuple[str, int, int]:
    """(set, seed, times) of `NAME` or `NAME-xN`."""
    base, _, times = set_name.rpartition("-x")
    if not (base and times.isdigit() and int(times) >= 1):
        base, times = set_name, "1"
    if base not in spec.seeds:
        raise ConfigError(f"unknown probe set {set_name!r}; sets: {', '.join(spec.seeds)} (or SET-xN)")
    num_sequences, num_tokens = int(times) * len(spec.lengths), int(times) * sum(spec.lengths)
    if num_sequences > spec.max_sequences or num_tokens > MAX_TOKENS:
        raise ConfigError(f"probe set {set_name!r} has {num_sequences} sequences and {num_tokens} tokens; at most "
                          f"{spec.max_sequences} sequences (probes.max_sequences) and {MAX_TOKENS} tokens")
    return base, spec.seeds[base], int(times)


def _probes(set_name: str, seed: int, sequences: list[list[int]], source: ProbeSource | None) -> Probes:
    return Probes(set=set_name, seed=seed, sequences=sequences, digest=sha256_json(sequences),
                  num_scored_positions=sum(len(s) - 1 for s in sequences), source=source)


def random_probes(spec: ProbeSpec, set_name: str, vocab_size: int, record_source: bool = False,
                  bos: int | None = None) -> Probes:
    """Deterministic probe sequences of `set_name`: ids uniform in [0, vocab_size), seeded; with `bos`,
    each sequence's first id is that token instead (the rest unchanged), as a real input starts.

    `NAME-xN` (e.g. `default-x10`) is set NAME with N times as many sequences, for benchmarks; its
    first sequences are NAME's own. `record_source`: name the source in the receipt (left out by
    default, so receipts of the random source stay as they were)."""
    _, seed, times = _set_seed(spec, set_name)
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab_size) for _ in range(n)] for _ in range(times) for n in spec.lengths]
    if bos is not None:
        sequences = [[bos, *seq[1:]] for seq in sequences]
    return _probes(set_name, seed, sequences, ProbeSource(kind="random") if record_source else None)


def shipped_text() -> str:
    """The public-domain text shipped with the package (header lines starting with '#' removed)."""
    raw = resources.files("lora_parity").joinpath("data", TEXT_FILE).read_text(encoding="utf-8")
    return "\n".join(line for line in raw.splitlines() if not line.startswith("#")).strip() + "\n"


def text_probes(spec: ProbeSpec, set_name: str, token_ids: list[int], source: ProbeSource) -> Probes:
    """Windows of the tokenized text: for each configured length, a seeded offset per set
    (`NAME-xN` repeats the lengths N times with further offsets of the same generator)."""
    _, seed, times = _set_seed(spec, set_name)
    longest = max(spec.lengths)
    if len(token_ids) < longest:
        raise ConfigError(f"the probe text has {len(token_ids)} tokens, fewer than the longest probe ({longest})")
    rng = random.Random(seed)
    sequences = []
    for _ in range(times):
        for n in spec.lengths:
            offset = rng.randrange(len(token_ids) - n + 1)
            sequences.append(list(token_ids[offset:offset + n]))
    return _probes(set_name, seed, sequences, source)


def _line_ids(obj: Any, tokenize: Callable[[], Tokenize]) -> list[int]:
    """Token ids of one parsed line; raises ValueError with the problem."""
    if not isinstance(obj, dict) or len(obj) != 1 or not ({"tokens", "text"} & obj.keys()):
        raise ValueError('each line is one object, {"tokens": [ids]} or {"text": "..."}')
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError('"text" must be a string')
        return tokenize()(obj["text"])
    ids = obj["tokens"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError('"tokens" must be a list of integer ids')
    return ids


def check_sequence(ids: list[int], vocab_size: int, max_len: int) -> None:
    """Raise ValueError unless 2 <= len(ids) <= max_len and every id is in [0, vocab_size)."""
    if not 2 <= len(ids) <= max_len:
        raise ValueError(f"{len(ids)} tokens; a probe needs 2 to {max_len} (the sampler's max_model_len)")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (a duplicate would silently win, as receipts refuse it)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def parse_jsonl(text: str, vocab_size: int, max_len: int, max_sequences: int,
                tokenize: Callable[[], Tokenize]) -> list[list[int]]:
    """Sequences of a probe file's text, every line checked; raises ConfigError naming the first bad
    line (1-based). Blank lines are skipped. `tokenize()` is called only for a text line."""
    sequences: list[list[int]] = []
    # JSON Lines ends a line at "\n" only (str.splitlines would also split inside a string at U+2028 and kin).
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            ids = _line_ids(json.loads(line, object_pairs_hook=_unique_keys), tokenize)
            check_sequence(ids, vocab_size, max_len)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"line {number}: {str(e).splitlines()[0][:200]}") from None
        except RecursionError:
            raise ConfigError(f"line {number}: nested too deeply to be a probe") from None
        sequences.append(ids)
        if len(sequences) > max_sequences:
            raise ConfigError(f"line {number}: more than {max_sequences} sequences (probes.max_sequences)")
    if not sequences:
        raise ConfigError("no sequences (an empty probe file)")
    return sequences


def file_probes(path: Path, vocab_size: int, max_len: int, max_sequences: int,
                tokenizer: Callable[[], tuple[Tokenize, str]]) -> Probes:
    """Probes from a `.jsonl` file, every line checked (see `parse_jsonl`); errors name the file."""
    try:
        raw = safe_read.read_bytes(path, MAX_FILE_BYTES, what="a probe file")  # never /dev/zero or a FIFO
        text = raw.decode("utf-8")
    except ConfigError as e:
        raise ConfigError(f"probe file {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"probe file {path}: not UTF-8 (byte {e.start})") from None
    used: list[str] = []

    def tokenize() -> Tokenize:
        fn, name = tokenizer()
        used.append(name)
        return fn

    try:
        sequences = parse_jsonl(text, vocab_size, max_len, max_sequences, tokenize)
    except ConfigError as e:
        raise ConfigError(f"probe file {path}: {e}") from None
    source = ProbeSource(kind="file", file_name=path.name, file_sha256=hashlib.sha256(raw).hexdigest(),
                         tokenizer=used[0] if used else None)
    return _probes(path.stem, 0, sequences, source)


def given(sequences: object, max_sequences: int) -> Probes:
    """Probes of the token ids a caller handed in (the Python API): a non-empty list of at most `max_sequences`
    sequences, each a list of at least 2 non-negative integer ids, `MAX_TOKENS` in all; `ConfigError` naming
    the first bad sequence (0-based). Nothing checks the ids against a vocabulary: the caller's models hold it."""
    if not isinstance(sequences, list | tuple) or not sequences:
        raise ConfigError("sequences: a non-empty list of token id lists")
    if len(sequences) > max_sequences:
        raise ConfigError(f"sequences: {len(sequences)}; at most {max_sequences}")
    out: list[list[int]] = []
    for i, seq in enumerate(sequences):
        ids = list(seq) if isinstance(seq, list | tuple) else None
        if ids is None or len(ids) < 2 or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                  for t in ids):
            raise ConfigError(f"sequences[{i}]: a list of at least 2 non-negative integer token ids")
        out.append(ids)
    if sum(len(s) for s in out) > MAX_TOKENS:
        raise ConfigError(f"sequences: more than {MAX_TOKENS} tokens in all")
    return _probes("default", 0, out, ProbeSource(kind="given"))  # the run's one set: "given probes"


def make(cfg: ModelConfig, ref: str, vocab_size: Callable[[], int],
         bos: Callable[[], int | None] = lambda: None) -> Probes:
    """The probes of a run: `--probes REF` for config `cfg` (see the module docstring).
    `vocab_size()` gives the checkpoint's vocabulary size, `bos()` the id random probes start with (None:
    none)."""
    kind, where = parse_ref(ref)
    if kind == "random":
        _check_lengths(cfg)
        return random_probes(cfg.probes, where, vocab_size(), record_source=ref.startswith("random"), bos=bos())
    if kind in ("text", "sampled"):
        _check_lengths(cfg)
        tokenize, name = checkpoint_tokenizer(cfg, kind)
        source = ProbeSource(kind="sampled" if kind == "sampled" else "text", file_name=TEXT_FILE,
                             file_sha256=hashlib.sha256(shipped_text().encode()).hexdigest(), tokenizer=name)
        return text_probes(cfg.probes, where, tokenize(shipped_text()), source)
    return file_probes(Path(where), vocab_size(), cfg.sampler.max_model_len, cfg.probes.max_sequences,
                       lambda: checkpoint_tokenizer(cfg))


def _check_lengths(cfg: ModelConfig) -> None:
    """Every configured probe length fits the sampler's context (else the base phase fails after the load)."""
    longest, limit = max(cfg.probes.lengths), cfg.sampler.max_model_len
    if longest > limit:
        raise ConfigError(f"{cfg.name}: probe length {longest} is above sampler.max_model_len {limit}")


def checkpoint_tokenizer(cfg: ModelConfig, kind: str = "text") -> tuple[Tokenize, str]:
    """The checkpoint's tokenizer as a function text -> ids (no special tokens added), and what
    names it in the receipt ('tokenizer.json sha256 ...'). Refused for a synthetic checkpoint."""
    if cfg.model.synthetic is not None:
        raise ConfigError(f"{cfg.name} is a synthetic checkpoint without a tokenizer; {kind} probes need a "
                          "real model (e.g. --model smollm2-135m) or token ids (--probes random or FILE.jsonl)")
    from lora_parity.models import synthetic

    folder = synthetic.materialize(cfg)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{folder}: no tokenizer.json; {kind} probes need the checkpoint's tokenizer")
    from tokenizers import Tokenizer

    raw = safe_read.read_bytes(folder / "tokenizer.json", safe_read.MAX_TOKENIZER_BYTES, what="a tokenizer")
    tok = Tokenizer.from_str(raw.decode("utf-8", errors="replace"))
    digest = hashlib.sha256(raw).hexdigest()

    def tokenize(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    return tokenize, f"tokenizer.json sha256 {digest}"
