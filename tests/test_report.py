"""Receipts people read: report, plots, evidence table, JSON Schema, diff, GitHub job summary.

Goldens live in tests/golden/; after a deliberate change, regenerate them with
`LORA_PARITY_UPDATE_GOLDEN=1 pytest tests/test_report.py` and review the diff.
"""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from lora_parity import report as rp
from lora_parity.evidence.receipt import Receipt, compute_digest
from lora_parity.report.plots import PLOTTED, write_plots
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict.verify import verify

from .conftest import ROOT

pytestmark = pytest.mark.unit
GOLDEN = Path(__file__).parent / "golden"
SCHEMA = ROOT / "receipts" / "schema.json"
COMMITTED = sorted(p for p in (ROOT / "receipts").glob("*.json") if p.name != "schema.json")
# The golden report and table are of one fixed committed receipt, so that receipts committed later
# do not change them.
TINY = sorted((ROOT / "receipts").glob("tiny-qwen3__hf__vllm__*.json"))[0]
TINY_ARG = str(TINY.relative_to(ROOT))
FAULTS = ("skip-sync", "frozen-trainer", "crash-at=perturb", "one-token")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("LORA_PARITY_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.read_text(encoding="utf-8") == text, (
        f"{path.name} differs from the golden; if intended: LORA_PARITY_UPDATE_GOLDEN=1 pytest {__file__}")


@pytest.fixture(scope="module")
def fake_receipts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A clean fake run and one fake run per fault: pass, fail C, inconclusive, error, fail A."""
    root = tmp_path_factory.mktemp("receipts")
    out = {}
    for fault in (None, *FAULTS):
        name = fault or "clean"
        out[name] = execute(RunOptions(trainer="fake", sampler="fake", inject=fault, out=root / f"{name}.json",
                                       revision="f00d")).path
    return out


def load(path: Path) -> Receipt:
    return verify(path).receipt


def env_without_summary(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    return {**env, **extra}


def run_cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lora_parity", *args], capture_output=True, text=True, cwd=cwd,
                          env=env if env is not None else env_without_summary(), encoding="utf-8", timeout=300)


# --- report ------------------------------------------------------------------------------------------------


def test_report_markdown_of_the_committed_receipt_matches_the_golden() -> None:
    res = run_cli("report", TINY_ARG)
    assert res.returncode == 0, res.stderr
    check_golden("report-tiny-qwen3.md", res.stdout)
    assert str(ROOT) not in res.stdout, "the report must not carry machine-specific paths"
    assert res.stdout.startswith("## lora-parity: tiny-qwen3, hf trainer vs vllm sampler\n\n**Verdict: PASS**")


def test_report_names_worst_positions_with_the_scored_token() -> None:
    receipt = load(TINY)
    worst = rp.worst_diffs(receipt, "A.trainer_vs_sampler")
    cmp = receipt.comparisons["A.trainer_vs_sampler"]
    top = worst[0]
    assert [top.sequence, top.position] == cmp.argmax
    assert abs(top.diff) == cmp.max_abs
    # Position t scores token t + 1: the token id is the one after the position.
    assert top.token_id == receipt.probes.sequences[top.sequence][top.position + 1]
    s, t = top.sequence, top.position
    assert top.diff == receipt.scores[cmp.b][s][t] - receipt.scores[cmp.a][s][t]
    assert [abs(p.diff) for p in worst] == sorted((abs(p.diff) for p in worst), reverse=True)
    md = rp.report_markdown(receipt, "r.json")
    assert f"s{top.sequence} t{top.position} tok {top.token_id}: {rp.fmt_signed(top.diff)}" in md


def test_report_finds_the_one_token_fault_position(fake_receipts: dict[str, Path]) -> None:
    receipt = load(fake_receipts["one-token"])
    (top,) = rp.worst_diffs(receipt, "A.trainer_vs_sampler", k=1)
    # faults.py shifts the sampler's logprob at sequence 0, position 3 down.
    assert (top.sequence, top.position) == (0, 3) and top.diff > 0
    assert top.token_id == receipt.probes.sequences[0][4]
    assert rp.worst_diffs(load(fake_receipts["clean"]), "A.trainer_vs_sampler") == []  # exactly equal


def test_report_lists_the_receipts_worst_positions(fake_receipts: dict[str, Path]) -> None:
    receipt = load(fake_receipts["skip-sync"])
    name = "C.trainer_vs_sampler"
    assert receipt.worst_positions is not None
    recorded = receipt.worst_positions[name]
    assert len(recorded) > rp.NUM_WORST and all(w.abs_diff > 0 for w in recorded)
    cmp = receipt.comparisons[name]

    def listed(r: Receipt) -> list[tuple[int, int, int, float]]:
        return [(p.sequence, p.position, p.token_id, p.diff) for p in rp.worst_diffs(r, name)]

    # The record, cut to NUM_WORST, with the signed diff b - a read off the scores.
    a, b = receipt.scores[cmp.a], receipt.scores[cmp.b]
    assert listed(receipt) == [(w.sequence, w.position, w.token, b[w.sequence][w.position] - a[w.sequence][w.position])
                               for w in recorded[: rp.NUM_WORST]]
    # The report follows the record rather than ranking again: a record in another order is what it lists.
    reordered = receipt.model_copy(update={"worst_positions": {**receipt.worst_positions, name: recorded[::-1]}})
    assert [x[:2] for x in listed(reordered)] == [(w.sequence, w.position) for w in recorded[::-1][: rp.NUM_WORST]]


def test_report_of_a_receipt_without_worst_positions_ranks_its_scores(fake_receipts: dict[str, Path]) -> None:
    # Receipts written before worst_positions was recorded: the same ranking (stats.worst_positions) from the scores.
    for fault in ("skip-sync", "one-token", "clean"):
        receipt = load(fake_receipts[fault])
        older = receipt.model_copy(update={"worst_positions": None})
        for name in receipt.comparisons:
            assert rp.worst_diffs(older, name) == rp.worst_diffs(receipt, name), (fault, name)
        assert rp.report_markdown(older, "r.json") == rp.report_markdown(receipt, "r.json")


def test_report_of_a_failing_run_says_what_failed(fake_receipts: dict[str, Path]) -> None:
    md = rp.report_markdown(load(fake_receipts["skip-sync"]), "skip-sync.json")
    assert "**Verdict: FAIL**" in md and "injected fault `skip-sync`" in md
    assert "### Checks that did not pass" in md
    assert re.search(r"\| C\.parity\.mean \| 0\.\d+ \| ≤ 0\.0001 \| fail \|", md)
    assert "| C after sync | updated trainer vs synced sampler |" in md and "| fail: C.parity.mean, " in md

    err = rp.report_markdown(load(fake_receipts["crash-at=perturb"]), "crash.json")
    assert "**Verdict: ERROR**: the run errored: `phase perturb: injected crash in phase perturb`" in err
    assert "| B before sync | updated trainer vs stale sampler | Not reached |" in err
    assert "perturbation: not applied" in err


def test_report_text_and_json_formats() -> None:
    text = run_cli("report", TINY_ARG, "--format", "text")
    assert text.returncode == 0, text.stderr
    assert "Verdict: PASS" in text.stdout and "**" not in text.stdout and "`" not in text.stdout
    assert "A zero-init    zero-init trainer vs sampler" in text.stdout
    res = run_cli("report", TINY_ARG, "--format", "json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    receipt = load(TINY)
    assert data["verdict"] == "pass" and data["receipt"] == TINY_ARG
    assert data["headline"]["C"]["mean_abs"] == receipt.comparisons["C.trainer_vs_sampler"].mean_abs
    assert data["comparisons"]["A.trainer_vs_sampler"]["worst"][0]["token_id"] == \
        rp.worst_diffs(receipt, "A.trainer_vs_sampler")[0].token_id
    assert data["revision"]["commit"] == receipt.revision.commit and data["sync_mode"] == "new-id"


def test_markdown_cells_are_escaped() -> None:
    md = rp.render_markdown([rp.Table(["a|b"], [["x | <script>alert(1)</script> <= 3\nnext"]])])
    assert md == "| a\\|b |\n|---|\n| x \\| &lt;script>alert(1)&lt;/script> <= 3 next |\n"
    assert rp.code("a`b\nc") == "`a'b c`"


# --- plots -----------------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_written_and_linked(tmp_path: Path) -> None:
    res = run_cli("report", str(TINY), "--plots", "plots", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for name in PLOTTED:
        png = tmp_path / "plots" / f"{name}.png"
        assert 10_000 < png.stat().st_size < 1_000_000
        width, height = png_size(png)
        assert (width, height) == (990, 396)
        assert f"![{name}: absolute diff per position](plots/{name}.png)" in res.stdout
    assert "### Plots: \\|diff\\| per position" in res.stdout


def test_plots_link_relative_for_an_absolute_directory(tmp_path: Path) -> None:
    res = run_cli("report", str(TINY), "--plots", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "](out/A.trainer_vs_sampler.png)" in res.stdout and str(tmp_path) not in res.stdout


def test_plots_only_for_reached_comparisons(fake_receipts: dict[str, Path], tmp_path: Path) -> None:
    written = write_plots(load(fake_receipts["crash-at=perturb"]), tmp_path)
    assert list(written) == ["A.trainer_vs_sampler"] and png_size(written["A.trainer_vs_sampler"])[0] > 0
    # A failing run's plots draw, too (|diff| far above the budgets, exact zeros on the floor).
    written = write_plots(load(fake_receipts["skip-sync"]), tmp_path / "fail")
    assert sorted(p.name for p in written.values()) == sorted(f"{n}.png" for n in PLOTTED)


def test_matplotlib_is_imported_only_for_plots() -> None:
    code = ("import sys\nfrom lora_parity import report\nfrom lora_parity.cli import app\n"
            "from lora_parity.report import plots\nprint('matplotlib' in sys.modules, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.stdout.strip() == "False False", res.stderr


# --- evidence table --------------------------------------------------------------------------------------


def test_table_of_the_committed_receipt_matches_the_golden() -> None:
    res = run_cli("table", TINY_ARG)
    assert res.returncode == 0, res.stderr
    check_golden("table-tiny-qwen3.md", res.stdout)
    header, rule, row, _blank, signature = res.stdout.splitlines()
    assert rule == "|---|---|---|---|---|" and signature == "Signature: unsigned."
    assert header == ("| Model / input | A: zero-init diff (≤ 0.0001) | B: diff before sync (≥ 0.05) "
                      "| C: diff after sync (≤ 0.0001) | Result |")
    receipt = load(TINY)
    assert row == (f"| tiny-qwen3 (hf → vllm, cpu) | {receipt.comparisons['A.trainer_vs_sampler'].mean_abs:.6f} "
                   f"| {receipt.comparisons['B.trainer_updated_vs_stale'].mean_abs:.6f} "
                   f"| {receipt.comparisons['C.trainer_vs_sampler'].mean_abs:.6f} | Pass |")


def test_table_rows_for_every_outcome(fake_receipts: dict[str, Path]) -> None:
    rows = {name: rp.evidence_row(load(path)) for name, path in fake_receipts.items()}
    assert rows["clean"].result == "Pass" and rows["clean"].model_input == "tiny-qwen3 (fake → fake, cpu)"
    assert rows["skip-sync"].result == "Fails C: updated trainer vs synced sampler disagree (C.parity.mean)"
    assert rows["skip-sync"].model_input == "tiny-qwen3, injected skip-sync (fake → fake, cpu)"
    assert float(rows["skip-sync"].c) > 0.05 and rows["skip-sync"].c == rows["skip-sync"].b
    assert rows["one-token"].result == "Fails A: zero-init trainer vs sampler disagree (A.parity.max)"
    assert rows["frozen-trainer"].result == "Inconclusive: stimulus too small to detect a missing sync (B.stimulus)"
    crashed = rows["crash-at=perturb"]
    assert (crashed.b, crashed.c) == ("Not reached", "Not reached") and crashed.a != "Not reached"
    assert crashed.result == "Error: phase perturb: injected crash in phase perturb"


def test_table_names_a_users_adapter() -> None:
    # run --adapter: the row says both sides started from the user's adapter (score key adapter_base).
    user = load(ROOT / "receipts" / "smollm2-135m-bf16-path.user-adapter__hf__vllm__cpu.json")
    assert "adapter_base" in user.scores
    assert rp.evidence_row(user).model_input.startswith("smollm2-bfloat16, user adapter (hf")
    assert "user adapter" not in rp.evidence_row(load(TINY)).model_input


def test_table_names_the_trainers_tensor_parallel_size(fake_receipts: dict[str, Path]) -> None:
    receipt = load(fake_receipts["clean"])
    for tp, label in ((1, "fake → fake"), (2, "fake TP2 → fake")):
        trainer = receipt.trainer.model_copy(update={"settings": {**receipt.trainer.settings, "tensor_parallel": tp}})
        row = rp.evidence_row(receipt.model_copy(update={"trainer": trainer}))
        assert row.model_input == f"tiny-qwen3 ({label}, cpu)"


def test_table_cli_markdown_and_rich(fake_receipts: dict[str, Path], tmp_path: Path) -> None:
    paths = [str(fake_receipts[n]) for n in ("clean", "crash-at=perturb")]
    md = run_cli("table", *paths, str(TINY))
    assert md.returncode == 0, md.stderr
    assert len(md.stdout.splitlines()) == 2 + 3 + 2 and "| Not reached | Not reached | Error: " in md.stdout
    assert md.stdout.endswith("\n\nSignatures: all 3 receipts unsigned.\n")
    rich = run_cli("table", "--format", "rich", *paths, env=env_without_summary(COLUMNS="200"))
    assert rich.returncode == 0, rich.stderr
    assert "lora-parity evidence" in rich.stdout and "Not reached" in rich.stdout and "|---|" not in rich.stdout
    assert "Signatures: all 2 receipts unsigned." in rich.stdout


def with_budget(receipt: Receipt, check_id: str, budget: float) -> Receipt:
    """`receipt` as if `check_id` had been decided by `budget` (a derived threshold)."""
    checks = [c.model_copy(update={"budget": budget}) if c.id == check_id else c for c in receipt.checks]
    return receipt.model_copy(update={"checks": checks})


def test_table_header_names_the_thresholds_that_decided(fake_receipts: dict[str, Path]) -> None:
    clean = load(fake_receipts["clean"])
    # The header names a threshold only where every receipt's check was decided by the same one.
    derived = with_budget(clean, "B.stimulus", 0.123)
    assert rp.table_header([clean, derived])[2] == "B: diff before sync"
    assert rp.table_header([derived, derived])[2] == "B: diff before sync (≥ 0.123)"
    # The check's own budget, not the config's: budgets.min_stimulus is still 0.05 here.
    assert derived.budgets.min_stimulus == 0.05
    assert rp.table_header([clean, clean])[1:] == ["A: zero-init diff (≤ 0.0001)", "B: diff before sync (≥ 0.05)",
                                                   "C: diff after sync (≤ 0.0001)", "Result"]


# --- schema ------------------------------------------------------------------------------------------------


def test_committed_schema_matches_the_code() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == rp.schema_json(), (
        "receipts/schema.json is stale: regenerate it with `lora-parity schema > receipts/schema.json`")
    res = run_cli("schema")
    assert res.returncode == 0 and res.stdout == rp.schema_json()


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_receipt_validates_against_the_schema(path: Path) -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))
    errors = [e.message for e in validator.iter_errors(json.loads(path.read_text(encoding="utf-8")))]
    assert errors == []


def test_schema_rejects_what_the_models_reject() -> None:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    data = json.loads(TINY.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    for mutate in (lambda d: d.update(surprise=1), lambda d: d["budgets"].update(mean="0.05"),
                   lambda d: d.update(verdict="maybe"), lambda d: d.update(schema_version=2),
                   lambda d: d["checks"][0].update(status="ok")):
        bad = json.loads(json.dumps(data))
        mutate(bad)
        assert list(validator.iter_errors(bad)), "the schema must reject this receipt"


# --- diff --------------------------------------------------------------------------------------------------


def test_diff_of_a_receipt_with_itself_shows_no_differences() -> None:
    receipt = load(TINY)
    d = rp.diff_receipts(receipt, receipt)
    assert d["identical"] and d["changed_checks"] == [] and d["settings"] == []
    assert all(p["delta"] == 0 for stats in d["comparisons"].values() for p in stats.values())
    res = run_cli("diff", TINY_ARG, TINY_ARG)
    assert res.returncode == 0, res.stderr
    assert "**No differences**" in res.stdout and "Checks whose status changed\n\nNone." in res.stdout


def test_diff_of_clean_and_faulty_names_the_failed_c_checks(fake_receipts: dict[str, Path]) -> None:
    res = run_cli("diff", str(fake_receipts["clean"]), str(fake_receipts["skip-sync"]), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert not d["identical"] and d["verdict"] == {"a": "pass", "b": "fail"}
    changed = {c["id"]: (c["a"], c["b"]) for c in d["changed_checks"]}
    for cid in ("C.parity.mean", "C.parity.p99", "C.parity.max", "C.moved.sampler"):
        assert changed[cid] == ("pass", "fail")
    assert not any(cid.startswith(("A.", "B.")) for cid in changed)
    mean = d["comparisons"]["C.trainer_vs_sampler"]["mean_abs"]
    assert mean["a"] < 1e-6 < mean["b"] and mean["delta"] == mean["b"] - mean["a"]
    assert {"key": "injected_fault", "a": None, "b": "skip-sync"} in d["settings"]
    md = run_cli("diff", str(fake_receipts["clean"]), str(fake_receipts["skip-sync"]))
    assert "verdict: **pass → fail**" in md.stdout and "| C.parity.mean | pass | fail |" in md.stdout
    # Missing comparisons of a crashed run are "Not reached", not zero.
    crash = rp.diff_receipts(load(fake_receipts["clean"]), load(fake_receipts["crash-at=perturb"]))
    assert crash["comparisons"]["C.trainer_vs_sampler"]["mean_abs"]["b"] is None
    assert "| C.trainer_vs_sampler | 0 → Not reached | 0 → Not reached | 0 → Not reached |" in \
        rp.diff_markdown(crash, "a", "b")
    assert "| C.delta | 1 → undefined | 1 → 0 (-1) | 0 → 1 (+1) |" in md.stdout  # cosine of no change: undefined


# --- GitHub job summary ----------------------------------------------------------------------------------


def test_report_github_summary_appends(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n", encoding="utf-8")
    res = run_cli("report", TINY_ARG, "--github-summary", env=env_without_summary(GITHUB_STEP_SUMMARY=str(summary)))
    assert res.returncode == 0, res.stderr
    assert summary.read_text(encoding="utf-8") == "earlier step\n" + res.stdout


def test_run_github_summary_appends_after_the_receipt(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    out = tmp_path / "r.json"
    res = run_cli("run", "--trainer", "fake", "--sampler", "fake", "--inject", "skip-sync", "--out", str(out),
                  "--github-summary", env=env_without_summary(GITHUB_STEP_SUMMARY=str(summary)))
    assert res.returncode == 1, res.stderr
    text = summary.read_text(encoding="utf-8")
    assert out.exists() and f"Receipt `{out}`" in text and "**Verdict: FAIL**" in text
    assert text == rp.report_markdown(load(out), str(out))


def test_github_summary_without_the_variable_is_a_hint(tmp_path: Path) -> None:
    res = run_cli("report", TINY_ARG, "--github-summary")
    assert res.returncode == 0
    assert res.stderr.strip() == "lora-parity: --github-summary: GITHUB_STEP_SUMMARY is not set; nothing appended"
    res = run_cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "r.json"),
                  "--github-summary", "--json")
    assert res.returncode == 0 and "GITHUB_STEP_SUMMARY is not set" in res.stderr
    assert json.loads(res.stdout)["verdict"] == "pass"


# --- bad input ---------------------------------------------------------------------------------------------


def tampered(tmp_path: Path) -> Path:
    data = json.loads(TINY.read_text(encoding="utf-8"))
    data["comparisons"]["C.trainer_vs_sampler"]["mean_abs"] = 0.0
    bad = tmp_path / "forged.json"
    bad.write_text(json.dumps({**data, "digest": compute_digest(data)}), encoding="utf-8")
    return bad


@pytest.mark.parametrize("command", ["report", "table", "diff-a", "diff-b"])
def test_bad_receipt_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    bad = tampered(tmp_path)
    args = {"report": ["report", str(bad)], "table": ["table", TINY_ARG, str(bad)],
            "diff-a": ["diff", str(bad), TINY_ARG], "diff-b": ["diff", TINY_ARG, str(bad)]}[command]
    res = run_cli(*args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "does not reproduce" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["report", "no/such.json"], "no/such.json: cannot read"),
    (["report", TINY_ARG, "--format", "pdf"], "unknown format 'pdf'; choose from md, text, json, html"),
    (["table", TINY_ARG, "--format", "csv"], "unknown format 'csv'; choose from md, rich"),
    (["diff", TINY_ARG, "no/such.json", "--json"], "no/such.json: cannot read"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    res = run_cli(*args)
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_report_accepts_receipts_that_verify_but_do_not_pass(fake_receipts: dict[str, Path]) -> None:
    # The report describes a failing or errored run; only a receipt that does not verify is refused.
    res = run_cli("report", str(fake_receipts["crash-at=perturb"]), "--format", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"] == "error"
    for name in FAULTS:
        assert rp.render_report(load(fake_receipts[name]), name, "text").startswith("lora-parity: tiny-qwen3")


def test_cli_goldens_are_what_the_library_renders() -> None:
    # The CLI is thin wiring: the golden is exactly the library's rendering with the path as given.
    assert (GOLDEN / "report-tiny-qwen3.md").read_text(encoding="utf-8") == rp.report_markdown(load(TINY), TINY_ARG)
    assert (GOLDEN / "table-tiny-qwen3.md").read_text(encoding="utf-8") == rp.table_markdown(
        [load(TINY)], rp.signatures_line([TINY_ARG], ["unsigned"]))
    # ... and the comparison notices a change (here: the path as given).
    assert (GOLDEN / "report-tiny-qwen3.md").read_text(encoding="utf-8") != rp.report_markdown(load(TINY), "x.json")


def test_readme_shows_the_golden_evidence_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    header, _rule, row = (GOLDEN / "table-tiny-qwen3.md").read_text(encoding="utf-8").splitlines()[:3]
    assert header in readme and row in readme


def test_table_names_a_users_adapter_and_the_step_updates_warm_start_apart() -> None:
    from lora_parity.report.table import model_input

    receipts = ROOT / "receipts"
    step = model_input(verify(receipts / "smollm2-135m-bf16-path.step.seed-00.20ae6da9__hf__vllm__h200.json").receipt)
    user = model_input(verify(receipts / "smollm2-135m-bf16-path.user-adapter__hf__vllm__cpu.json").receipt)
    assert "update step" in step and "user adapter" not in step
    assert "user adapter" in user and "update step" not in user
