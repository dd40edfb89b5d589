"""`lora-parity locate RECEIPT`: where in the base forward trainer and engine part (docs/locate.md).

Exit codes: 0 neither side leaves what its precision explains at any point; 1 a side does (the layer and module
named); 2 bad input (a receipt that does not verify, a run that cannot be repeated here, an output that exists
without --force), one line on stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lora_parity.cli import live, output
from lora_parity.cli.commands.options import JsonOpt, ModelOpt, PublicKeyOpt
from lora_parity.util import escape as esc
from lora_parity.util.errors import EXIT_FAIL, EXIT_PASS, ConfigError, ReceiptExistsError

LOCATE_HELP = (
    "Where in the base forward trainer and engine part: the first layer and module where a side's hidden states "
    "leave what its precision explains.\n\n"
    "At the receipt's start point (the base model, where A is judged), A's worst sequences (by |zero - trainer_zero| "
    "in the receipt's raw scores) go through the fp32 reference (HF in fp32), the trainer (HF + PEFT) and the engine "
    "(the in-process vLLM model, hooked); an fp32 checkpoint also through HF in fp64. Each side's distance from the "
    "fp32 reference after every module is judged against what the same precision explains there, measured in this "
    "run (the other side, fp32 against fp64): docs/locate.md. The receipt is verified first and is data: the model is "
    "a shipped config it names or your --model, a probe file your --probes.\n\n"
    "Writes RECEIPT's name with .locate.json (or --out), never over a file without --force. Exit 0: no side leaves; "
    "1: a side leaves (named); 2: bad input, or the run cannot be repeated here."
)


def default_out(receipt: Path) -> Path:
    """`NAME.locate.json` beside the receipt `NAME.json`."""
    return receipt.with_name(f"{receipt.stem}.locate.json" if receipt.suffix == ".json" else f"{receipt.name}.locate"
                             ".json")


def locate(
    ctx: typer.Context,
    receipt: Annotated[Path, typer.Argument(help="Receipt JSON file (or signed envelope).")],
    sequences: Annotated[int, typer.Option(min=1, max=64, help="How many of A's worst sequences to compare.")] = 2,
    out: Annotated[Path | None, typer.Option(help="Result path (default: the receipt's name with .locate.json).")]
    = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing result.")] = False,
    model: ModelOpt = None,
    probes: Annotated[str | None, typer.Option(help="The probe file of a run whose probes were a file.")] = None,
    public_key: PublicKeyOpt = None,
    inject: Annotated[str | None, typer.Option(
        help="Plant a divergence to see the report fire: engine-norm@K scales layer K's input_layernorm weight by "
             "1.01 in the engine's copy only (engine-norm@KxF by F, 1 < F <= 2).")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the markdown section instead of the table.")]
    = False,
    plot: Annotated[Path | None, typer.Option(
        help="Draw each side's distance from fp32 per point (log scale) into DIR as RECEIPT-NAME.locate.png "
             "(never over a file without --force).")] = None,
    json_: JsonOpt = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the engines' own output.")] = False,
) -> None:
    """See LOCATE_HELP."""
    from lora_parity.cli.commands.receipts import command_parser
    from lora_parity.cli.rerun import VerifierInputs, plan_for
    from lora_parity.evidence.receipt_io import check_replaceable
    from lora_parity.run.locate import LocateOptions, planted_layer
    from lora_parity.run.locate import locate as run_locate
    from lora_parity.util import scratch
    from lora_parity.verdict.verify import verify as verify_receipt

    target = out or default_out(receipt)
    planted_layer(inject)  # bad input is refused before anything loads
    png = _plot_path(plot, receipt, force)
    if target.exists() and not force:
        raise ReceiptExistsError(f"{target} exists; pass --force to overwrite it")
    check_replaceable(target)
    verified = verify_receipt(receipt, public_key)
    try:
        parse = command_parser(ctx.find_root().command)
        _, plan = plan_for(verified.receipt, parse, VerifierInputs(model, None, probes))
        session = live.Session(live.mode_of(verbose, json_), f"lora-parity locate: {plan.cfg.name}")
        with session:
            result = run_locate(plan, verified.receipt, LocateOptions(sequences, inject), progress=session.progress)
    finally:
        scratch.remove_all()
    written = _write(result, target, force)
    drawn = _draw(result, png)
    _show(result, str(receipt), written, json_, markdown, drawn)
    raise typer.Exit(EXIT_FAIL if result.divergences else EXIT_PASS)


def _plot_path(directory: Path | None, receipt: Path, force: bool) -> Path | None:
    """Where `--plot DIR` draws, checked before anything runs: matplotlib present, no file there without --force,
    nothing but a regular file (never a link)."""
    if directory is None:
        return None
    from lora_parity.report.locate_plot import file_name
    from lora_parity.report.plots import _matplotlib
    from lora_parity.util.safe_write import check_replaceable

    _matplotlib()
    path = directory / file_name(receipt)
    if (path.exists() or path.is_symlink()) and not force:
        raise ReceiptExistsError(f"{path} exists; pass --force to overwrite it")
    check_replaceable(path)
    return path


def _draw(result: Any, path: Path | None) -> Path | None:
    if path is None:
        return None
    from lora_parity.report.locate_plot import draw

    return draw(result, path)


def _write(result: Any, target: Path, force: bool) -> Path:
    from lora_parity.evidence.receipt_io import write_text_atomic

    try:
        return write_text_atomic(result.model_dump_json(indent=2) + "\n", target, force=force)
    except ReceiptExistsError as e:  # appeared while locate ran
        raise ConfigError(str(e)) from None


def _show(result: Any, receipt: str, written: Path, as_json: bool, as_markdown: bool, plot: Path | None) -> None:
    from lora_parity.report import locate as render
    from lora_parity.report.plots import link

    if as_json:
        output.print_json({"receipt": receipt, "result": str(written), "named": bool(result.divergences),
                           "plot": str(plot) if plot is not None else None,
                           "divergences": [d.model_dump() for d in result.divergences],
                           "routing": render.moe_headline(result), "seconds": result.timings.get("total")})
        return
    if as_markdown:
        output.print_text(render.markdown(result, receipt, link(plot) if plot is not None else None))
    else:
        from rich.table import Table

        table = Table(title=esc.rich(f"{result.model} ({result.dtype}): distance from the fp32 reference per point"))
        for h in render.HEADERS:
            table.add_column(h, justify="left" if h in ("point", "module", "leaves") else "right")
        for row in render.rows(result):
            style = "red" if row[-1] else ""
            table.add_row(*(esc.rich(c) for c in row), style=style)
        output.out.print(table)
        output.line(render.headline(result))
        for line in render.moe_lines(result):
            output.line(line)
    output.line(f"locate: {'a layer named' if result.divergences else 'no layer named'} in "
                f"{result.timings.get('total', 0.0):.1f} s · result {written}" + (f" · plot {plot}" if plot else ""))
