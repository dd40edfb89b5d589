"""The PR report of one verified receipt: verdict (and its sync / numerics halves), who signed it, the
A/B/C table with the thresholds that decided, plots, failing checks with their reasons, the engine as deployed
(what the run covered and what not: `report.lifecycle`), comparisons with
their worst positions, the error breakdown, update agreement, perturbation and sync, provenance,
timings. As markdown (a PR comment or a job summary), plain text, or JSON-ready data.

Thresholds are read off each recorded check (its `op` and `budget`, the ones that decided it), never
off the config's fixed budgets: a budget derived from measurements shows as derived. Every string goes
through `lora_parity.util.escape` in the renderers. Pure rendering: a verified `Receipt` in, text or plain
data out; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from lora_parity.evidence.receipt import Check, CheckStatus, Receipt, Verdict
from lora_parity.report import lifecycle as lifecycle_section
from lora_parity.report.document import (
    Block,
    Bullets,
    Details,
    Heading,
    Image,
    Para,
    Table,
    check_format,
    clip,
    code,
    fmt_budget,
    fmt_num,
    fmt_signed,
    render_html,
    render_markdown,
    render_text,
)
from lora_parity.report.facts import (
    CHECK_TITLES,
    HEADLINE,
    HEADLINE_CHECKS,
    NOT_REACHED,
    checks_by_id,
    detection_limit,
    group_of,
    group_status,
    has_start_adapter,
    signature_note,
    start_point,
    threshold,
    worst_diffs,
)
from lora_parity.verdict import breakdown as breakdown_mod
from lora_parity.verdict import checks as checks_mod
from lora_parity.verdict import explain, findings

REPORT_FORMATS = ("md", "text", "json", "html")
_KEY_TIMINGS = {"total": "the sequence (after loading)", "backends.import": "importing the backends",
                "sampler.start": "starting the sampler", "trainer.load": "loading the trainer"}


# --- the headline ---------------------------------------------------------------------------------------


def _verdict_reason(receipt: Receipt) -> str:
    verdict = receipt.verdict
    if verdict == Verdict.PASS:
        return f"all {len(receipt.checks)} checks pass"
    if verdict == Verdict.ERROR:
        return f"the run errored: {code(clip(receipt.error or 'unknown error', 200))}"
    bad = checks_mod.not_passing(receipt.checks)
    if verdict == Verdict.INCONCLUSIVE and all(c.status == CheckStatus.NOT_REACHED for c in bad):
        empty = [code(c.id) for c in bad if c.elements == 0]  # not run: handed an empty set
        said = f" ({', '.join(empty)} compared nothing)" if empty else ""
        return f"{len(bad)} of {len(receipt.checks)} checks not reached{said}"
    ids = [c.id for c in checks_mod.not_passing(bad, reached=True) or bad]
    shown = ", ".join(code(i) for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
    word = "fail" if verdict == Verdict.FAIL else "inconclusive"
    return f"{len(ids)} of {len(receipt.checks)} checks {word}: {shown}"


def _verdict_line(receipt: Receipt) -> str:
    fault = f"; injected fault {code(receipt.injected_fault)}" if receipt.injected_fault else ""
    p = receipt.probes
    return (f"**Verdict: {receipt.verdict.value.upper()}**: {_verdict_reason(receipt)}{fault}. "
            f"{p.num_scored_positions} scored positions ({len(p.sequences)} sequences, {code(p.set)} probes), "
            f"{code(receipt.environment.device)}, {code(receipt.model.dtype)}.")


def _verdicts_line(receipt: Receipt) -> str | None:
    """'Sync (the LoRA path): **pass**; numerics (...): **fail**, decided by ...'; None for a receipt made
    before the two verdicts were recorded."""
    if receipt.verdicts is None:
        return None
    parts = []
    for name, what, group in (("sync", "delivery: B, C's movement, X, per-target movement", receipt.verdicts.sync),
                              ("numerics", "computation: A, the fp32 reference; C, T and G where X proved delivery",
                               receipt.verdicts.numerics)):
        ids = group.decided_by
        by = "" if group.verdict == Verdict.PASS or not ids else (
            ", decided by " + ", ".join(code(i) for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4
                                                                     else ""))
        parts.append(f"{name} ({start_point(receipt, what)}): **{group.verdict.value}**{by}")
    return "Verdicts: " + "; ".join(parts) + "."


def _revision(receipt: Receipt, width: int | None = None) -> str:
    r = receipt.revision
    state = {True: ", dirty", False: ", clean", None: ""}[r.dirty]
    reason = f": {code(r.reason)}" if r.reason else ""
    return f"{code(r.commit[:width])} ({r.source}{state}{reason})"


def _group_result(receipt: Receipt, group: str) -> str:
    members = [c for c in receipt.checks if group_of(c.id) == group]
    status = group_status(members, group)
    if status is None:
        return "—"
    if status == CheckStatus.PASS:
        return f"pass ({len(members)} checks)"
    bad = [c.id for c in members if c.status == status]
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{status.value.replace('_', ' ')}: {', '.join(bad[:3])}{more}"


def _target_thresholds(receipt: Receipt, measure: str, suffix: str) -> str:
    """One per-target measure's decided thresholds: '≥ 0.999', or their range where the noise set them per target."""
    decided = sorted({threshold(c) for c in receipt.checks if c.id.startswith("T.") and c.id.endswith(suffix)})
    return f"{measure} {decided[0]}" if len(decided) == 1 else f"{measure} {decided[0]} … {decided[-1]}" \
        if decided else ""


def _target_row(receipt: Receipt) -> list[str]:
    prefix = checks_mod.TARGET_PREFIX
    kinds = [d[len(prefix):] for d in receipt.deltas if d.startswith(prefix)]
    decided = [t for t in (_target_thresholds(receipt, "Δ cosine", ".cosine"),
                           _target_thresholds(receipt, "|scale - 1|", ".scale")) if t]
    return [CHECK_TITLES["T"], f"each target alone, synced ({len(kinds)} kinds)", "", "", "",
            ", ".join(decided) or "—", _group_result(receipt, "T")]


def _decided(receipt: Receipt, group: str) -> str:
    """The thresholds that decided a headline comparison, read off its checks ('mean ≤ 0.0001, ...')."""
    return ", ".join(f"{c.id.rsplit('.', 1)[-1].replace('stimulus', 'mean')} {threshold(c)}"
                     for c in checks_by_id(receipt, HEADLINE_CHECKS[group])) or "—"


def _headline_table(receipt: Receipt) -> Table:
    rows = []
    for group, (name, what) in HEADLINE.items():
        cmp = receipt.comparisons.get(name)
        stats = [fmt_num(cmp.mean_abs), fmt_num(cmp.p99), fmt_num(cmp.max_abs)] if cmp else [NOT_REACHED, "", ""]
        rows.append([start_point(receipt, CHECK_TITLES[group]), start_point(receipt, what), *stats,
                     _decided(receipt, group), _group_result(receipt, group)])
    if group_status(receipt.checks, "T") is not None:
        rows.append(_target_row(receipt))
    return Table(["check", "comparison", "mean |diff|", "p99", "max", "threshold (decided)", "result"], rows)


def _reference_line(receipt: Receipt) -> str | None:
    """With `--reference fp32`: each side's distance from the fp32 base model next to their distance
    from each other, the numbers that tell precision noise from a real disagreement."""
    get = receipt.comparisons.get
    trainer, sampler, both = get("R.trainer_vs_fp32"), get("R.sampler_vs_fp32"), get("A.trainer_vs_sampler")
    if trainer is None or sampler is None or both is None:
        return None
    return (f"Base model scored in fp32 by HF, mean / max |diff| at zero-init: trainer {trainer.mean_abs:.4g} / "
            f"{trainer.max_abs:.4g}, sampler {sampler.mean_abs:.4g} / {sampler.max_abs:.4g}; trainer vs sampler "
            f"{both.mean_abs:.4g} / {both.max_abs:.4g}. Where both sides are about as far from fp32 as from each "
            "other, their disagreement is the model's precision noise in this dtype; a side much farther from "
            "fp32 than the other is the one to look at.")


# --- tables -------------------------------------------------------------------------------------------


def _worst_cell(receipt: Receipt, name: str) -> str:
    worst = worst_diffs(receipt, name)
    if not worst:
        return "— (all 0)"
    return "; ".join(f"s{p.sequence} t{p.position} tok {p.token_id}: {fmt_signed(p.diff)}" for p in worst)


def _comparisons_table(receipt: Receipt) -> Table:
    rows = [[name, f"{c.b} − {c.a}", str(c.n), fmt_num(c.mean_abs), fmt_num(c.p99), fmt_num(c.max_abs),
             _equal_cell(c.equal), _worst_cell(receipt, name)] for name, c in receipt.comparisons.items()]
    return Table(["comparison", "diff", "n", "mean |diff|", "p99", "max", "bitwise equal",
                  "worst positions (sequence, position, token id: diff)"], rows)


def _equal_cell(equal: float | None) -> str:
    """The fraction of bitwise-equal positions: 100 % only when every one is, '—' where not recorded."""
    if equal is None:
        return "—"
    return "100 %" if equal == 1 else f"{min(100 * equal, 99.9):.1f} %"


def _checks_table(checks: Sequence[Check]) -> Table:
    return Table(["check", "observed", "threshold", "compared", "status", "reason"],
                 [[c.id, fmt_num(c.observed), threshold(c), "—" if c.elements is None else str(c.elements),
                   c.status.value.replace("_", " "), c.reason] for c in checks])


def _failing_table(checks: Sequence[Check]) -> Table:
    """The checks that did not pass: each one's threshold, reason, and what it means."""
    ids = frozenset(c.id for c in checks)
    return Table(["check", "observed", "threshold", "status", "reason", "what it means, where to look"],
                 [[c.id, fmt_num(c.observed), threshold(c), c.status.value.replace("_", " "), c.reason,
                   explain.line(c, ids)] for c in checks])


def _breakdown_tables(receipt: Receipt) -> list[Block]:
    """|diff| of A and C by the trainer's logprob and by position quartile: the receipt's record, or for a
    receipt made before it was recorded, the same from its scores."""
    recorded = receipt.breakdown if receipt.breakdown is not None else breakdown_mod.compute(receipt.scores)
    titles = {name: f"{start_point(receipt, CHECK_TITLES[group])}: {start_point(receipt, what)}"
              for group, (name, what) in HEADLINE.items()}
    blocks: list[Block] = []
    for name, b in recorded.items():
        rows = [[by, s.bucket, str(s.n), fmt_num(s.mean_abs), fmt_num(s.max_abs)]
                for by, buckets in (("trainer logprob", b.by_logprob), ("position", b.by_position))
                for s in buckets]
        blocks += [Para(f"**{titles.get(name, name)}** ({code(name)})"),
                   Table(["by", "bucket", "n", "mean |diff|", "max |diff|"], rows)]
    return blocks


def _deltas_table(receipt: Receipt) -> Table:
    return Table(["update", "cosine", "scale", "rel L2", "‖Δsampler‖", "‖Δtrainer‖"],
                 [[name, fmt_num(d.cosine), fmt_num(d.scale), fmt_num(d.rel_l2), fmt_num(d.sampler_norm),
                   fmt_num(d.trainer_norm)] for name, d in receipt.deltas.items()])


def _versions(versions: Mapping[str, str]) -> str:
    return ", ".join(f"{code(k)} {code(v)}" for k, v in versions.items()) or "none recorded"


def _setting_value(v: Any) -> str:
    return ", ".join(v) if isinstance(v, list) else v if isinstance(v, str) else json.dumps(v)


def _settings_table(receipt: Receipt) -> Table:
    return Table(["side", "setting", "value"],
                 [[side, k, _setting_value(v)]
                  for side, info in (("trainer", receipt.trainer), ("sampler", receipt.sampler))
                  for k, v in info.settings.items()])


# --- sections -----------------------------------------------------------------------------------------


def _title(receipt: Receipt) -> str:
    m, t, s = receipt.model, receipt.trainer, receipt.sampler
    start = ", from a start adapter" if has_start_adapter(receipt) else ""
    return f"lora-parity: {m.name}, {t.backend} trainer vs {s.backend} sampler{start}"


def _head_blocks(receipt: Receipt, path: str, plots: Mapping[str, str] | None, signature: str | None) -> list[Block]:
    verdicts = _verdicts_line(receipt)
    blocks: list[Block] = [
        Heading(_title(receipt), 2),
        Para(_verdict_line(receipt)),
        *([Para(verdicts)] if verdicts else []),
        *([Bullets(found)] if (found := findings.of_receipt(receipt)) else []),
        *([Para(limit)] if (limit := detection_limit(receipt)) else []),
        Para(f"Receipt {code(path)}: **{signature_note(signature)}**, sha256 {code(receipt.digest[:12])}; "
             f"revision {_revision(receipt, 12)}, lora-parity {code(receipt.tool_version)}, "
             f"created {code(receipt.created_at)}."),
        _headline_table(receipt),
    ]
    bad = checks_mod.not_passing(receipt.checks)
    if bad:
        blocks += [Heading("Checks that did not pass"), _failing_table(bad)]
    reference = _reference_line(receipt)
    if reference:
        blocks += [Heading("fp32 reference"), Para(reference)]
    if plots:
        blocks.append(Heading("Plots: |diff| per position"))
        blocks += [Image(f"{name}: absolute diff per position", link) for name, link in plots.items()]
    return blocks


def _comparison_blocks(receipt: Receipt) -> list[Block]:
    blocks: list[Block] = [
        Heading("Comparisons"),
        Para("diff = b − a per scored position; position t of sequence s scores token `sequences[s][t+1]`."),
        _comparisons_table(receipt) if receipt.comparisons else Para("No comparison was reached."),
        Details(f"All {len(receipt.checks)} checks", [_checks_table(receipt.checks)]),
    ]
    breakdown = _breakdown_tables(receipt)
    if breakdown:
        blocks += [Heading("Error breakdown: |diff| by the trainer's logprob and by position quartile"), *breakdown]
    if receipt.deltas:
        blocks += [Heading(start_point(receipt, "Update agreement (Δ = updated − zero-init, sampler vs trainer)")),
                   _deltas_table(receipt)]
    return blocks


def _perturbation_blocks(receipt: Receipt) -> list[Block]:
    pert = receipt.perturbation
    items = [
        (f"perturbation: {code(pert.kind)}, seed {pert.seed}, std {fmt_budget(pert.std)}, {pert.num_tensors} "
         f"tensors, {pert.num_elements} elements" if pert else "perturbation: not applied (the run stopped before it)"),
        f"sync mode: {code(receipt.sync_mode)}; adapters published: {len(receipt.adapters)}",
        f"injected fault: {code(receipt.injected_fault) if receipt.injected_fault else 'none'}",
    ]
    if receipt.error:
        items.append(f"error: {code(clip(receipt.error, 300))}")
    blocks: list[Block] = [Heading("Perturbation and sync"), Bullets(items)]
    if receipt.adapters:
        blocks.append(Table(["version", "name", "id", "mode", "seconds"],
                            [[str(a.version), a.name, str(a.adapter_id), a.mode, f"{a.seconds:.3f}"]
                             for a in receipt.adapters]))
    if pert:
        blocks.append(Details(f"{pert.num_tensors} perturbed tensors", [Bullets([code(n) for n in pert.tensors])]))
    return blocks


def _model_line(receipt: Receipt) -> str:
    """The model as the receipt records it, its `model.source` included."""
    m = receipt.model
    return (f"model: {code(m.name)} from {code(m.source)}, {code(m.dtype)}"
            + (f", {code(m.architecture)}" if m.architecture else "")
            + f"; config sha256 {code(m.config_digest[:12])}"
            + (f", weights sha256 {code(m.weights_digest[:12])}" if m.weights_digest else ""))


def _provenance_blocks(receipt: Receipt) -> list[Block]:
    e, b, t, s = receipt.environment, receipt.budgets, receipt.trainer, receipt.sampler
    return [
        Heading("Provenance"),
        Bullets([
            f"revision: {_revision(receipt)}",
            f"command: {code(' '.join(['lora-parity', *receipt.command]))}",
            _model_line(receipt),
            f"trainer {code(t.backend)}: {_versions(t.versions)}",
            f"sampler {code(s.backend)}: {_versions(s.versions)}",
            f"environment: Python {code(e.python)}, {code(e.platform)}, torch {code(e.torch or 'not loaded')}, "
            f"device {code(e.device)}",
            f"probes: {code(receipt.probes.set)}"
            + (f" ({receipt.probes.source.kind} source)" if receipt.probes.source else "")
            + f", seed {receipt.probes.seed}, "
            f"sha256 {code(receipt.probes.digest[:12])}",
            "budgets: " + ", ".join(f"{k} {fmt_budget(v)}" for k, v in b.model_dump().items()
                                    if v is not None and v is not False),  # exact: shown only where on
        ]),
        Details("Backend settings", [_settings_table(receipt)]),
    ]


def _timing_blocks(receipt: Receipt) -> list[Block]:
    return [
        Heading("Timings"),
        Bullets([f"{label}: {receipt.timings[key]:.2f} s" for key, label in _KEY_TIMINGS.items()
                 if key in receipt.timings] or ["no timings recorded"]),
        Table(["phase", "status", "seconds"],
              [[p.name, p.status.value + (f": {p.message}" if p.message else ""), f"{p.seconds:.3f}"]
               for p in receipt.phases]),
        Details("Every timing", [Table(["step", "seconds"],
                                       [[k, f"{v:.3f}"] for k, v in receipt.timings.items()])]),
    ]


# --- the report ---------------------------------------------------------------------------------------


def report_blocks(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None,
                  signature: str | None = None) -> list[Block]:
    """The report as blocks: verdict, the sync and numerics verdicts, signature, A/B/C table with the
    thresholds that decided, plots, failing checks, comparisons, error breakdown, checks, update
    agreement, perturbation and sync, provenance, timings. `path` is printed as given; `plots` maps a
    comparison name to its image link; `signature` is `verify`'s signature status (None: unsigned)."""
    return [*_head_blocks(receipt, path, plots, signature), *lifecycle_section.blocks(receipt),
            *_comparison_blocks(receipt), *_perturbation_blocks(receipt), *_provenance_blocks(receipt),
            *_timing_blocks(receipt)]


def report_markdown(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None,
                    signature: str | None = None) -> str:
    """The report as GitHub markdown (for a PR comment or a job summary)."""
    return render_markdown(report_blocks(receipt, path, plots, signature))


def _headline_data(receipt: Receipt) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, (name, _) in HEADLINE.items():
        status = group_status(receipt.checks, group)
        cmp = receipt.comparisons.get(name)
        numbers = {k: getattr(cmp, k) for k in ("mean_abs", "p99", "max_abs")} if cmp else {"reached": False}
        thresholds = {c.id: {"op": c.op, "budget": c.budget} for c in checks_by_id(receipt, HEADLINE_CHECKS[group])}
        out[group] = {"comparison": name, "result": status.value if status else None, **numbers,
                      "thresholds": thresholds}
    return out


def report_data(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None,
                signature: str | None = None) -> dict[str, Any]:
    """The report as JSON-ready data."""
    recorded = receipt.breakdown if receipt.breakdown is not None else breakdown_mod.compute(receipt.scores)
    return {
        "receipt": path,
        "digest": receipt.digest,
        "signature": signature_note(signature),
        "verdict": receipt.verdict.value,
        "verdicts": receipt.verdicts.model_dump(mode="json") if receipt.verdicts else None,
        "start": "start adapter" if has_start_adapter(receipt) else "zero-init",
        "error": receipt.error,
        "injected_fault": receipt.injected_fault,
        "not_passing": [c.id for c in checks_mod.not_passing(receipt.checks)],
        "headline": _headline_data(receipt),
        "budgets": receipt.budgets.model_dump(mode="json"),
        "comparisons": {
            name: {"a": c.a, "b": c.b, "n": c.n, "mean_abs": c.mean_abs, "p99": c.p99, "max_abs": c.max_abs,
                   "equal": c.equal, "worst": [asdict(p) for p in worst_diffs(receipt, name)]}
            for name, c in receipt.comparisons.items()
        },
        "checks": [c.model_dump(mode="json") for c in receipt.checks],
        "deltas": {k: v.model_dump(mode="json") for k, v in receipt.deltas.items()},
        "breakdown": {k: v.model_dump(mode="json") for k, v in recorded.items()},
        "perturbation": receipt.perturbation.model_dump(mode="json") if receipt.perturbation else None,
        "sync_mode": receipt.sync_mode,
        "adapters": [a.model_dump(mode="json") for a in receipt.adapters],
        "revision": receipt.revision.model_dump(mode="json"),
        "tool_version": receipt.tool_version,
        "created_at": receipt.created_at,
        "model": receipt.model.model_dump(mode="json"),
        "trainer": receipt.trainer.model_dump(mode="json"),
        "sampler": receipt.sampler.model_dump(mode="json"),
        "environment": receipt.environment.model_dump(mode="json"),
        "phases": [p.model_dump(mode="json") for p in receipt.phases],
        "lifecycle": [r.model_dump(mode="json") for r in lifecycle_section.rows(receipt)],
        "timings": dict(receipt.timings),
        "plots": dict(plots or {}),
    }


def render_report(receipt: Receipt, path: str, fmt: str, plots: Mapping[str, str] | None = None,
                  signature: str | None = None) -> str:
    """The report in `fmt` (md, text, json or html: one page; its images are the `plots` links as given,
    data: URIs for a self-contained page); `signature` as in `report_blocks`."""
    check_format(fmt, REPORT_FORMATS)
    if fmt == "json":
        return json.dumps(report_data(receipt, path, plots, signature), indent=2) + "\n"
    blocks = report_blocks(receipt, path, plots, signature)
    if fmt == "html":
        return render_html(blocks, f"lora-parity: {receipt.model.name} ({receipt.verdict.value})")
    return render_markdown(blocks) if fmt == "md" else render_text(blocks)
