"""How one verified receipt differs from another: statistics side by side, delta agreement, checks
whose status changed, verdicts, and settings. As JSON-ready data (`diff_receipts`) or markdown."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import Receipt
from lora_parity.report.document import Block, Bullets, Heading, Para, Table, code, fmt_num, fmt_signed, render_markdown
from lora_parity.report.facts import NOT_REACHED, signature_note
from lora_parity.verdict import checks as checks_mod

_DIFF_STATS = ("mean_abs", "p99", "max_abs")
_DELTA_STATS = ("cosine", "scale", "rel_l2")
Pairs = dict[str, dict[str, dict[str, Any]]]
"""name -> statistic -> `_pair` record."""


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def _settings(receipt: Receipt) -> dict[str, Any]:
    """Everything that says what was run, and where, flattened to dotted keys."""
    out: dict[str, Any] = {}
    data = receipt.model_dump(mode="json")
    for key in ("revision", "model", "trainer", "sampler", "environment", "budgets"):
        _flatten(key, data[key], out)
    for key in ("set", "seed", "digest", "num_scored_positions"):
        out[f"probes.{key}"] = data["probes"][key]
    pert = data["perturbation"] or {}
    for key in ("kind", "seed", "std", "num_tensors", "num_elements"):
        out[f"perturbation.{key}"] = pert.get(key)
    for key in ("tool_version", "sync_mode", "injected_fault"):
        out[key] = data[key]
    return out


def _pair(x: Any, y: Any, stat: str) -> dict[str, Any]:
    """a, b and b - a of one statistic of two (possibly missing) records; `reached` tells a missing
    record (not reached) from a value that is None (undefined)."""
    a, b = (getattr(x, stat) if x is not None else None), (getattr(y, stat) if y is not None else None)
    delta = b - a if a is not None and b is not None else None
    return {"a": a, "b": b, "delta": delta, "reached": {"a": x is not None, "b": y is not None}}


def _comparison_pairs(a: Receipt, b: Receipt) -> Pairs:
    order = list(checks_mod.COMPARISONS)
    names = sorted(set(a.comparisons) | set(b.comparisons),
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    return {name: {s: _pair(a.comparisons.get(name), b.comparisons.get(name), s) for s in _DIFF_STATS}
            for name in names}


def _delta_pairs(a: Receipt, b: Receipt) -> Pairs:
    return {name: {s: _pair(a.deltas.get(name), b.deltas.get(name), s) for s in _DELTA_STATS}
            for name in dict.fromkeys([*a.deltas, *b.deltas])}


def _changed_checks(a: Receipt, b: Receipt) -> list[dict[str, Any]]:
    status_a = {c.id: c.status.value for c in a.checks}
    status_b = {c.id: c.status.value for c in b.checks}
    return [{"id": cid, "a": status_a.get(cid, "absent"), "b": status_b.get(cid, "absent"),
             "reason_b": next((c.reason for c in b.checks if c.id == cid), None)}
            for cid in dict.fromkeys([*status_a, *status_b]) if status_a.get(cid) != status_b.get(cid)]


def _changed_settings(a: Receipt, b: Receipt) -> list[dict[str, Any]]:
    sa, sb = _settings(a), _settings(b)
    return [{"key": k, "a": sa.get(k), "b": sb.get(k)} for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)]


def _moved(entries: Pairs) -> bool:
    return any(p["a"] != p["b"] or p["reached"]["a"] != p["reached"]["b"]
               for stats in entries.values() for p in stats.values())


def diff_receipts(a: Receipt, b: Receipt, signatures: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """How receipt `b` differs from receipt `a`: each comparison's mean, p99 and max (a, b, b - a),
    delta agreement, checks whose status changed, verdicts, and settings that differ; `signatures`
    are `verify`'s signature statuses of a and b. `identical` is true when none of those differ
    (timings, creation times and signatures are not compared)."""
    comparisons, deltas = _comparison_pairs(a, b), _delta_pairs(a, b)
    changed_checks, settings = _changed_checks(a, b), _changed_settings(a, b)
    return {
        "identical": not (_moved(comparisons) or _moved(deltas) or changed_checks or settings
                          or a.verdict != b.verdict),
        "verdict": {"a": a.verdict.value, "b": b.verdict.value},
        "signature": {"a": signature_note(signatures[0]), "b": signature_note(signatures[1])},
        "revision": {"a": a.revision.commit, "b": b.revision.commit},
        "created_at": {"a": a.created_at, "b": b.created_at},
        "total_seconds": {"a": a.timings.get("total"), "b": b.timings.get("total")},
        "comparisons": comparisons,
        "deltas": deltas,
        "changed_checks": changed_checks,
        "settings": settings,
    }


def _side_by_side(p: Mapping[str, Any]) -> str:
    a, b, delta = p["a"], p["b"], p["delta"]

    def show(value: float | None, side: str) -> str:
        return fmt_num(value) if value is not None else "undefined" if p["reached"][side] else NOT_REACHED

    if a == b and p["reached"]["a"] == p["reached"]["b"]:
        return f"{show(a, 'a')} (same)"
    tail = f" ({fmt_signed(delta)})" if delta is not None else ""
    return f"{show(a, 'a')} → {show(b, 'b')}{tail}"


def _value(v: Any) -> str:
    return "—" if v is None else json.dumps(v) if not isinstance(v, str) else v


def _summary_blocks(d: Mapping[str, Any], path_a: str, path_b: str) -> list[Block]:
    v, rev = d["verdict"], d["revision"]
    verdict = f"{v['a']} → {v['b']}" if v["a"] != v["b"] else f"{v['a']} (same)"
    blocks: list[Block] = [
        Heading("lora-parity diff", 2),
        Para(f"a = {code(path_a)}, b = {code(path_b)}"),
        Bullets([
            f"verdict: **{verdict}**",
            f"signature: a {d['signature']['a']}, b {d['signature']['b']}",
            f"revision: {code(rev['a'])}" + (f" → {code(rev['b'])}" if rev["a"] != rev["b"] else " (same)"),
            f"created: {code(d['created_at']['a'])} → {code(d['created_at']['b'])}",
            "total time: " + " → ".join(f"{t:.2f} s" if t is not None else "—" for t in d["total_seconds"].values()),
        ]),
    ]
    if d["identical"]:
        blocks.append(Para("**No differences**: same statistics, checks, verdict and settings."))
    return blocks


def _statistics_blocks(d: Mapping[str, Any]) -> list[Block]:
    blocks: list[Block] = [
        Heading("Comparisons (a → b, and b − a)"),
        Table(["comparison", "mean |diff|", "p99", "max"],
              [[name, *(_side_by_side(stats[s]) for s in _DIFF_STATS)] for name, stats in d["comparisons"].items()]),
    ]
    if d["deltas"]:
        blocks.append(Table(["update", "cosine", "scale", "rel L2"],
                            [[name, *(_side_by_side(stats[s]) for s in _DELTA_STATS)]
                             for name, stats in d["deltas"].items()]))
    return blocks


def _change_blocks(d: Mapping[str, Any]) -> list[Block]:
    checks = d["changed_checks"]
    settings = d["settings"]
    return [
        Heading("Checks whose status changed"),
        Table(["check", "a", "b", "reason in b"], [[c["id"], c["a"], c["b"], c["reason_b"] or "—"] for c in checks])
        if checks else Para("None."),
        Heading("Settings and versions that differ"),
        Table(["setting", "a", "b"], [[s["key"], _value(s["a"]), _value(s["b"])] for s in settings])
        if settings else Para("None."),
    ]


def diff_blocks(d: Mapping[str, Any], path_a: str, path_b: str) -> list[Block]:
    """A receipt diff (from `diff_receipts`) as blocks."""
    return [*_summary_blocks(d, path_a, path_b), *_statistics_blocks(d), *_change_blocks(d)]


def diff_markdown(d: Mapping[str, Any], path_a: str, path_b: str) -> str:
    """A receipt diff as markdown."""
    return render_markdown(diff_blocks(d, path_a, path_b))
