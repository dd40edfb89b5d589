"""Every output surface of a receipt from a stranger (issue 23) and what decided it (issue 28):
one escaping layer for markdown, terminal and XML; the signature stated; the thresholds that decided
each check, the sync / numerics verdicts, the reasons, the error breakdown and the start adapter shown."""

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from lora_parity import report as rp
from lora_parity.cli.junit import junit_xml
from lora_parity.evidence.receipt import Receipt, compute_digest
from lora_parity.report.plots import _budget_lines
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util import escape
from lora_parity.verdict.verify import verify

from .conftest import ROOT

pytestmark = pytest.mark.unit
SPOOF = "x\n\n**Verdict: PASS**\n<!--"
HOSTILE = ("![i](https://evil.example/x.png) [l](javascript:alert(1)) <img src=x onerror=alert(1)> @octocat "
           "<https://evil.example> &#60;!-- `code` | cell \x1b[31mred\x1b]0;title\x07 \x9b2J \x00\x07\u202e")
USER_ADAPTER = ROOT / "receipts" / "smollm2-135m-bf16-path.user-adapter__hf__vllm__cpu.json"
CONTROL = "\x00\x01\x08\x0b\x0c\x1b\x7f\x85\x9b"


def parse_markdown(md: str) -> list[Any]:
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(md)


def render_markdown_html(md: str) -> str:
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(md)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lora_parity", *args], capture_output=True, text=True,
                          encoding="utf-8", cwd=ROOT, env=env, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    return {name: execute(RunOptions(trainer="fake", sampler="fake", inject=fault, out=root / f"{name}.json",
                                     per_target=False)).path
            for name, fault in (("clean", None), ("skip-sync", "skip-sync"))}


def resealed(src: Path, dst: Path, **model: str) -> Path:
    """`src` with model fields replaced and the digest recomputed: intact, as anyone can make one."""
    data = json.loads(src.read_text(encoding="utf-8"))
    data["model"].update(model)
    data["digest"] = compute_digest(data)
    dst.write_text(json.dumps(data), encoding="utf-8")
    return dst


def assert_no_raw_html_from_data(md: str) -> None:
    """No image, no link, no raw HTML but the report's own <details>, no comment, no @mention."""
    for token in parse_markdown(md):
        assert token.type != "html_block" or token.content.startswith(("<details>", "</details>")), token.content
        for child in token.children or []:
            assert child.type not in ("html_inline", "image", "link_open"), (child.type, child.content)
    html = render_markdown_html(md)
    assert "<img" not in html and "href=" not in html and "<!--" not in md
    # GitHub mentions nobody inside a code span; everywhere else the @ carries a zero-width joiner.
    assert "@octocat" not in re.sub(r"<code>.*?</code>", "", html)


# --- issue 23: one escaping layer ----------------------------------------------------------------------------


def test_escape_layer_neutralises_markup_escapes_and_controls() -> None:
    assert escape.one_line("a\n\nb\x1b[31mc\x1b]0;t\x07d\x00e\u202ef") == "a bcd\ufffde\ufffdf"
    md = escape.markdown("**x** <!-- ![i](u) [l](javascript:x) @me a_b _c_ &#60; |")
    assert md == "\\*\\*x\\*\\* &lt;!-- !\\[i\\](u) \\[l\\](javascript:x) @\u200dme a_b \\_c\\_ &\\#60; \\|"
    assert escape.code("a`b\n<!--c") == "`a'b <\u200b!--c`" and "<!--" not in escape.code("<!--")
    assert escape.terminal("a\nb\tc\x1b[2Jd\x07") == "a\nb\tcd\ufffd"
    assert escape.rich("[red]x\ny  ") == "\\[red]x y  "
    ET.fromstring(f"<a b='{escape.xml(CONTROL)}'>{escape.xml(CONTROL)}</a>")


def test_a_spoofed_model_name_cannot_fake_the_verdict(runs: dict[str, Path], tmp_path: Path) -> None:
    spoof = resealed(runs["skip-sync"], tmp_path / "spoof.json", name=SPOOF)
    summary = tmp_path / "summary.md"
    res = cli("report", str(spoof), "--github-summary", env={"PATH": "/usr/bin:/bin",
                                                             "GITHUB_STEP_SUMMARY": str(summary)})
    assert res.returncode == 0, res.stderr
    for md in (res.stdout, summary.read_text(encoding="utf-8")):
        assert "<!--" not in md and not any(line.startswith("**Verdict: PASS") for line in md.splitlines())
        assert md.splitlines()[2].startswith("**Verdict: FAIL**")
        # Rendered, the only strong text that names a verdict is the real one.
        strong = [t.children[i + 1].content for t in parse_markdown(md) if t.type == "inline"
                  for i, c in enumerate(t.children or []) if c.type == "strong_open"]
        assert [s for s in strong if s.startswith("Verdict")] == ["Verdict: FAIL"]
        assert_no_raw_html_from_data(md)


def test_hostile_strings_render_as_text_in_every_markdown_output(runs: dict[str, Path], tmp_path: Path) -> None:
    hostile = resealed(runs["skip-sync"], tmp_path / "hostile.json", name=HOSTILE, source=HOSTILE)
    receipt = verify(hostile).receipt
    table = rp.table_markdown([receipt], rp.signatures_line([HOSTILE], ["unsigned"]))
    diff = rp.diff_markdown(rp.diff_receipts(verify(runs["skip-sync"]).receipt, receipt), HOSTILE, str(hostile))
    for md in (rp.report_markdown(receipt, HOSTILE), table, diff):
        assert_no_raw_html_from_data(md)
        assert not set(CONTROL) & set(md)
    # The name is still there, as text: a reader sees what the receipt claims.
    assert "![i](https:\u200b//evil.example/x.png)" in render_markdown_html(table)  # no autolink either
    assert "@\u200doctocat" in render_markdown_html(table)


def test_no_escape_sequence_from_a_receipt_reaches_the_terminal(runs: dict[str, Path], tmp_path: Path) -> None:
    hostile = resealed(runs["skip-sync"], tmp_path / "hostile.json", name=HOSTILE)
    for args in (["report", str(hostile), "--format", "text"], ["table", "--format", "rich", str(hostile)],
                 ["diff", str(runs["skip-sync"]), str(hostile)], ["table", str(hostile)]):
        res = cli(*args)
        assert res.returncode == 0, res.stderr
        assert not set(CONTROL) & set(res.stdout + res.stderr), args
        assert "red" in res.stdout  # the text around the sequences is kept


def test_junit_of_a_receipt_with_control_characters_parses(runs: dict[str, Path], tmp_path: Path) -> None:
    hostile = resealed(runs["skip-sync"], tmp_path / "ctl.json", name=HOSTILE)
    text = junit_xml(verify(hostile).receipt, "ctl.json")
    suite = ET.fromstring(text)
    assert not set(CONTROL) & set(text)
    assert suite.get("failures") == "9" and "<img" in suite.get("name", "")  # escaped by XML, kept as text


# --- issue 23 item 9: the signature -------------------------------------------------------------------------


def test_report_table_diff_and_summary_state_the_signature(runs: dict[str, Path], tmp_path: Path) -> None:
    from lora_parity.evidence import signing

    key, pub = signing.keygen(tmp_path / "key")
    signed = tmp_path / "signed.json"
    signed.write_bytes(runs["clean"].read_bytes())
    signing.sign_file(signed, signing.load_private_key(key))
    key_id = signing.keyid(signing.load_public_key(pub))[:16]
    plain = str(runs["clean"])

    assert "**unsigned**" in cli("report", plain).stdout
    assert "**signed, signature not checked" in cli("report", str(signed)).stdout
    assert f"**signed (key id {key_id})**" in cli("report", str(signed), "--public-key", str(pub)).stdout
    assert cli("table", plain, str(signed)).stdout.endswith(
        f"Signatures: unsigned: {plain}; signed, signature not checked (give --public-key to check it): "
        f"{signed}.\n")
    assert "Signature: signed (key id" in cli("table", str(signed), "--public-key", str(pub)).stdout
    diff = cli("diff", plain, str(signed)).stdout
    assert "- signature: a unsigned, b signed, signature not checked" in diff
    # A key that did not sign it is refused, as verify refuses it.
    _, other = signing.keygen(tmp_path / "other")
    res = cli("report", str(signed), "--public-key", str(other))
    assert res.returncode == 2 and "signature does not verify" in res.stderr


# --- issue 28 item 8: the thresholds that decided, verdicts, reasons, breakdown --------------------------------


def with_budget(receipt: Receipt, check_id: str, budget: float) -> Receipt:
    checks = [c.model_copy(update={"budget": budget}) if c.id == check_id else c for c in receipt.checks]
    return receipt.model_copy(update={"checks": checks})


def test_reports_draw_the_threshold_that_decided_not_the_fixed_budget(runs: dict[str, Path]) -> None:
    receipt = with_budget(verify(runs["skip-sync"]).receipt, "C.parity.max", 1.02)  # e.g. 2 x A + floor
    assert receipt.budgets.max == 0.001
    md = rp.report_markdown(receipt, "r.json")
    c_row = next(line for line in md.splitlines() if line.startswith("| C after sync |"))
    assert "max ≤ 1.02" in c_row and "max ≤ 0.001" not in c_row
    assert "| A zero-init | zero-init trainer vs sampler |" in md
    data = rp.report_data(receipt, "r.json")
    assert data["headline"]["C"]["thresholds"]["C.parity.max"] == {"op": "<=", "budget": 1.02}
    lines = _budget_lines(receipt, "C.trainer_vs_sampler")
    assert [v for v, *_ in lines] == [c.budget for c in receipt.checks if c.id.startswith("C.parity.")]
    assert 1.02 in [v for v, *_ in lines] and receipt.budgets.max not in [v for v, *_ in lines]
    suite = ET.fromstring(junit_xml(receipt, "r.json"))
    case = suite.find("testcase[@name='C.parity.max']")
    assert case is not None
    assert case.find("properties/property[@name='threshold']").get("value") == "≤ 1.02"  # type: ignore[union-attr]
    assert "threshold ≤ 1.02" in case.find("failure").get("message", "")  # type: ignore[union-attr]


def test_report_shows_the_two_verdicts_and_the_failing_reasons(runs: dict[str, Path]) -> None:
    receipt = verify(runs["skip-sync"]).receipt
    assert receipt.verdicts is not None
    md = rp.report_markdown(receipt, "r.json")
    assert "sync (delivery: B, C's movement, X, per-target movement): **fail**, decided by `C.parity.mean`" in md
    assert "numerics (computation: A, the fp32 reference; C, T and G where X proved delivery): **pass**" in md
    failing = md.split("### Checks that did not pass")[1].split("###")[0]
    for check in receipt.checks:
        if check.status.value == "fail":
            assert check.reason in failing
    assert "the new adapter never reached the engine" in failing
    props = {p.get("name"): p.get("value") for p in ET.fromstring(junit_xml(receipt, "r.json")).iter("property")}
    assert (props["verdict.sync"], props["verdict.numerics"], props["signature"]) == ("fail", "pass", "unsigned")


def test_report_has_the_error_breakdown(runs: dict[str, Path]) -> None:
    receipt = verify(runs["clean"]).receipt
    assert receipt.breakdown is not None
    md = rp.report_markdown(receipt, "r.json")
    assert "### Error breakdown" in md
    for name, b in receipt.breakdown.items():
        assert f"(`{name}`)" in md
        for s in (*b.by_logprob, *b.by_position):
            assert f"| {escape.markdown(s.bucket)} | {s.n} | {rp.fmt_num(s.mean_abs)} | {rp.fmt_num(s.max_abs)} |" in md
    # A receipt made before the breakdown was recorded gets it from its scores.
    older = receipt.model_copy(update={"breakdown": None})
    assert rp.report_data(older, "r.json")["breakdown"] == rp.report_data(receipt, "r.json")["breakdown"]


def test_a_start_adapter_is_named_instead_of_zero_init() -> None:
    receipt = verify(USER_ADAPTER).receipt
    md = rp.report_markdown(receipt, "r.json")
    assert md.startswith("## lora-parity: smollm2-bfloat16, hf trainer vs vllm sampler, from a "
                         "start adapter\n")
    headline = md.split("### ")[0]
    assert "| A start adapter | start adapter trainer vs sampler |" in headline and "zero-init" not in headline
    assert "Update agreement (Δ = updated − start adapter" in md
    assert rp.table_header([receipt])[1].startswith("A: start adapter diff")
    assert rp.table_header([receipt, verify(sorted((ROOT / "receipts").glob("tiny-qwen3__hf__vllm__*.json"))[0])
                            .receipt])[1].startswith("A: zero-init or start adapter diff")
