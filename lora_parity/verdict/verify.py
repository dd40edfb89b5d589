"""`lora-parity verify`: re-derive a receipt's statistics, checks and verdict from its raw scores.

What it proves: the receipt is internally consistent (every statistic, check and the verdict follow
from its raw scores and budgets) and not accidentally corrupted (its sha256 digest matches). It does
not prove who made the receipt: anyone can edit one and recompute the digest. A signed receipt (a DSSE
envelope, see `signing.py`) checked with `--public-key` also proves that the key's holder made it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import PhaseStatus, Receipt, Verdict, sha256_json, validate
from lora_parity.evidence.receipt_io import parse_json, read_bounded
from lora_parity.util.errors import ReceiptError, ScoreError
from lora_parity.verdict import breakdown, checks, lifecycle, routes, stats

PROVES = ("intact means internally consistent and not accidentally corrupted, "
          "not who made the receipt (sign it for that: run --sign, verify --public-key)")
"""What `verify` proves, in the words its output uses."""


@dataclass(frozen=True)
class Verified:
    """An intact receipt and its recomputed verdict."""

    receipt: Receipt
    verdict: Verdict
    signature: str = "unsigned"
    """'unsigned' (a bare receipt), 'not checked' (an envelope, no key given) or 'valid (keyid …)'."""


def _load(path: Path, public_key: Path | None) -> tuple[Receipt, str]:
    """The receipt in a bare receipt file or a signed envelope, and the signature status."""
    raw = read_bounded(path)
    text, data = parse_json(raw, str(path))
    from lora_parity.evidence import signing

    if not signing.is_envelope(data):
        if public_key is not None:
            raise ReceiptError(f"{path}: not signed (a bare receipt), but --public-key asks for a signature")
        return validate(text, data, str(path)), "unsigned"
    key = signing.load_public_key(public_key) if public_key is not None else None
    payload, status = signing.open_envelope(data, str(path), key)
    name = f"{path} (payload)"
    return validate(*parse_json(payload, name), name), status


def _same(recorded: Any, computed: Any) -> bool:
    """Equal, with floats compared to 1e-12 relative (JSON round trips are exact; this only
    absorbs a different libm on another machine)."""
    if isinstance(recorded, float) or isinstance(computed, float):
        if recorded is None or computed is None:
            return recorded is computed
        return math.isclose(recorded, computed, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(recorded, dict) and isinstance(computed, dict):
        return recorded.keys() == computed.keys() and all(_same(recorded[k], computed[k]) for k in recorded)
    if isinstance(recorded, list) and isinstance(computed, list):
        return len(recorded) == len(computed) and all(_same(a, b) for a, b in zip(recorded, computed, strict=True))
    return bool(recorded == computed)


def _first_difference(what: str, recorded: dict[str, Any], computed: dict[str, Any]) -> str:
    for key in sorted(set(recorded) | set(computed)):
        if key not in recorded:
            return f"{what} {key} is missing"
        if key not in computed:
            return f"{what} {key} is not backed by the raw scores"
        if not _same(recorded[key], computed[key]):
            return f"{what} {key} does not reproduce from the raw scores"
    return f"{what} differ"


def verify(path: Path, public_key: Path | None = None) -> Verified:
    """Load `path` (a receipt, or a signed envelope: its signature is checked when `public_key` is
    given) and check that everything derived in it reproduces; raise `ReceiptError` if not."""
    receipt, signature = _load(Path(path), public_key)
    seqs = receipt.probes.sequences
    expected = [len(s) - 1 for s in seqs]
    if receipt.probes.num_scored_positions != sum(expected):
        raise ReceiptError(f"{path}: probes.num_scored_positions does not match the sequences")

    if receipt.probes.digest != sha256_json(seqs):
        raise ReceiptError(f"{path}: probes.digest does not match the sequences")
    _verify_scores(path, receipt, expected)
    phase_failed = any(p.status == PhaseStatus.ERROR for p in receipt.phases)
    # A failed phase must have stopped the run with an error; an error with no failed phase is a run
    # that stopped outside the phases (setup, a truncated checkpoint: no phase ran at all).
    if receipt.error is None and phase_failed:
        raise ReceiptError(f"{path}: error and phase statuses disagree")
    errored = receipt.error is not None or phase_failed
    ev = checks.evaluate(receipt.scores, receipt.budgets, errored=errored)
    _verify_comparisons(path, receipt, ev)
    recorded = {k: v.model_dump(mode="json") for k, v in receipt.deltas.items()}
    computed = {k: v.model_dump(mode="json") for k, v in ev.deltas.items()}
    if not _same(recorded, computed):
        raise ReceiptError(f"{path}: {_first_difference('delta', recorded, computed)}")
    recorded = {c.id: c.model_dump(mode="json") for c in receipt.checks}
    computed = {c.id: c.model_dump(mode="json") for c in ev.checks}
    if all(check["elements"] is None for check in recorded.values()):  # made before element counts: as recorded
        for check in computed.values():
            check["elements"] = None
    if not _same(recorded, computed) or len(receipt.checks) != len(ev.checks):
        raise ReceiptError(f"{path}: {_first_difference('check', recorded, computed)}")
    _verify_thresholds(path, receipt, ev)
    if receipt.verdict != ev.verdict:
        raise ReceiptError(f"{path}: verdict {receipt.verdict} does not follow from its checks ({ev.verdict})")
    # Receipts made before the two verdicts existed have none: judged by their checks alone, as then.
    if receipt.verdicts is not None and receipt.verdicts != ev.verdicts:
        raise ReceiptError(f"{path}: verdicts (sync, numerics) do not follow from its checks")
    _verify_moe_fields(path, receipt)
    _verify_calibration(path, receipt)
    breakdown.require_reproduces(path, receipt.breakdown, receipt.scores)
    _verify_lifecycle(path, receipt)
    return Verified(receipt, ev.verdict, signature)


def _verify_lifecycle(path: Path, receipt: Receipt) -> None:
    """The lifecycle table must follow from the recorded phases and sampler settings (`verdict.lifecycle`);
    receipts made before it have none."""
    if receipt.lifecycle is None:
        return
    recorded = {r.condition: r.model_dump(mode="json") for r in receipt.lifecycle}
    computed = {r.condition: r.model_dump(mode="json") for r in lifecycle.of_receipt(receipt)}
    if recorded != computed or len(receipt.lifecycle) != len(computed):
        which = next((k for k in [*computed, *recorded] if recorded.get(k) != computed.get(k)), "order")
        raise ReceiptError(f"{path}: lifecycle row {which!r} does not follow from the recorded phases and "
                           "sampler settings")


def _verify_comparisons(path: Path, receipt: Receipt, ev: checks.Evaluation) -> None:
    """Every recorded comparison must reproduce from the raw scores (receipts made before the equal fraction
    was recorded have none in any comparison: it is not asked of them; one comparison without it is a
    tampered receipt)."""
    recorded = {k: v.model_dump(mode="json") for k, v in receipt.comparisons.items()}
    computed = {k: v.model_dump(mode="json") for k, v in ev.comparisons.items()}
    if all(stat["equal"] is None for stat in recorded.values()):
        for key in recorded.keys() & computed.keys():
            computed[key]["equal"] = None
    if not _same(recorded, computed):
        raise ReceiptError(f"{path}: {_first_difference('comparison', recorded, computed)}")


def _verify_thresholds(path: Path, receipt: Receipt, ev: checks.Evaluation) -> None:
    """The noise model and every threshold must re-derive from the scores; receipts made before the
    noise model recorded neither."""
    if receipt.thresholds is None and receipt.noise is None:
        return
    recorded = receipt.noise.model_dump(mode="json") if receipt.noise else {}
    computed = ev.noise.model_dump(mode="json") if ev.noise else {}
    if not _same(recorded, computed):
        raise ReceiptError(f"{path}: {_first_difference('noise model field', recorded, computed)}")
    recorded = {k: v.model_dump(mode="json") for k, v in (receipt.thresholds or {}).items()}
    computed = {k: v.model_dump(mode="json") for k, v in (ev.thresholds or {}).items()}
    if not _same(recorded, computed):
        raise ReceiptError(f"{path}: {_first_difference('threshold', recorded, computed)}")


UNCOMPARED = ("sampled_generation_tempered",)
"""Score keys recorded for the record, compared by no check: the sampled probes' decode logprobs at the user's
temperature (`run.generation.sampled_name`; G.sampled compares raw ones only)."""


def _verify_scores(path: Path, receipt: Receipt, expected: list[int]) -> None:
    """Every score array is a phase lora-parity records, aligned with the probes, finite logprobs; only the fresh
    phase may be empty (the trainer handed it no tensors: `checks.handed_nothing`), and only where the run
    recorded that phase as done."""
    known = {phase for pair in checks.COMPARISONS.values() for phase in pair} | set(routes.SCORE_KEYS) | set(UNCOMPARED)
    for key, scores in receipt.scores.items():
        per_target = key.startswith(checks.TARGET_PREFIX) and key.endswith((".trainer", ".sampler", ".reference",
                                                                             routes.TARGET_SEARCH_SUFFIX))
        exact = key in ("exact.zero", "exact.updated") or key.startswith("exact.target.")
        if key not in known and not per_target and not exact:
            raise ReceiptError(f"{path}: scores.{key} is not a phase lora-parity records")
        if key == "fresh" and not scores:
            if not any(p.name == "fresh" and p.status == PhaseStatus.OK for p in receipt.phases):
                raise ReceiptError(f"{path}: scores.fresh is empty, but no fresh phase ran")
            continue
        if [len(s) for s in scores] != expected:
            raise ReceiptError(f"{path}: scores.{key} is not aligned with the probes")
        try:
            stats.check_finite(scores, f"scores.{key}")
        except ScoreError as e:
            raise ReceiptError(f"{path}: {e}") from None


def _verify_worst_positions(path: Path, receipt: Receipt) -> None:
    """Recorded worst positions must reproduce from the scores."""
    if receipt.worst_positions is None:
        return
    k = max((len(v) for v in receipt.worst_positions.values()), default=checks.WORST_K)
    try:
        worst = checks.compute_worst_positions(receipt.scores, receipt.probes.sequences, k)
    except ScoreError as e:
        raise ReceiptError(f"{path}: worst_positions: {e}") from None
    recorded = {n: [w.model_dump(mode="json") for w in v] for n, v in receipt.worst_positions.items()}
    computed = {n: [w.model_dump(mode="json") for w in v] for n, v in worst.items()}
    if not _same(recorded, computed):
        raise ReceiptError(f"{path}: {_first_difference('worst_positions', recorded, computed)}")


def _verify_moe_fields(path: Path, receipt: Receipt) -> None:
    """Worst positions must reproduce from the scores; router agreement (raw data) must be well formed, and route
    replay's routes too, with its route changes re-derived from them (`routes.problem`)."""
    _verify_worst_positions(path, receipt)
    problem = routes.problem(receipt.route_replay, receipt.probes.sequences) if receipt.route_replay else None
    if problem:
        raise ReceiptError(f"{path}: route_replay: {problem}")
    r = receipt.router
    if r is None:
        return
    numbers = (r.num_layers, r.top_k, r.num_tokens, r.agreement, r.per_layer)
    if r.status == "not_available":
        if not r.reason or any(x is not None for x in numbers):
            raise ReceiptError(f"{path}: router: not_available needs a reason and no measurements")
        return
    if any(x is None for x in numbers) or r.reason is not None:
        raise ReceiptError(f"{path}: router: measured needs num_layers, top_k, num_tokens, agreement, per_layer")
    assert r.per_layer is not None and r.agreement is not None and r.num_layers is not None
    tokens = sum(len(s) for s in receipt.probes.sequences)
    if len(r.per_layer) != r.num_layers or r.num_layers < 1 or (r.top_k or 0) < 1 or r.num_tokens != tokens:
        raise ReceiptError(f"{path}: router: shape does not match its layers and the probe tokens")
    if not all(0.0 <= x <= 1.0 for x in (*r.per_layer, r.agreement)):
        raise ReceiptError(f"{path}: router: agreement outside [0, 1]")
    if not math.isclose(r.agreement, math.fsum(r.per_layer) / len(r.per_layer), rel_tol=1e-12, abs_tol=1e-12):
        raise ReceiptError(f"{path}: router: agreement is not the mean of per_layer")
    if r.flipped_tokens is not None and not (0 <= r.flipped_tokens <= tokens and (r.flipped_tokens == 0) == (
            r.agreement == 1.0)):
        raise ReceiptError(f"{path}: router: flipped_tokens does not match the probe tokens and the agreement")


def _verify_calibration(path: Path, receipt: Receipt) -> None:
    """A calibrated std (`perturbation.std: auto`) must follow its rule (`calibrate.check_perturbation`)."""
    from lora_parity.verdict import calibrate

    if receipt.perturbation is None:
        return
    problem = calibrate.check_perturbation(receipt.perturbation, receipt.scores, receipt.budgets)
    if problem:
        raise ReceiptError(f"{path}: {problem}")
