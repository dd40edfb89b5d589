"""The command line: thin wiring from typer commands to library functions.

Exit codes: 0 pass; 1 fail or inconclusive; 2 bad input, an errored run, or a receipt that does
not verify.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lora_parity import output
from lora_parity.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, LoraParityError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Prove that a LoRA trainer and its inference sampler agree on logprobs, and that sync is not stale.",
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")]
RevisionOpt = Annotated[str | None, typer.Option(help="Commit under test (default: git rev-parse HEAD).")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="Config name in configs/, a YAML file, or a local HF checkpoint folder.")
]
GithubSummaryOpt = Annotated[
    bool, typer.Option("--github-summary", help="Also append the markdown report to $GITHUB_STEP_SUMMARY, if set.")
]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size of the trainer (megatron only).")]
TrainerOpt = Annotated[str, typer.Option(help="Trainer backend: hf, megatron or tinker.")]
SamplerOpt = Annotated[str, typer.Option(help="Sampler backend: vllm, hf or tinker.")]
ProbesOpt = Annotated[str, typer.Option(
    help="Probe source: random[:SET] or a set (default, held-out; SET-xN: N times the sequences), "
         "text[:SET] (shipped English text, real models only), or FILE.jsonl ({\"tokens\": [ids]} or "
         "{\"text\": ...} per line).")]
SeedOpt = Annotated[int, typer.Option(help="Run seed: LoRA A init and the perturbation.")]
SyncOpt = Annotated[str, typer.Option(help="How adapters reach the sampler: new-id, inplace, merged or memory.")]
PerTargetOpt = Annotated[bool, typer.Option("--per-target/--no-per-target", help="Per-target coverage after C.")]


def _exit_for(verdict: str) -> int:
    return EXIT_PASS if verdict == "pass" else EXIT_FAIL if verdict in ("fail", "inconclusive") else EXIT_BAD_INPUT


@app.command()
def run(
    model: ModelOpt = None,
    trainer: TrainerOpt = "hf",
    sampler: SamplerOpt = "vllm",
    probes: ProbesOpt = "default",
    out: Annotated[
        Path | None, typer.Option(help="Receipt path (default: receipts/<model>__<trainer>__<sampler>__<UTC>.json).")
    ] = None,
    revision: RevisionOpt = None,
    seed: SeedOpt = 0,
    force: Annotated[bool, typer.Option(help="Overwrite an existing receipt.")] = False,
    inject: Annotated[str | None, typer.Option(help="Inject a fault (see `lora-parity selftest`).")] = None,
    sync: SyncOpt = "new-id",
    per_target: PerTargetOpt = True,
    tinker_url: Annotated[
        str | None,
        typer.Option(help="Tinker service URL (--trainer tinker --sampler tinker); API key from TINKER_API_KEY."),
    ] = None,
    base_model: Annotated[
        str | None, typer.Option(help="Base model name on the Tinker service (default: the one it serves).")
    ] = None,
    tp: TpOpt = 1,
    reference: Annotated[
        str | None,
        typer.Option(help="'fp32': also score the base model in fp32 with HF, to show how far each side's "
                          "zero-init scores are from it (comparisons R.*, no checks)."),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16: cast a checkpoint passed by path; "
                                      "budgets follow the dtype.")
    ] = None,
    json_: JsonOpt = False,
    github_summary: GithubSummaryOpt = False,
    plan: Annotated[
        bool, typer.Option("--plan", help="Print the resources and launch commands the model needs; run nothing.")
    ] = False,
    sign: Annotated[
        Path | None, typer.Option(help="Sign the receipt with this ed25519 private key (PEM): it is written as a "
                                       "DSSE envelope (see `lora-parity keygen`).")
    ] = None,
) -> None:
    """Run base → zero-init → perturb → stale → sync → republish and write a receipt."""
    if plan:
        from lora_parity import config
        from lora_parity.plan import render

        output.out.print(render(config.load(model)), end="", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(0)
    from lora_parity.runner import RunOptions, execute

    key = _signing().load_private_key(sign) if sign is not None else None
    opts = RunOptions(model=model, trainer=trainer, sampler=sampler, probes=probes, out=out, revision=revision,
                      seed=seed, force=force, inject=inject, sync=sync, per_target=per_target,
                      command=tuple(sys.argv[1:]), tinker_url=tinker_url, base_model=base_model, tp=tp,
                      reference=reference, dtype=dtype)
    # The CLI leaves right after the receipt is written (see _exit_fast).
    result = execute(opts, progress=output.progress, process_exiting=True)
    path = _signing().sign_file(result.path, key) if key is not None else result.path
    output.result(result.receipt, str(path), json_)
    if github_summary:
        from lora_parity.report import report_markdown

        output.github_summary(report_markdown(result.receipt, str(path)))
    raise typer.Exit(_exit_for(result.receipt.verdict.value))


def _signing() -> Any:
    from lora_parity import signing

    return signing


VERIFY_HELP = (
    "Re-check a receipt: 0 intact and passing; 1 intact but not passing; 2 does not verify.\n\n"
    "Intact means internally consistent (every statistic, check and the verdict reproduce from the raw "
    "scores and budgets) and not accidentally corrupted (the sha256 digest matches); it does not prove who "
    "made the receipt: anyone can edit one and recompute the digest. For that, sign runs (run --sign KEY) "
    "and check with --public-key KEY.pub: a bad signature exits 2. Only regular files of at most 64 MiB are read."
)


@app.command(help=VERIFY_HELP)
def verify(
    path: Annotated[Path, typer.Argument(help="Receipt JSON file, or a signed envelope (run --sign).")],
    public_key: Annotated[
        Path | None, typer.Option(help="Check the envelope's ed25519 signature with this public key (PEM).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Re-check a receipt (see VERIFY_HELP)."""
    from lora_parity.verify import PROVES
    from lora_parity.verify import verify as verify_receipt

    verified = verify_receipt(path, public_key)
    verdict = verified.verdict.value
    if json_:
        output.print_json({"receipt": str(path), "intact": True, "verdict": verdict,
                           "signature": verified.signature})
    else:
        output.line(f"{path}: intact; verdict {verdict} reproduces from its raw scores; "
                    f"signature: {verified.signature}")
        output.hint(PROVES)
    raise typer.Exit(_exit_for(verdict) if verdict != "error" else EXIT_FAIL)


@app.command()
def keygen(
    path: Annotated[Path, typer.Argument(help="Private key file to write (PEM); the public key goes to PATH.pub.")],
    force: Annotated[bool, typer.Option(help="Overwrite existing key files.")] = False,
) -> None:
    """Make an ed25519 keypair for run --sign and verify --public-key (needs the `sign` extra)."""
    private, public = _signing().keygen(path, force)
    output.line(f"private key: {private} (keep it secret)\npublic key:  {public}")


@app.command()
def selftest(
    model: ModelOpt = None,
    trainer: TrainerOpt = "hf",
    sampler: SamplerOpt = "vllm",
    probes: ProbesOpt = "default",
    seed: SeedOpt = 0,
    out_dir: Annotated[Path | None, typer.Option(help="Keep every run's receipt in this folder.")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Clean runs to repeat; their scores must be bit-identical.")] = 1,
    per_target: PerTargetOpt = True,
    tp: TpOpt = 1,
    sync: SyncOpt = "new-id",
    revision: RevisionOpt = None,
    json_: JsonOpt = False,
) -> None:
    """A clean run, then every injected fault; exit 0 only if the clean run passes and every fault is caught."""
    from lora_parity.runner import RunOptions
    from lora_parity.selftest import selftest as run_selftest

    opts = RunOptions(model=model, trainer=trainer, sampler=sampler, probes=probes, seed=seed,
                      per_target=per_target, command=tuple(sys.argv[1:]), tp=tp, sync=sync, revision=revision)
    result = run_selftest(opts, out_dir, repeat=repeat, progress=None if json_ else output.quiet_progress)
    output.selftest_matrix(result, json_)
    raise typer.Exit(EXIT_PASS if result.ok else EXIT_FAIL)


@app.command()
def models(json_: JsonOpt = False) -> None:
    """The model configs, one line each."""
    from lora_parity import config

    rows = [config.config_summary(config.load(str(p))) for p in config.available()]
    if json_:
        output.print_json(rows)
        return
    for r in rows:
        output.out.print(f"{r['name']:<16} {r['source']:<12} {r['dtype']:<9} r{r['rank']} x{r['targets']} targets"
                         f"  {r['description']}", soft_wrap=True, markup=False)


@app.command()
def report(
    path: Annotated[Path, typer.Argument(help="Receipt JSON file.")],
    format_: Annotated[str, typer.Option("--format", help="md, text or json.")] = "md",
    plots: Annotated[Path | None, typer.Option(help="Write PNG plots of |diff| per position here; link them.")] = None,
    github_summary: GithubSummaryOpt = False,
) -> None:
    """A verified receipt for people: verdict, A/B/C table, comparisons, worst positions, provenance."""
    from lora_parity import report as rp
    from lora_parity.verify import verify as verify_receipt

    rp.check_format(format_, rp.REPORT_FORMATS)
    receipt = verify_receipt(path).receipt
    links: dict[str, str] = {}
    if plots is not None:
        from lora_parity.report.plots import link, write_plots

        links = {name: link(p) for name, p in write_plots(receipt, plots).items()}
    output.print_text(rp.render_report(receipt, str(path), format_, links))
    if github_summary:
        output.github_summary(rp.report_markdown(receipt, str(path), links))


@app.command()
def table(
    paths: Annotated[list[Path], typer.Argument(help="Receipt JSON files, one row each.")],
    format_: Annotated[str, typer.Option("--format", help="md (for a README or PR) or rich (a terminal).")] = "md",
) -> None:
    """The evidence table: mean |diff| of A, B and C and the result, one row per verified receipt."""
    from lora_parity import report as rp
    from lora_parity.verify import verify as verify_receipt

    rp.check_format(format_, rp.TABLE_FORMATS)
    receipts = [verify_receipt(p).receipt for p in paths]
    if format_ == "rich":
        output.evidence_table(rp.table_header(receipts), [rp.evidence_row(r).cells() for r in receipts])
    else:
        output.print_text(rp.table_markdown(receipts))


@app.command()
def schema() -> None:
    """The receipt's JSON Schema, generated from the receipt models (committed as receipts/schema.json)."""
    from lora_parity.report import schema_json

    output.print_text(schema_json())


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="Receipt before (e.g. before a fix).")],
    b: Annotated[Path, typer.Argument(help="Receipt after.")],
    json_: JsonOpt = False,
) -> None:
    """How two verified receipts differ: statistics side by side, checks that changed, settings."""
    from lora_parity import report as rp
    from lora_parity.verify import verify as verify_receipt

    d = rp.diff_receipts(verify_receipt(a).receipt, verify_receipt(b).receipt)
    if json_:
        output.print_json(d)
    else:
        output.print_text(rp.diff_markdown(d, str(a), str(b)))


def _exit_fast(code: int) -> None:
    """After a run, torch's and vLLM's interpreter teardown takes seconds (about 2.7 s of a 20 s run on
    the CPU default) and does nothing lora-parity needs: the receipt is already fsynced. Flush and
    leave. Commands that loaded neither library exit normally."""
    if "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    """Entry point: known errors become one line and exit code 2."""
    try:
        app()
    except SystemExit as e:
        _exit_fast(e.code if isinstance(e.code, int) else EXIT_BAD_INPUT if e.code else EXIT_PASS)
        raise
    except LoraParityError as e:
        output.error(str(e))
        sys.exit(EXIT_BAD_INPUT)
    except Exception as e:
        if os.environ.get("LORA_PARITY_DEBUG"):
            raise
        output.error(f"unexpected {type(e).__name__}: {e} (LORA_PARITY_DEBUG=1 shows the traceback)")
        sys.exit(EXIT_BAD_INPUT)
