"""Statistics of a per-token logprob difference. Pure: lists of floats in, numbers out.

Legend: a *score array* is one list per probe sequence; entry t of sequence s is
log p(tokens[t+1] | tokens[:t+1]). A comparison `b vs a` looks at diff = b - a, position by
position, flattened in sequence order. Everything here is plain Python (math.fsum), so that
`lora-parity verify` recomputes exactly what the run recorded, on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lora_parity.util.errors import ScoreError

ScoreArray = Sequence[Sequence[float]]


def flatten(scores: ScoreArray) -> list[float]:
    """Concatenate a per-sequence score array in sequence order."""
    return [float(x) for seq in scores for x in seq]


# A logprob is <= 0; allow rounding above it, nothing more.
MAX_LOGPROB = 1e-4
MIN_LOGPROB = -1e6
"""Below it a score is no engine's logprob (a uniform choice among 10^400000 tokens); finite scores near the
float limit would overflow every statistic (‖Δ‖², exp) instead of naming the input."""
# exp() arguments are clamped here so that a wildly wrong side still yields finite statistics.
EXP_CLAMP = 600.0


def check_finite(scores: ScoreArray, what: str) -> None:
    """Raise `ScoreError` naming the first entry that is NaN, infinite, or not a logprob (> 0, or below
    `MIN_LOGPROB`)."""
    for s, seq in enumerate(scores):
        for t, x in enumerate(seq):
            if not math.isfinite(x):
                raise ScoreError(f"{what}: non-finite score {x!r} at sequence {s}, position {t}")
            if x > MAX_LOGPROB:
                raise ScoreError(f"{what}: score {x!r} at sequence {s}, position {t} is not a logprob (> 0)")
            if x < MIN_LOGPROB:
                raise ScoreError(f"{what}: score {x!r} at sequence {s}, position {t} is not a logprob "
                                 f"(below {MIN_LOGPROB:g})")


def check_aligned(a: ScoreArray, b: ScoreArray, what: str) -> None:
    """Raise `ScoreError` unless `a` and `b` have the same number of sequences and positions."""
    if len(a) != len(b):
        raise ScoreError(f"{what}: {len(a)} vs {len(b)} sequences")
    for s, (x, y) in enumerate(zip(a, b, strict=True)):
        if len(x) != len(y):
            raise ScoreError(f"{what}: sequence {s} has {len(x)} vs {len(y)} scored positions")


def differences(a: ScoreArray, b: ScoreArray) -> list[float]:
    """b - a, position by position, flattened."""
    check_aligned(a, b, "comparison")
    return [y - x for x, y in zip(flatten(a), flatten(b), strict=True)]


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending list."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def locate(scores: ScoreArray, flat_index: int) -> tuple[int, int]:
    """(sequence, position) of a flat index into a score array."""
    for s, seq in enumerate(scores):
        if flat_index < len(seq):
            return s, flat_index
        flat_index -= len(seq)
    raise IndexError("flat index beyond the score array")


def l2(values: Sequence[float]) -> float:
    """Euclidean norm."""
    return math.sqrt(math.fsum(v * v for v in values))


def summarize(a: ScoreArray, b: ScoreArray, over: float) -> dict[str, float | int | list[int]]:
    """Statistics of diff = b - a.

    Returns n, mean_abs, p50, p99, max_abs, argmax ([sequence, position] of the largest |diff|),
    frac_over (fraction of positions with |diff| > `over`), equal (fraction with diff exactly 0),
    k3_kl (mean of exp(d) - 1 - d, the k3
    estimate of KL(a || b) on tokens drawn from a) and mult_prob_error (mean of exp(|diff|), NeMo-RL's
    token_mult_prob_error); exp arguments are clamped at EXP_CLAMP.
    """
    diff = differences(a, b)
    n = len(diff)
    if n == 0:
        raise ScoreError("comparison of empty score arrays")
    absd = [abs(d) for d in diff]
    ordered = sorted(absd)
    imax = max(range(n), key=absd.__getitem__)
    seq, pos = locate(a, imax)
    return {
        "n": n,
        "mean_abs": math.fsum(absd) / n,
        "p50": quantile(ordered, 0.50),
        "p99": quantile(ordered, 0.99),
        "max_abs": ordered[-1],
        "argmax": [seq, pos],
        "frac_over": sum(1 for d in absd if d > over) / n,
        "equal": sum(1 for d in absd if d == 0) / n,
        "k3_kl": math.fsum(math.expm1(min(d, EXP_CLAMP)) - d for d in diff) / n,
        "mult_prob_error": math.fsum(math.exp(min(d, EXP_CLAMP)) for d in absd) / n,
    }


def delta_agreement(
    sampler_before: ScoreArray, sampler_after: ScoreArray, trainer_before: ScoreArray, trainer_after: ScoreArray
) -> dict[str, float | None]:
    """How the sampler's change agrees with the trainer's.

    Δs = sampler_after - sampler_before and Δt = trainer_after - trainer_before. Returns
    cosine(Δs, Δt), scale ‖Δs‖/‖Δt‖, rel_l2 ‖Δs - Δt‖/‖Δt‖, and both norms. Where a norm is 0
    the ratios that need it are None (undefined), never a division by zero.
    """
    ds = differences(sampler_before, sampler_after)
    dt = differences(trainer_before, trainer_after)
    ns, nt = l2(ds), l2(dt)
    dot = math.fsum(x * y for x, y in zip(ds, dt, strict=True))
    cosine = dot / (ns * nt) if ns > 0 and nt > 0 else None
    scale = ns / nt if nt > 0 else None
    rel = l2([x - y for x, y in zip(ds, dt, strict=True)]) / nt if nt > 0 else None
    return {"cosine": cosine, "scale": scale, "rel_l2": rel, "sampler_norm": ns, "trainer_norm": nt}


def worst_positions(
    a: ScoreArray, b: ScoreArray, sequences: Sequence[Sequence[int]], k: int
) -> list[dict[str, int | float]]:
    """The `k` positions with the largest |b - a|, largest first (ties: earlier position first).

    Each is {sequence, position, token, abs_diff}: position t of sequence s scores tokens[t+1], so
    `token` is sequences[s][t+1]. Where an MoE disagreement sits (one token, one sequence, spread
    out) is what localises it.
    """
    check_aligned(a, b, "comparison")
    if [len(s) - 1 for s in sequences] != [len(x) for x in a]:
        raise ScoreError("worst positions: scores are not aligned with the probe sequences")
    ranked = sorted(
        ((abs(y - x), s, t) for s, (xs, ys) in enumerate(zip(a, b, strict=True))
         for t, (x, y) in enumerate(zip(xs, ys, strict=True))),
        key=lambda e: (-e[0], e[1], e[2]),
    )
    return [{"sequence": s, "position": t, "token": int(sequences[s][t + 1]), "abs_diff": d}
            for d, s, t in ranked[:k]]


def topk_agreement(trainer: Sequence[Sequence[Sequence[Sequence[int]]]],
                   sampler: Sequence[Sequence[Sequence[Sequence[int]]]]) -> list[float]:
    """Per layer, the fraction of tokens routed to the same set of experts by both sides.

    Arguments are indexed [sequence][token][layer] -> expert ids (any order); both must have the
    same shape. Returns one fraction per layer.
    """
    if len(trainer) != len(sampler):
        raise ScoreError(f"routing: {len(trainer)} vs {len(sampler)} sequences")
    same: list[int] = []
    total = 0
    for s, (ts, ss) in enumerate(zip(trainer, sampler, strict=True)):
        if len(ts) != len(ss):
            raise ScoreError(f"routing: sequence {s} has {len(ts)} vs {len(ss)} tokens")
        for tl, sl in zip(ts, ss, strict=True):
            if len(tl) != len(sl):
                raise ScoreError(f"routing: {len(tl)} vs {len(sl)} MoE layers")
            if not same:
                same = [0] * len(tl)
            for i, (te, se) in enumerate(zip(tl, sl, strict=True)):
                same[i] += set(te) == set(se)
            total += 1
    return [n / total for n in same] if total else []


SLOPE_BLOCK = 8
"""Tokens per block of the slope's jackknife: neighbouring tokens of one sequence share their context, so
their errors are not independent; blocks of this many tokens are left out together."""


def block_ids(lengths: Sequence[int], block: int = SLOPE_BLOCK) -> tuple[list[int], int]:
    """Each scored position's block (`block` consecutive positions of one sequence; a block never spans
    two sequences), flattened in sequence order, and the number of blocks."""
    ids: list[int] = []
    first = 0
    for length in lengths:
        ids.extend(first + t // block for t in range(length))
        first += -(-length // block)
    return ids, first


Slope = tuple[float, float, int]
"""(ratio, its jackknife standard error, blocks) of `update_slope`."""


def update_slope(phases: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]],
                 ids: Sequence[int], blocks: int) -> Slope | None:
    """How much of the trainer's change the sampler makes, pooled over `phases` (each (Δsampler, Δtrainer,
    Δreference), flat, one per scored position, block `ids[i]` for position i of every phase): the ratio
    Σ Δsampler·Δreference / Σ Δtrainer·Δreference (with Δreference = Δtrainer, the through-origin slope of
    Δsampler on Δtrainer), and its standard error by a jackknife that leaves out one block of positions
    at a time, in every phase at once. None where it is undefined (no change, fewer than two blocks)."""
    num = [0.0] * blocks
    den = [0.0] * blocks
    for ds, dt, dr in phases:
        for i, (s, t, r) in enumerate(zip(ds, dt, dr, strict=True)):
            num[ids[i]] += s * r
            den[ids[i]] += t * r
    total_num, total_den = math.fsum(num), math.fsum(den)
    if blocks < 2 or total_den <= 0:
        return None
    leave_out = [(total_num - n) / (total_den - d) for n, d in zip(num, den, strict=True) if total_den - d > 0]
    if len(leave_out) < 2:
        return None
    mean = math.fsum(leave_out) / len(leave_out)
    se = math.sqrt((len(leave_out) - 1) / len(leave_out) * math.fsum((x - mean) ** 2 for x in leave_out))
    return total_num / total_den, se, blocks
