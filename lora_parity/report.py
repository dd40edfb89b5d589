"""Receipts people read: the PR report, the evidence table, the JSON Schema and the receipt diff.

Pure rendering: a verified `Receipt` in, text or plain data out; no I/O. The CLI loads (and
verifies) receipts, writes plots (`lora_parity.plots`) and prints what these functions return.

Token alignment: score position t of probe sequence s is log p(tokens[t+1] | tokens[:t+1]), so the
token scored there, which the report names beside a worst position, is
`probes.sequences[s][t + 1]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lora_parity import checks as checks_mod
from lora_parity.errors import ConfigError
from lora_parity.receipt import BackendInfo, Check, CheckStatus, ComparisonStats, Receipt, Verdict

REPORT_FORMATS = ("md", "text", "json")
TABLE_FORMATS = ("md", "rich")
NUM_WORST = 3
"""Worst positions listed per comparison."""
NOT_REACHED = "Not reached"

# The three comparisons behind checks A, B and C, in the order people read them.
HEADLINE: dict[str, tuple[str, str]] = {
    "A": ("A.trainer_vs_sampler", "zero-init trainer vs sampler"),
    "B": ("B.trainer_updated_vs_stale", "updated trainer vs stale sampler"),
    "C": ("C.trainer_vs_sampler", "updated trainer vs synced sampler"),
}
CHECK_TITLES = {"A": "A zero-init", "B": "B before sync", "C": "C after sync", "T": "T per target"}
_STATUS_RANK = {CheckStatus.FAIL: 3, CheckStatus.INCONCLUSIVE: 2, CheckStatus.NOT_REACHED: 1, CheckStatus.PASS: 0}


def check_format(fmt: str, allowed: Sequence[str]) -> str:
    """`fmt` if it is one of `allowed`, else a `ConfigError` naming them."""
    if fmt not in allowed:
        raise ConfigError(f"unknown format {fmt!r}; choose from {', '.join(allowed)}")
    return fmt


# --- numbers ---------------------------------------------------------------------------------------


def fmt_num(x: float | None) -> str:
    """Three significant digits; '—' for a missing value."""
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.3g}"


def fmt_signed(x: float) -> str:
    """Three significant digits with a sign."""
    return "0" if x == 0 else f"{x:+.3g}"


def _budget(x: float | str) -> str:
    return x if isinstance(x, str) else f"{x:g}"  # str: the budget profile


# --- per-position differences ------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """One scored position of a comparison: diff = scores[b][s][t] - scores[a][s][t]."""

    sequence: int
    position: int
    token_id: int
    """The token scored at this position: probes.sequences[sequence][position + 1]."""
    diff: float


def position_diffs(receipt: Receipt, comparison: str) -> list[Position]:
    """Every position of a recorded comparison in sequence order, with the token it scores."""
    cmp = receipt.comparisons[comparison]
    a, b, seqs = receipt.scores[cmp.a], receipt.scores[cmp.b], receipt.probes.sequences
    return [
        Position(s, t, seqs[s][t + 1], y - x)
        for s, (row_a, row_b) in enumerate(zip(a, b, strict=True))
        for t, (x, y) in enumerate(zip(row_a, row_b, strict=True))
    ]


def worst_positions(receipt: Receipt, comparison: str, k: int = NUM_WORST) -> list[Position]:
    """The `k` positions with the largest |diff| (ties: earliest first); none when every diff is 0."""
    ranked = sorted(enumerate(position_diffs(receipt, comparison)), key=lambda ip: (-abs(ip[1].diff), ip[0]))
    return [p for _, p in ranked[:k] if p.diff != 0]


# --- checks -------------------------------------------------------------------------------------------


def _group(check_id: str) -> str:
    return check_id.split(".", 1)[0]


def group_status(checks: Iterable[Check], group: str) -> CheckStatus | None:
    """The worst status among the checks of one group (A, B, C, T); None if it has none."""
    statuses = [c.status for c in checks if _group(c.id) == group]
    return max(statuses, key=_STATUS_RANK.__getitem__) if statuses else None


def not_passing(receipt: Receipt) -> list[Check]:
    """Checks that failed, were inconclusive, or were not reached, in receipt order."""
    return [c for c in receipt.checks if c.status != CheckStatus.PASS]


def short_reason(check: Check) -> str:
    """The check's failure reason without the numbers ('zero-init trainer vs sampler disagree')."""
    reason = re.sub(r": [^:]* not (<=|>=|>) [^:]*$", "", check.reason)
    return re.sub(r" \(undefined: [^)]*\)$", "", reason)


def outcome(receipt: Receipt) -> str:
    """The evidence table's Result: 'Pass', 'Fails A: <reason>', 'Inconclusive: <reason>' or 'Error: <message>'."""
    if receipt.verdict == Verdict.PASS:
        return "Pass"
    if receipt.verdict == Verdict.ERROR:
        return f"Error: {_clip(receipt.error or 'the run errored')}"
    if receipt.verdict == Verdict.FAIL:
        first = next((c for c in receipt.checks if c.status == CheckStatus.FAIL), None)
        return f"Fails {_group(first.id)}: {short_reason(first)} ({first.id})" if first else "Fails"
    first = next((c for c in receipt.checks if c.status != CheckStatus.PASS), None)
    return f"Inconclusive: {short_reason(first)} ({first.id})" if first else "Inconclusive"


def _clip(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- a tiny document model, rendered as markdown or plain text ----------------------------------------


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 3


@dataclass(frozen=True)
class Para:
    """Text with `**bold**` and `code` markup (receipt strings only ever go into code spans)."""

    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Table:
    """Plain-text cells; the markdown renderer escapes them."""

    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    alt: str
    link: str


@dataclass(frozen=True)
class Details:
    """Collapsed in markdown, a plain section in text."""

    summary: str
    blocks: list[Block]


Block = Heading | Para | Bullets | Table | Image | Details


def code(text: object) -> str:
    """A string from a receipt as an inline code span: one line, no backticks."""
    return "`" + " ".join(str(text).replace("`", "'").split()) + "`"


def _md_cell(text: str) -> str:
    text = " ".join(text.split()).replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")
    # Only a '<' that could open an HTML tag or comment is escaped: '<=' stays readable.
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)


def _md_link(link: str) -> str:
    return link.replace(" ", "%20").replace("(", "%28").replace(")", "%29")


def render_markdown(blocks: Sequence[Block]) -> str:
    """GitHub-flavoured markdown."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Table):
            lines = ["| " + " | ".join(_md_cell(h) for h in b.header) + " |",
                     "|" + "---|" * len(b.header)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{_md_cell(b.alt)}]({_md_link(b.link)})")
        else:
            out.append(f"<details><summary>{_md_cell(b.summary)}</summary>\n\n{render_markdown(b.blocks)}\n</details>")
    return "\n\n".join(out) + "\n"


def _plain(text: str) -> str:
    return text.replace("**", "").replace("`", "")


def render_text(blocks: Sequence[Block]) -> str:
    """Plain text with aligned columns, for a terminal or a log."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{b.text}\n{('=' if b.level <= 2 else '-') * len(b.text)}")
        elif isinstance(b, Para):
            out.append(_plain(b.text))
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {_plain(item)}" for item in b.items))
        elif isinstance(b, Table):
            rows = [b.header, *b.rows]
            widths = [max(len(r[i]) for r in rows) for i in range(len(b.header))]
            lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
            lines.insert(1, "  ".join("-" * w for w in widths))
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"plot: {b.alt}: {b.link}")
        else:
            out.append(render_text([Heading(b.summary, 4), *b.blocks]).rstrip("\n"))
    return "\n\n".join(out) + "\n"


# --- the report ---------------------------------------------------------------------------------------


def _verdict_line(receipt: Receipt) -> str:
    verdict = receipt.verdict
    bad = not_passing(receipt)
    if verdict == Verdict.PASS:
        why = f"all {len(receipt.checks)} checks pass"
    elif verdict == Verdict.ERROR:
        why = f"the run errored: {code(_clip(receipt.error or 'unknown error', 200))}"
    else:
        ids = [c.id for c in bad if c.status != CheckStatus.NOT_REACHED] or [c.id for c in bad]
        shown = ", ".join(code(i) for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
        word = "fail" if verdict == Verdict.FAIL else "inconclusive"
        why = f"{len(ids)} of {len(receipt.checks)} checks {word}: {shown}"
        if verdict == Verdict.INCONCLUSIVE and all(c.status == CheckStatus.NOT_REACHED for c in bad):
            why = f"{len(ids)} of {len(receipt.checks)} checks not reached"
    fault = f"; injected fault {code(receipt.injected_fault)}" if receipt.injected_fault else ""
    p = receipt.probes
    return (f"**Verdict: {verdict.value.upper()}**: {why}{fault}. {p.num_scored_positions} scored positions "
            f"({len(p.sequences)} sequences, {code(p.set)} probes), {code(receipt.environment.device)}, "
            f"{code(receipt.model.dtype)}.")


def _revision(receipt: Receipt, width: int | None = None) -> str:
    r = receipt.revision
    state = {True: ", dirty", False: ", clean", None: ""}[r.dirty]
    reason = f": {code(r.reason)}" if r.reason else ""
    return f"{code(r.commit[:width])} ({r.source}{state}{reason})"


def _headline_table(receipt: Receipt) -> Table:
    b = receipt.budgets
    parity_budget = f"mean ≤ {_budget(b.mean)}, p99 ≤ {_budget(b.p99)}, max ≤ {_budget(b.max)}"
    budgets = {"A": parity_budget, "B": f"mean ≥ {_budget(b.min_stimulus)}", "C": parity_budget}
    rows = []
    for group, (name, what) in HEADLINE.items():
        cmp = receipt.comparisons.get(name)
        stats = [fmt_num(cmp.mean_abs), fmt_num(cmp.p99), fmt_num(cmp.max_abs)] if cmp else [NOT_REACHED, "", ""]
        rows.append([CHECK_TITLES[group], what, *stats, budgets[group], _group_result(receipt, group)])
    if group_status(receipt.checks, "T") is not None:
        kinds = [d[len(checks_mod.TARGET_PREFIX):] for d in receipt.deltas if d.startswith(checks_mod.TARGET_PREFIX)]
        rows.append([CHECK_TITLES["T"], f"each target alone, synced ({len(kinds)} kinds)", "", "", "",
                     f"Δ cosine ≥ {_budget(b.min_delta_cosine)}, |scale - 1| ≤ {_budget(b.max_delta_scale_error)}",
                     _group_result(receipt, "T")])
    return Table(["check", "comparison", "mean |diff|", "p99", "max", "budget", "result"], rows)


def _group_result(receipt: Receipt, group: str) -> str:
    members = [c for c in receipt.checks if _group(c.id) == group]
    status = group_status(members, group)
    if status is None:
        return "—"
    if status == CheckStatus.PASS:
        return f"pass ({len(members)} checks)"
    bad = [c.id for c in members if c.status == status]
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{status.value.replace('_', ' ')}: {', '.join(bad[:3])}{more}"


def _worst_cell(receipt: Receipt, name: str) -> str:
    worst = worst_positions(receipt, name)
    if not worst:
        return "— (all 0)"
    return "; ".join(f"s{p.sequence} t{p.position} tok {p.token_id}: {fmt_signed(p.diff)}" for p in worst)


def _comparisons_table(receipt: Receipt) -> Table:
    rows = [[name, f"{c.b} − {c.a}", str(c.n), fmt_num(c.mean_abs), fmt_num(c.p99), fmt_num(c.max_abs),
             _worst_cell(receipt, name)] for name, c in receipt.comparisons.items()]
    return Table(["comparison", "diff", "n", "mean |diff|", "p99", "max",
                  "worst positions (sequence, position, token id: diff)"], rows)


def _checks_table(checks: Sequence[Check]) -> Table:
    return Table(["check", "observed", "budget", "status", "reason"],
                 [[c.id, fmt_num(c.observed), f"{c.op} {_budget(c.budget)}" if c.budget is not None else "—",
                   c.status.value.replace("_", " "), c.reason] for c in checks])


def _deltas_table(receipt: Receipt) -> Table:
    return Table(["update", "cosine", "scale", "rel L2", "‖Δsampler‖", "‖Δtrainer‖"],
                 [[name, fmt_num(d.cosine), fmt_num(d.scale), fmt_num(d.rel_l2), fmt_num(d.sampler_norm),
                   fmt_num(d.trainer_norm)] for name, d in receipt.deltas.items()])


def _versions(versions: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {code(v)}" for k, v in versions.items()) or "none recorded"


def _settings_table(receipt: Receipt) -> Table:
    rows = []
    for side, info in (("trainer", receipt.trainer), ("sampler", receipt.sampler)):
        for k, v in info.settings.items():
            rows.append([side, k, ", ".join(v) if isinstance(v, list) else v if isinstance(v, str) else json.dumps(v)])
    return Table(["side", "setting", "value"], rows)


_KEY_TIMINGS = {
    "total": "the sequence (after loading)",
    "backends.import": "importing the backends",
    "sampler.start": "starting the sampler",
    "trainer.load": "loading the trainer",
}


def report_blocks(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None) -> list[Block]:
    """The report as blocks: verdict, A/B/C table, plots, comparisons, checks, update agreement,
    perturbation and sync, provenance, timings. `path` is printed as given; `plots` maps a
    comparison name to its image link."""
    m, t, s = receipt.model, receipt.trainer, receipt.sampler
    blocks: list[Block] = [
        Heading(f"lora-parity: {m.name}, {t.backend} trainer vs {s.backend} sampler", 2),
        Para(_verdict_line(receipt)),
        Para(f"Receipt {code(path)} (sha256 {code(receipt.digest[:12])}), revision {_revision(receipt, 12)}, "
             f"lora-parity {code(receipt.tool_version)}, created {code(receipt.created_at)}."),
        _headline_table(receipt),
    ]
    bad = not_passing(receipt)
    if bad:
        blocks += [Heading("Checks that did not pass"), _checks_table(bad)]
    reference = _reference_line(receipt)
    if reference:
        blocks += [Heading("fp32 reference"), Para(reference)]
    if plots:
        blocks.append(Heading("Plots: |diff| per position"))
        blocks += [Image(f"{name}: absolute diff per position", link) for name, link in plots.items()]
    blocks += [
        Heading("Comparisons"),
        Para("diff = b − a per scored position; position t of sequence s scores token `sequences[s][t+1]`."),
        _comparisons_table(receipt) if receipt.comparisons else Para("No comparison was reached."),
        Details(f"All {len(receipt.checks)} checks", [_checks_table(receipt.checks)]),
    ]
    if receipt.deltas:
        blocks += [Heading("Update agreement (Δ = updated − zero-init, sampler vs trainer)"), _deltas_table(receipt)]

    blocks.append(Heading("Perturbation and sync"))
    pert = receipt.perturbation
    items = [
        (f"perturbation: {code(pert.kind)}, seed {pert.seed}, std {_budget(pert.std)}, {pert.num_tensors} tensors, "
         f"{pert.num_elements} elements" if pert else "perturbation: not applied (the run stopped before it)"),
        f"sync mode: {code(receipt.sync_mode)}; adapters published: {len(receipt.adapters)}",
        f"injected fault: {code(receipt.injected_fault) if receipt.injected_fault else 'none'}",
    ]
    if receipt.error:
        items.append(f"error: {code(_clip(receipt.error, 300))}")
    blocks.append(Bullets(items))
    if receipt.adapters:
        blocks.append(Table(["version", "name", "id", "mode", "seconds"],
                            [[str(a.version), a.name, str(a.adapter_id), a.mode, f"{a.seconds:.3f}"]
                             for a in receipt.adapters]))
    if pert:
        blocks.append(Details(f"{pert.num_tensors} perturbed tensors", [Bullets([code(n) for n in pert.tensors])]))

    e, b = receipt.environment, receipt.budgets
    blocks += [
        Heading("Provenance"),
        Bullets([
            f"revision: {_revision(receipt)}",
            f"command: {code(' '.join(['lora-parity', *receipt.command]))}",
            f"model: {code(m.name)} from {code(m.source)}, {code(m.dtype)}"
            + (f", {code(m.architecture)}" if m.architecture else "")
            + f"; config sha256 {code(m.config_digest[:12])}"
            + (f", weights sha256 {code(m.weights_digest[:12])}" if m.weights_digest else ""),
            f"trainer {code(t.backend)}: {_versions(t.versions)}",
            f"sampler {code(s.backend)}: {_versions(s.versions)}",
            f"environment: Python {code(e.python)}, {code(e.platform)}, torch {code(e.torch or 'not loaded')}, "
            f"device {code(e.device)}",
            f"probes: {code(receipt.probes.set)}"
            + (f" ({receipt.probes.source.kind} source)" if receipt.probes.source else "")
            + f", seed {receipt.probes.seed}, "
            f"sha256 {code(receipt.probes.digest[:12])}",
            "budgets: " + ", ".join(f"{k} {_budget(v)}" for k, v in b.model_dump().items() if v is not None),
        ]),
        Details("Backend settings", [_settings_table(receipt)]),
        Heading("Timings"),
        Bullets([f"{label}: {receipt.timings[key]:.2f} s" for key, label in _KEY_TIMINGS.items()
                 if key in receipt.timings] or ["no timings recorded"]),
        Table(["phase", "status", "seconds"],
              [[p.name, p.status.value + (f": {p.message}" if p.message else ""), f"{p.seconds:.3f}"]
               for p in receipt.phases]),
        Details("Every timing", [Table(["step", "seconds"],
                                       [[k, f"{v:.3f}"] for k, v in receipt.timings.items()])]),
    ]
    return blocks


def report_markdown(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None) -> str:
    """The report as GitHub markdown (for a PR comment or a job summary)."""
    return render_markdown(report_blocks(receipt, path, plots))


def report_data(receipt: Receipt, path: str, plots: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The report as JSON-ready data."""
    return {
        "receipt": path,
        "digest": receipt.digest,
        "verdict": receipt.verdict.value,
        "error": receipt.error,
        "injected_fault": receipt.injected_fault,
        "not_passing": [c.id for c in not_passing(receipt)],
        "headline": {
            group: {"comparison": name,
                    "result": (gs.value if (gs := group_status(receipt.checks, group)) else None),
                    **({k: getattr(cmp, k) for k in ("mean_abs", "p99", "max_abs")}
                       if (cmp := receipt.comparisons.get(name)) else {"reached": False})}
            for group, (name, _) in HEADLINE.items()
        },
        "budgets": receipt.budgets.model_dump(mode="json"),
        "comparisons": {
            name: {"a": c.a, "b": c.b, "n": c.n, "mean_abs": c.mean_abs, "p99": c.p99, "max_abs": c.max_abs,
                   "worst": [asdict(p) for p in worst_positions(receipt, name)]}
            for name, c in receipt.comparisons.items()
        },
        "checks": [c.model_dump(mode="json") for c in receipt.checks],
        "deltas": {k: v.model_dump(mode="json") for k, v in receipt.deltas.items()},
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
        "timings": dict(receipt.timings),
        "plots": dict(plots or {}),
    }


def render_report(receipt: Receipt, path: str, fmt: str, plots: Mapping[str, str] | None = None) -> str:
    """The report in `fmt` (md, text or json)."""
    check_format(fmt, REPORT_FORMATS)
    if fmt == "json":
        return json.dumps(report_data(receipt, path, plots), indent=2) + "\n"
    blocks = report_blocks(receipt, path, plots)
    return render_markdown(blocks) if fmt == "md" else render_text(blocks)


# --- the evidence table -----------------------------------------------------------------------------------

TABLE_HEADER = ["Model / input", "A: zero-init diff", "B: diff before sync", "C: diff after sync", "Result"]


@dataclass(frozen=True)
class EvidenceRow:
    """One receipt as a row of the seed's evidence table (mean |diff| of each headline comparison)."""

    model_input: str
    a: str
    b: str
    c: str
    result: str

    def cells(self) -> list[str]:
        """The row's cells in TABLE_HEADER order."""
        return [self.model_input, self.a, self.b, self.c, self.result]


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


def model_input(receipt: Receipt) -> str:
    """'tiny-qwen3, held-out (hf → vllm, cpu)': model, a non-default probe set, an injected fault,
    then trainer → sampler and the device."""
    parts = [receipt.model.name]
    if receipt.probes.set != "default":
        parts.append(receipt.probes.set)
    if receipt.injected_fault:
        parts.append(f"injected {receipt.injected_fault}")
    return f"{', '.join(parts)} ({_side(receipt.trainer)} → {_side(receipt.sampler)}, {receipt.environment.device})"


def _side(info: BackendInfo) -> str:
    """'megatron TP2': the backend, with its tensor-parallel size when above 1."""
    tp = info.settings.get("tensor_parallel", info.settings.get("tensor_parallel_size", 1))
    return f"{info.backend} TP{tp}" if isinstance(tp, int) and tp > 1 else info.backend


def _mean_cell(cmp: ComparisonStats | None) -> str:
    return f"{cmp.mean_abs:.6f}" if cmp is not None else NOT_REACHED


def evidence_row(receipt: Receipt) -> EvidenceRow:
    """The evidence-table row of one receipt."""
    get = receipt.comparisons.get
    return EvidenceRow(model_input(receipt), _mean_cell(get(HEADLINE["A"][0])), _mean_cell(get(HEADLINE["B"][0])),
                       _mean_cell(get(HEADLINE["C"][0])), outcome(receipt))


def table_header(receipts: Sequence[Receipt]) -> list[str]:
    """The header; when every receipt has the same budgets they are named in it, as in the seed."""
    budgets = {r.budgets for r in receipts}
    if len(budgets) != 1:
        return list(TABLE_HEADER)
    (b,) = budgets
    return [TABLE_HEADER[0], f"{TABLE_HEADER[1]} (≤ {_budget(b.mean)})",
            f"{TABLE_HEADER[2]} (≥ {_budget(b.min_stimulus)})", f"{TABLE_HEADER[3]} (≤ {_budget(b.mean)})",
            TABLE_HEADER[4]]


def table_markdown(receipts: Sequence[Receipt]) -> str:
    """The evidence table in markdown, one row per receipt in the order given."""
    return render_markdown([Table(table_header(receipts), [evidence_row(r).cells() for r in receipts])])


# --- the JSON Schema ------------------------------------------------------------------------------------


def schema_json() -> str:
    """The receipt's JSON Schema from the pydantic models: sorted keys, indent 2, trailing newline."""
    return json.dumps(Receipt.model_json_schema(), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


# --- the receipt diff -----------------------------------------------------------------------------------

_DIFF_STATS = ("mean_abs", "p99", "max_abs")
_DELTA_STATS = ("cosine", "scale", "rel_l2")


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


def diff_receipts(a: Receipt, b: Receipt) -> dict[str, Any]:
    """How receipt `b` differs from receipt `a`: each comparison's mean, p99 and max (a, b, b - a),
    delta agreement, checks whose status changed, verdicts, and settings that differ.
    `identical` is true when none of those differ (timings and creation times are not compared)."""
    order = list(checks_mod.COMPARISONS)
    names = sorted(set(a.comparisons) | set(b.comparisons),
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    comparisons = {}
    for name in names:
        ca, cb = a.comparisons.get(name), b.comparisons.get(name)
        comparisons[name] = {s: _pair(ca, cb, s) for s in _DIFF_STATS}
    deltas = {}
    for name in list(dict.fromkeys([*a.deltas, *b.deltas])):
        da, db = a.deltas.get(name), b.deltas.get(name)
        deltas[name] = {s: _pair(da, db, s) for s in _DELTA_STATS}
    status_a = {c.id: c.status.value for c in a.checks}
    status_b = {c.id: c.status.value for c in b.checks}
    changed_checks = [{"id": cid, "a": status_a.get(cid, "absent"), "b": status_b.get(cid, "absent"),
                       "reason_b": next((c.reason for c in b.checks if c.id == cid), None)}
                      for cid in dict.fromkeys([*status_a, *status_b]) if status_a.get(cid) != status_b.get(cid)]
    sa, sb = _settings(a), _settings(b)
    settings = [{"key": k, "a": sa.get(k), "b": sb.get(k)} for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)]

    def moved(entries: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> bool:
        return any(p["a"] != p["b"] or p["reached"]["a"] != p["reached"]["b"]
                   for stats in entries.values() for p in stats.values())

    return {
        "identical": not (moved(comparisons) or moved(deltas) or changed_checks or settings or a.verdict != b.verdict),
        "verdict": {"a": a.verdict.value, "b": b.verdict.value},
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


def diff_blocks(d: Mapping[str, Any], path_a: str, path_b: str) -> list[Block]:
    """A receipt diff (from `diff_receipts`) as blocks."""
    v, rev = d["verdict"], d["revision"]
    verdict = f"{v['a']} → {v['b']}" if v["a"] != v["b"] else f"{v['a']} (same)"
    blocks: list[Block] = [
        Heading("lora-parity diff", 2),
        Para(f"a = {code(path_a)}, b = {code(path_b)}"),
        Bullets([
            f"verdict: **{verdict}**",
            f"revision: {code(rev['a'])}" + (f" → {code(rev['b'])}" if rev["a"] != rev["b"] else " (same)"),
            f"created: {code(d['created_at']['a'])} → {code(d['created_at']['b'])}",
            "total time: " + " → ".join(f"{t:.2f} s" if t is not None else "—" for t in d["total_seconds"].values()),
        ]),
    ]
    if d["identical"]:
        blocks.append(Para("**No differences**: same statistics, checks, verdict and settings."))
    blocks += [
        Heading("Comparisons (a → b, and b − a)"),
        Table(["comparison", "mean |diff|", "p99", "max"],
              [[name, *(_side_by_side(stats[s]) for s in _DIFF_STATS)] for name, stats in d["comparisons"].items()]),
    ]
    if d["deltas"]:
        blocks.append(Table(["update", "cosine", "scale", "rel L2"],
                            [[name, *(_side_by_side(stats[s]) for s in _DELTA_STATS)]
                             for name, stats in d["deltas"].items()]))
    blocks.append(Heading("Checks whose status changed"))
    blocks.append(Table(["check", "a", "b", "reason in b"],
                        [[c["id"], c["a"], c["b"], c["reason_b"] or "—"] for c in d["changed_checks"]])
                  if d["changed_checks"] else Para("None."))
    blocks.append(Heading("Settings and versions that differ"))
    blocks.append(Table(["setting", "a", "b"], [[s["key"], _value(s["a"]), _value(s["b"])] for s in d["settings"]])
                  if d["settings"] else Para("None."))
    return blocks


def diff_markdown(d: Mapping[str, Any], path_a: str, path_b: str) -> str:
    """A receipt diff as markdown."""
    return render_markdown(diff_blocks(d, path_a, path_b))
