"""Commands that read receipts: verify, report, table, diff and schema.

Every receipt is verified before it is used. `verify` and `table` take many files (a shell glob such
as `receipts/*.json`): a file that is valid JSON but plainly not a receipt (the committed
`schema.json`, say) is skipped with a note on stderr; a receipt that does not verify is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lora_parity.cli import output
from lora_parity.cli.commands.options import GithubSummaryOpt, JsonOpt, PublicKeyOpt, exit_for
from lora_parity.util.errors import EXIT_BAD_INPUT, EXIT_FAIL, ConfigError, LoraParityError, ReceiptError

# A receipt (or a signed envelope) has at least one of these at its top level.
_RECEIPT_KEYS = frozenset({"schema_version", "digest", "verdict", "scores", "checks", "payloadType", "payload"})


def _not_a_receipt(path: Path) -> str | None:
    """Why `path` is plainly not a receipt (valid JSON without any receipt field), or None. Anything
    unreadable or malformed is left for `verify` to refuse with its own message."""
    from lora_parity.evidence.receipt_io import parse_json, read_bounded

    try:
        _, data = parse_json(read_bounded(path), str(path))
    except LoraParityError:
        return None
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not a receipt"
    if _RECEIPT_KEYS & data.keys():
        return None
    return "a JSON Schema, not a receipt" if "$schema" in data or "properties" in data else "not a receipt"


def receipt_paths(paths: list[Path]) -> list[Path]:
    """`paths` without the files that are plainly not receipts (a note on stderr for each);
    `ReceiptError` if none is left."""
    kept = []
    for path in paths:
        why = _not_a_receipt(path)
        if why is None:
            kept.append(path)
        else:
            output.hint(f"skipped {path}: {why}")
    if not kept:
        raise ReceiptError(f"no receipt among the {len(paths)} file(s) given")
    return kept


VERIFY_HELP = (
    "Re-check receipts: 0 intact and passing; 1 intact but not passing; 2 does not verify (with many "
    "files, the worst of them).\n\n"
    "Intact means internally consistent (every statistic, check and the verdict reproduce from the raw "
    "scores and budgets) and not accidentally corrupted (the sha256 digest matches); it does not prove who "
    "made the receipt: anyone can edit one and recompute the digest. For that, sign runs (run --sign KEY) "
    "and check with --public-key KEY.pub: a bad signature exits 2. Only regular files of at most 64 MiB are "
    "read. Files that are plainly not receipts (receipts/schema.json) are skipped with a note on stderr.\n\n"
    "--rerun also re-executes the run the receipt describes (its config, probes, seed, backends, sync mode "
    "and injected fault, with the current working tree, which it says is or is not the recorded revision) "
    "and compares the raw scores: bit for bit on the CPU in fp32, within the receipt's own recorded repeat "
    "noise elsewhere. That proves this code and machine produce the receipt's scores again, which makes the "
    "receipt evidence rather than a claim: 0 they match and the verdict is pass; 1 they differ (the first phase "
    "and position named) or the verdict is not pass; 2 the run cannot be repeated here (a changed config or "
    "probe set, a missing backend). A receipt is data: the rerun takes no trust flag, URL, credential or path "
    "from it. A run on anything but a shipped config needs your --model, a tinker run your --tinker-url, a "
    "run on a probe file your --probes."
)


def _verify_one(path: Path, public_key: Path | None, json_: bool) -> tuple[int, dict[str, Any]]:
    from lora_parity.verdict.verify import verify as verify_receipt

    verified = verify_receipt(path, public_key)
    verdict = verified.verdict.value
    if not json_:
        output.line(f"{path}: intact; verdict {verdict} reproduces from its raw scores; "
                    f"signature: {verified.signature}")
    code = exit_for(verdict) if verdict != "error" else EXIT_FAIL
    return code, {"receipt": str(path), "intact": True, "verdict": verdict, "signature": verified.signature}


def verify(
    ctx: typer.Context,
    paths: Annotated[list[Path], typer.Argument(help="Receipt JSON files, or signed envelopes (run --sign).")],
    public_key: PublicKeyOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="A JSON object on stdout (a list of them for many "
                                                       "files).")] = False,
    rerun: Annotated[bool, typer.Option("--rerun", help="Also re-execute the run the receipt describes and "
                                                         "compare the scores (one receipt; see below).")] = False,
    model: Annotated[str | None, typer.Option(help="With --rerun: the model to rerun on (a receipt never names a "
                                                   "path to load; needed unless it ran a shipped config).")] = None,
    tinker_url: Annotated[str | None, typer.Option(help="With --rerun: the Tinker service to rerun a tinker run on "
                                                        "(a receipt never names a URL to contact).")] = None,
    probes: Annotated[str | None, typer.Option(help="With --rerun: the probe file of a run whose probes were a "
                                                    "file.")] = None,
) -> None:
    """Re-check receipts (see VERIFY_HELP)."""
    from lora_parity.verdict.verify import PROVES

    if rerun:
        from lora_parity.cli.rerun import VerifierInputs

        _verify_rerun(paths, public_key, command_parser(ctx.find_root().command),
                      VerifierInputs(model, tinker_url, probes))
    if model is not None or tinker_url is not None or probes is not None:
        raise ConfigError("--model, --tinker-url and --probes go with --rerun")
    if len(paths) == 1:  # one file: its error is the one line, as ever
        code, data = _verify_one(paths[0], public_key, json_)
        results: Any = data
    else:
        codes, results = [], []
        for path in receipt_paths(paths):
            try:
                code, data = _verify_one(path, public_key, json_)
            except Exception as e:  # one receipt's fault never hides the others' results
                why = str(e) if isinstance(e, LoraParityError) else f"{path}: unexpected {type(e).__name__}"
                output.error(why)
                code, data = EXIT_BAD_INPUT, {"receipt": str(path), "intact": False, "error": why}
            codes.append(code)
            results.append(data)
        code = max(codes)
    if json_:
        output.print_json(results)
    else:
        output.hint(PROVES)
    raise typer.Exit(code)


def command_parser(group: Any) -> Any:
    """The parser `rerun` reads a recorded command line with (`rerun.ParseCommand`): the `run` and
    `selftest` commands of `group`, the CLI's own click group (the running command's root: no
    import of the CLI's app here)."""

    def parse(name: str, args: list[str]) -> dict[str, Any]:
        command = group.commands.get(name)
        if command is None:
            raise ConfigError(f"no command {name!r}")
        return dict(command.make_context(name, args, resilient_parsing=True).params)

    return parse


def _verify_rerun(paths: list[Path], public_key: Path | None, parse: Any, mine: Any) -> None:
    """verify --rerun: the receipt must verify; then its run is repeated. One line; exit 0, 1 or 2."""
    from lora_parity.cli.rerun import rerun
    from lora_parity.verdict.verify import verify as verify_receipt

    if len(paths) != 1:
        raise ConfigError("--rerun takes one receipt")
    result = rerun(verify_receipt(paths[0], public_key).receipt, parse, mine, progress=output.progress)
    line = f"{paths[0]}: {result.message}; ran {result.revision}"
    if result.code == EXIT_BAD_INPUT:
        output.error(line)
    else:
        output.line(line)
    raise typer.Exit(result.code)


REPORT_HELP = (
    "A verified receipt for people: verdict (sync and numerics), who signed it, the A/B/C table with the "
    "thresholds that decided, failing checks and why, comparisons, worst positions, the error breakdown, "
    "provenance.\n\n"
    "--out DIR writes DIR/report.md (or .txt, .json, .html) with its PNG plots beside it, linked relative "
    "to the report; --format html is one self-contained page with the plots inline."
)


def report(
    path: Annotated[Path, typer.Argument(help="Receipt JSON file.")],
    format_: Annotated[str, typer.Option("--format", help="md, text, json or html.")] = "md",
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the report and its plots into this folder.")
    ] = None,
    plots: Annotated[
        Path | None, typer.Option(help="Without --out: write PNG plots here; link them relative to the "
                                       "working directory.")
    ] = None,
    github_summary: GithubSummaryOpt = False,
    public_key: PublicKeyOpt = None,
) -> None:
    """See REPORT_HELP."""
    from lora_parity import report as rp
    from lora_parity.verdict.verify import verify as verify_receipt

    rp.check_format(format_, rp.REPORT_FORMATS)
    if out is not None and plots is not None:
        raise ConfigError("--out writes the plots beside the report; drop --plots")
    verified = verify_receipt(path, public_key)
    receipt, signature = verified.receipt, verified.signature
    if out is not None:
        from lora_parity.report.files import write_report

        written = write_report(receipt, str(path), out, format_, signature)
        output.line(str(written))
        links = {name: f"{name}.png" for name in _plotted(receipt)} if format_ != "html" else {}
    else:
        links = _plot_links(receipt, plots, format_)
        output.print_text(rp.render_report(receipt, str(path), format_, links, signature))
    if github_summary:
        output.github_summary(rp.report_markdown(receipt, str(path), links if format_ != "html" else None,
                                                 signature))


def _plotted(receipt: Any) -> list[str]:
    from lora_parity.report.plots import PLOTTED

    return [name for name in PLOTTED if name in receipt.comparisons]


def _plot_links(receipt: Any, plots: Path | None, format_: str) -> dict[str, str]:
    if format_ == "html":
        from lora_parity.report.files import inline_plots

        return inline_plots(receipt)
    if plots is None:
        return {}
    from lora_parity.report.plots import link, write_plots

    return {name: link(p) for name, p in write_plots(receipt, plots).items()}


def table(
    paths: Annotated[list[Path], typer.Argument(help="Receipt JSON files, one row each (non-receipts are "
                                                     "skipped with a note).")],
    format_: Annotated[str, typer.Option("--format", help="md (for a README or PR) or rich (a terminal).")] = "md",
    public_key: PublicKeyOpt = None,
) -> None:
    """The evidence table: mean |diff| of A, B and C and the result, one row per verified receipt; below
    it, which receipts are signed."""
    from lora_parity import report as rp
    from lora_parity.verdict.verify import verify as verify_receipt

    rp.check_format(format_, rp.TABLE_FORMATS)
    kept = receipt_paths(paths)
    verified = [verify_receipt(p, public_key) for p in kept]
    receipts = [v.receipt for v in verified]
    signatures = rp.signatures_line([str(p) for p in kept], [v.signature for v in verified])
    if format_ == "rich":
        output.evidence_table(rp.table_header(receipts), rp.table_rows(receipts))
        output.line(signatures)
    else:
        output.print_text(rp.table_markdown(receipts, signatures))


def schema() -> None:
    """The receipt's JSON Schema, generated from the receipt models (committed as receipts/schema.json)."""
    from lora_parity.report import schema_json

    output.print_text(schema_json())


def diff(
    a: Annotated[Path, typer.Argument(help="Receipt before (e.g. before a fix).")],
    b: Annotated[Path, typer.Argument(help="Receipt after.")],
    json_: JsonOpt = False,
    public_key: PublicKeyOpt = None,
) -> None:
    """How two verified receipts differ: statistics side by side, checks that changed, settings, signatures."""
    from lora_parity import report as rp
    from lora_parity.verdict.verify import verify as verify_receipt

    va, vb = verify_receipt(a, public_key), verify_receipt(b, public_key)
    d = rp.diff_receipts(va.receipt, vb.receipt, (va.signature, vb.signature))
    if json_:
        output.print_json(d)
    else:
        output.print_text(rp.diff_markdown(d, str(a), str(b)))
