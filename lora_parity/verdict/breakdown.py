"""Where trainer and sampler disagree: |Δlogprob| of checks A and C by probability bucket and by
position quartile. Pure: lists in, receipt records out; `verify` recomputes it from the raw scores.

Scores follow the alignment stated in `lora_parity.backends.base` (entry t scores token t+1).
The bucket of a position is decided by the trainer's logprob of its token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from lora_parity.evidence.receipt import BucketStats, ErrorBreakdown
from lora_parity.util.errors import ReceiptError

PAIRS: dict[str, tuple[str, str]] = {
    "A.trainer_vs_sampler": ("zero", "trainer_zero"),
    "C.trainer_vs_sampler": ("updated", "trainer_updated"),
}
"""Comparison -> (sampler phase, trainer phase), as in `checks.COMPARISONS`."""

LOGPROB_EDGES = (-1.0, -5.0, -10.0)
"""Bucket edges on the trainer's logprob: > -1, (-5, -1], (-10, -5], <= -10."""
LOGPROB_BUCKETS = ("lp > -1", "-5 < lp <= -1", "-10 < lp <= -5", "lp <= -10")
POSITION_BUCKETS = ("q1", "q2", "q3", "q4")


def logprob_bucket(logprob: float) -> int:
    """Index into LOGPROB_BUCKETS of a trainer logprob."""
    return next((i for i, edge in enumerate(LOGPROB_EDGES) if logprob > edge), len(LOGPROB_EDGES))


def position_quartile(t: int, num_scored: int) -> int:
    """Quartile (0..3) of scored position t of a sequence with num_scored positions."""
    return min(3, (4 * t) // num_scored)


def _stats(names: Sequence[str], groups: list[list[float]]) -> list[BucketStats]:
    return [BucketStats(bucket=name, n=len(g), mean_abs=math.fsum(g) / len(g) if g else None,
                        max_abs=max(g) if g else None) for name, g in zip(names, groups, strict=True)]


def breakdown(sampler: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> ErrorBreakdown:
    """|sampler - trainer| grouped by the trainer's logprob and by position quartile.
    Raises ValueError when the two are not aligned sequence by sequence."""
    if [len(s) for s in sampler] != [len(s) for s in trainer]:
        raise ValueError("sampler and trainer scores are not aligned")
    by_lp: list[list[float]] = [[] for _ in LOGPROB_BUCKETS]
    by_pos: list[list[float]] = [[] for _ in POSITION_BUCKETS]
    for seq_s, seq_t in zip(sampler, trainer, strict=True):
        for t, (s, lp) in enumerate(zip(seq_s, seq_t, strict=True)):
            diff = abs(s - lp)
            by_lp[logprob_bucket(lp)].append(diff)
            by_pos[position_quartile(t, len(seq_t))].append(diff)
    return ErrorBreakdown(by_logprob=_stats(LOGPROB_BUCKETS, by_lp), by_position=_stats(POSITION_BUCKETS, by_pos))


def compute(scores: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, ErrorBreakdown]:
    """The breakdown of every comparison in PAIRS whose two phases were scored (misaligned ones are
    left out: the checks already report them)."""
    out: dict[str, ErrorBreakdown] = {}
    for name, (sampler, trainer) in PAIRS.items():
        if sampler in scores and trainer in scores:
            try:
                out[name] = breakdown(scores[sampler], scores[trainer])
            except ValueError:
                continue
    return out


def mismatch(recorded: Mapping[str, ErrorBreakdown] | None,
             scores: Mapping[str, Sequence[Sequence[float]]]) -> str | None:
    """None when a receipt's recorded breakdown reproduces from its scores (or none was recorded),
    else what differs. Floats are compared to 1e-12 relative, as `verify` does."""
    if recorded is None:
        return None
    computed = compute(scores)
    if recorded.keys() != computed.keys():
        return "breakdown does not cover the comparisons its scores allow"
    for name, rec in recorded.items():
        got = computed[name]
        for rec_b, got_b in zip(rec.by_logprob + rec.by_position, got.by_logprob + got.by_position, strict=False):
            if not _same_bucket(rec_b, got_b):
                return f"breakdown {name} {rec_b.bucket} does not reproduce from the raw scores"
        if len(rec.by_logprob) != len(got.by_logprob) or len(rec.by_position) != len(got.by_position):
            return f"breakdown {name} has the wrong buckets"
    return None


def require_reproduces(path: Path, recorded: Mapping[str, ErrorBreakdown] | None,
                       scores: Mapping[str, Sequence[Sequence[float]]]) -> None:
    """Raise `ReceiptError` naming the receipt at `path` unless its breakdown reproduces (see `mismatch`)."""
    problem = mismatch(recorded, scores)
    if problem is not None:
        raise ReceiptError(f"{path}: {problem}")


def _same_bucket(a: BucketStats, b: BucketStats) -> bool:
    def close(x: float | None, y: float | None) -> bool:
        return x is y if x is None or y is None else math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0)

    return a.bucket == b.bucket and a.n == b.n and close(a.mean_abs, b.mean_abs) and close(a.max_abs, b.max_abs)
