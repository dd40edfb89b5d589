"""The command line: thin wiring from typer commands to library functions. `run`, `selftest` and
`keygen` are here; the commands that read receipts and model configs are in `lora_parity.cli.commands`.

Exit codes: 0 pass; 1 fail or inconclusive; 2 bad input, an errored run, or a receipt that does
not verify.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from lora_parity import __version__
from lora_parity.cli import live, output
from lora_parity.cli.commands import locate as locate_cmd
from lora_parity.cli.commands import models as models_cmd
from lora_parity.cli.commands import receipts as receipts_cmd
from lora_parity.cli.commands.options import (
    AdapterOpt,
    ApiKeyEnvOpt,
    BatchInvariantOpt,
    BudgetsOpt,
    EngineArgOpt,
    ExactReferenceOpt,
    GithubSummaryOpt,
    JsonOpt,
    LoopOpt,
    ModelOpt,
    PerLayerOpt,
    PerTargetOpt,
    ProbesOpt,
    ReferenceOpt,
    RevisionOpt,
    RouteReplayOpt,
    SamplerOpt,
    SamplerUrlOpt,
    SamplingOpt,
    SeedOpt,
    SharedDirOpt,
    SleepLevelsOpt,
    SyncOpt,
    TpOpt,
    TrainerOpt,
    TrustRemoteCodeOpt,
    UpdateOpt,
    exit_for,
)
from lora_parity.util import lean
from lora_parity.util.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, LoraParityError

PROG = "lora-parity"
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show the engines' own output and every phase.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the closing verdict line.")]
app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Prove that a LoRA trainer and its inference sampler agree on logprobs, and that sync is not stale.",
)


def _version(value: bool) -> None:
    if value:
        output.line(f"{PROG} {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Prove that a LoRA trainer and its inference sampler agree on logprobs, and that sync is not stale."""


@app.command()
def run(
    ctx: typer.Context,
    model: ModelOpt = None,
    trainer: TrainerOpt = "hf",
    sampler: SamplerOpt = "vllm",
    probes: ProbesOpt = "default",
    out: Annotated[
        Path | None,
        typer.Option(help="Receipt path (default: lora-parity-receipts/<model>__<trainer>__<sampler>__<UTC>.json)."),
    ] = None,
    revision: RevisionOpt = None,
    seed: SeedOpt = 0,
    force: Annotated[bool, typer.Option(help="Overwrite an existing receipt.")] = False,
    inject: Annotated[str | None, typer.Option(help="Inject a fault (see `lora-parity selftest`).")] = None,
    sync: SyncOpt = "new-id",
    update: UpdateOpt = None,
    per_target: PerTargetOpt = None,
    route_replay: RouteReplayOpt = None,
    per_layer: PerLayerOpt = True,
    tinker_url: Annotated[
        str | None,
        typer.Option(help="Tinker service URL (--trainer tinker --sampler tinker); API key from TINKER_API_KEY."),
    ] = None,
    base_model: Annotated[
        str | None, typer.Option(help="Base model name on the Tinker service (default: the one it serves).")
    ] = None,
    tp: TpOpt = 1,
    reference: ReferenceOpt = None,
    exact_reference: ExactReferenceOpt = True,
    batch_invariant: BatchInvariantOpt = True,
    engine_arg: EngineArgOpt = None,
    sleep_levels: SleepLevelsOpt = None,
    sampling: SamplingOpt = None,
    loop: LoopOpt = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16: cast a checkpoint passed by path; "
                                      "budgets follow the dtype.")
    ] = None,
    budgets: BudgetsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    sampler_url: SamplerUrlOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    shared_dir: SharedDirOpt = None,
    adapter: AdapterOpt = None,
    json_: JsonOpt = False,
    github_summary: GithubSummaryOpt = False,
    junit: Annotated[
        Path | None, typer.Option(help="Also write the checks as a JUnit XML report here (one test case per check).")
    ] = None,
    plan: Annotated[
        bool, typer.Option("--plan", help="Print the resources and launch commands the model needs; run nothing.")
    ] = False,
    sign: Annotated[
        Path | None, typer.Option(help="Sign the receipt with this ed25519 private key (PEM): it is written as a "
                                       "DSSE envelope (see `lora-parity keygen`).")
    ] = None,
    stack: Annotated[
        str | None, typer.Option(help="An RL framework checked through its own sync and engine (trl, or an installed "
                                      "plugin's): it runs inside your training script; says what it needs.")
    ] = None,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run base → zero-init → perturb → stale → sync → republish and write a receipt."""
    if stack is not None:
        from lora_parity.stacks import refuse_cli

        refuse_cli(stack)
    if plan:
        _print_plan(ctx, model, trainer, sampler, tp)
    from lora_parity.run.options import RunOptions

    if junit is not None:
        from lora_parity.cli.junit import check_target

        check_target(junit)

    key = _signing().load_private_key(sign) if sign is not None else None
    opts = RunOptions(model=model, trainer=trainer, sampler=sampler, probes=probes, out=out, revision=revision,
                      seed=seed, force=force, inject=inject, sync=sync, update=update, per_target=per_target,
                      per_layer=per_layer, route_replay=route_replay,
                      command=tuple(sys.argv[1:]), tinker_url=tinker_url, base_model=base_model, tp=tp,
                      reference=reference, exact_reference=exact_reference, dtype=dtype, budgets=budgets,
                      trust_remote_code=trust_remote_code, sampler_url=sampler_url, api_key_env=api_key_env,
                      shared_dir=shared_dir, batch_invariant=batch_invariant, adapter=adapter,
                      engine_args=tuple(engine_arg or ()), sleep_levels=sleep_levels,
                      sampling=tuple(sampling or ()), loop=tuple(loop or ()))
    start = time.perf_counter()
    lean.skip_unused_imports(opts.trainer, opts.sampler)
    lean.pause_collector()  # until the backends have started
    session = live.Session(live.mode_of(verbose, quiet or json_), live.describe(opts), phase_lines=True)
    # The CLI leaves right after the receipt is written (see _exit_fast).
    result = _execute_interruptible(opts, session)
    if out is not None and result.path != out:  # said while the engines' output went to the log: said again
        why = "appeared during the run and was left as it is" if out.exists() else "could not be written"
        output.hint(f"--out {out} {why}; the receipt was written to {result.path}")
    path = _signing().sign_file(result.path, key) if key is not None else result.path
    # Signed here with this key: as `verify --public-key` of the matching public key would say.
    signature = f"valid (keyid {_signing().keyid(key.public_key())[:16]})" if key is not None else None
    log = session.keep_log(Path(path))
    output.result(result.receipt, str(path), json_, time.perf_counter() - start, str(log) if log else None,
                  quiet=quiet)
    if junit is not None:
        from lora_parity.cli.junit import write_junit

        write_junit(result.receipt, str(path), junit, signature)
    if github_summary:
        from lora_parity.report import report_markdown

        output.github_summary(report_markdown(result.receipt, str(path), signature=signature))
    raise typer.Exit(exit_for(result.receipt.verdict.value))


def _execute_interruptible(opts: Any, session: Any) -> Any:
    """`execute`, with SIGINT and SIGTERM ending the run the same way: a receipt (verdict error), one
    line naming it, the work dir removed, child processes ended, exit code 128 + the signal."""
    from lora_parity.run.runner import RunInterrupted, execute
    from lora_parity.util import interrupt

    with interrupt.handle_signals():
        try:
            with session:  # left (output restored) before an interrupt is reported below
                return execute(opts, progress=session.progress, process_exiting=True)
        except RunInterrupted as e:
            log = session.keep_log(Path(e.result.path))  # beside the receipt: nothing left in the temp dir
            output.error(f"{e}; receipt {e.result.path} (verdict error, `lora-parity verify` exits 1 on it)"
                         + (f"; third-party logs {log}" if log else ""))
        except KeyboardInterrupt as e:  # before the run started: nothing loaded, nothing written
            if session.log is not None:
                session.log.unlink(missing_ok=True)
            output.error(f"{interrupt.describe(e)} before the run started; no receipt")
    raise typer.Exit(interrupt.exit_code())


def _print_plan(ctx: typer.Context, model: str | None, trainer: str, sampler: str, tp: int) -> None:
    """`run --plan`: the plan with --model as given, and --trainer / --sampler / --tp where the user gave them."""
    from lora_parity.models import config
    from lora_parity.run.plan import render

    def given(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name != "DEFAULT"

    text = render(config.load(model), model, trainer if given("trainer") else None, tp if given("tp") else None,
                  sampler if given("sampler") else None)
    output.print_text(text)
    raise typer.Exit(0)


def _signing() -> Any:
    from lora_parity.evidence import signing

    return signing


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
    seeds: Annotated[int, typer.Option(
        min=1, max=1000, help="Run the clean run and every fault once per seed (run seed --seed + i, the probes "
                              "drawn again, on one load of the engines); print the false-alarm rate and per fault "
                              "caught k of N with the closest margin; receipts in OUT_DIR/seed-NN/.")] = 1,
    first_seed: Annotated[int, typer.Option(
        min=0, max=1_000_000, help="Start at seed index K (seeds K .. K+N-1 of a longer selftest), to split one "
                                   "over several processes or machines; receipts in OUT_DIR/seed-NN/.")] = 0,
    faults: Annotated[str | None, typer.Option(
        help="Only these of the applicable faults, comma-separated (the clean run always runs): to fill in "
             "the runs a split selftest did not reach; `none` runs only the clean runs.")] = None,
    per_target: PerTargetOpt = None,
    route_replay: RouteReplayOpt = None,
    exact_reference: ExactReferenceOpt = True,
    engine_arg: EngineArgOpt = None,
    sleep_levels: SleepLevelsOpt = None,
    sampling: SamplingOpt = None,
    loop: LoopOpt = None,
    tp: TpOpt = 1,
    sync: SyncOpt = "new-id",
    update: UpdateOpt = None,
    revision: RevisionOpt = None,
    budgets: BudgetsOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    sampler_url: SamplerUrlOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    shared_dir: SharedDirOpt = None,
    adapter: AdapterOpt = None,
    json_: JsonOpt = False,
    verbose: VerboseOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """A clean run, then every injected fault (per seed with --seeds N); exit 0 only if every clean run passes
    and every fault is caught in every seed."""
    from lora_parity.run.options import RunOptions
    from lora_parity.run.selftest import selftest as run_selftest

    opts = RunOptions(model=model, trainer=trainer, sampler=sampler, probes=probes, seed=seed,
                      per_target=per_target, exact_reference=exact_reference, command=tuple(sys.argv[1:]), tp=tp,
                      sync=sync, update=update, route_replay=route_replay,
                      revision=revision, budgets=budgets,
                      trust_remote_code=trust_remote_code, sampler_url=sampler_url, api_key_env=api_key_env,
                      shared_dir=shared_dir, adapter=adapter, engine_args=tuple(engine_arg or ()),
                      sleep_levels=sleep_levels, sampling=tuple(sampling or ()), loop=tuple(loop or ()))
    from lora_parity.run.runner import RunInterrupted
    from lora_parity.util import interrupt

    start = time.perf_counter()
    lean.skip_unused_imports(opts.trainer, opts.sampler)
    lean.pause_collector()  # until the backends have started
    what = f"selftest over {seeds} seeds" if seeds > 1 or first_seed else "selftest"
    session = live.Session(live.mode_of(verbose, quiet or json_), live.describe(opts, what))
    with interrupt.handle_signals():
        try:
            with session:
                result = run_selftest(opts, out_dir, repeat=repeat, progress=session.progress,
                                      watch=output.selftest_watcher(session, seeds), seeds=seeds,
                                      first_seed=first_seed,
                                      only=tuple(f.strip() for f in (faults or "").split(",") if f.strip()))
        except RunInterrupted as e:
            output.error(f"selftest {e}; receipt of the interrupted run: {e.result.path}")
            raise typer.Exit(interrupt.exit_code()) from None
        except KeyboardInterrupt as e:
            output.error(f"selftest {interrupt.describe(e)}")
            raise typer.Exit(interrupt.exit_code()) from None
    log = session.keep_log(out_dir)
    output.selftest_summary(result, json_, time.perf_counter() - start, str(log) if log else None)
    raise typer.Exit(EXIT_PASS if result.ok else EXIT_FAIL)


app.command(help=receipts_cmd.VERIFY_HELP)(receipts_cmd.verify)
app.command(help=receipts_cmd.REPORT_HELP)(receipts_cmd.report)
app.command(help=locate_cmd.LOCATE_HELP)(locate_cmd.locate)
app.command()(receipts_cmd.table)
app.command()(receipts_cmd.diff)
app.command()(receipts_cmd.schema)
app.command()(models_cmd.models)
app.command()(models_cmd.init)


def _exit_fast(code: int) -> None:
    """After a run, torch's and vLLM's interpreter teardown takes seconds (about 2.7 s of a 20 s run on
    the CPU default) and does nothing lora-parity needs: the receipt is already fsynced. Flush and
    leave. Commands that loaded neither library exit normally."""
    if "torch" in sys.modules:
        servers = sys.modules.get("lora_parity.backends.server_process")
        if servers is not None:  # its exit hook would stop a server left running; os._exit skips exit hooks
            servers.stop_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    """Entry point: known errors become one line and exit code 2."""
    try:
        app(prog_name=PROG)
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
