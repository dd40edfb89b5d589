"""The first ten minutes: where runs go, report --out / html, many-file table and verify, --version,
completion, models, --junit, --plan commands that run as printed, and `init`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from lora_parity import __version__
from lora_parity import report as rp
from lora_parity.cli.junit import junit_xml
from lora_parity.evidence.receipt import CheckStatus, Receipt
from lora_parity.models import config
from lora_parity.models.init_config import projection_targets
from lora_parity.report.plots import PLOTTED, figure
from lora_parity.run import plan
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict import checks as checks_mod
from lora_parity.verdict.verify import verify

from .conftest import ROOT

pytestmark = pytest.mark.unit
COMMITTED = sorted((ROOT / "receipts").glob("*__*.json"))
FAILING_BF16 = ROOT / "receipts" / "qwen3-8b-synth__megatron-tp2__vllm__h200.json"


def lp(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    full["LORA_PARITY_CONFIGS"] = str(ROOT / "configs")
    return subprocess.run([sys.executable, "-m", "lora_parity", *args], capture_output=True, text=True, cwd=cwd,
                          env={**full, **(env or {})}, encoding="utf-8", timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ux")
    return {name: execute(RunOptions(trainer="fake", sampler="fake", inject=fault, out=root / f"{name}.json",
                                     revision="f00d")).path
            for name, fault in (("clean", None), ("clean2", None), ("skip-sync", "skip-sync"),
                                ("frozen", "frozen-trainer"), ("crash", "crash-at=perturb"))}


# --- table and verify over many files ----------------------------------------------------------------


def test_table_skips_what_is_not_a_receipt_with_a_note() -> None:
    res = lp("table", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "receipts").glob("*.json")))
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "lora-parity: skipped receipts/schema.json: a JSON Schema, not a receipt"
    assert len(res.stdout.splitlines()) == 2 + len(COMMITTED) + 2  # and the signatures line


def test_table_of_only_non_receipts_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"name": "package.json, say"}')
    res = lp("table", str(ROOT / "receipts" / "schema.json"), str(tmp_path / "a.json"))
    assert res.returncode == 2
    assert "skipped" in res.stderr and f"skipped {tmp_path / 'a.json'}: not a receipt" in res.stderr
    assert "no receipt among the 2 file(s) given" in res.stderr.splitlines()[-1]


def test_rows_that_would_look_the_same_show_their_date(runs: dict[str, Path]) -> None:
    receipts = [verify(runs[n]).receipt for n in ("clean", "clean2", "skip-sync")]
    rows = rp.table_rows(receipts)
    for row, receipt in zip(rows[:2], receipts[:2], strict=True):
        assert row[0] == f"tiny-qwen3 (fake → fake, cpu, {receipt.created_at.replace('T', ' ')})"
    assert rows[2][0] == "tiny-qwen3, injected skip-sync (fake → fake, cpu)"  # unique: no date
    assert rp.table_rows(receipts[:1])[0][0] == "tiny-qwen3 (fake → fake, cpu)"
    assert rp.table_markdown(receipts).count(receipts[0].created_at.replace("T", " ")) >= 1


def test_verify_many_files_exit_with_the_worst(runs: dict[str, Path], tmp_path: Path) -> None:
    schema = str(ROOT / "receipts" / "schema.json")
    res = lp("verify", str(runs["clean"]), schema, str(runs["clean2"]))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(": intact; verdict pass") == 2 and "skipped" in res.stderr
    assert lp("verify", str(runs["clean"]), str(runs["skip-sync"])).returncode == 1
    broken = tmp_path / "broken.json"
    broken.write_text(runs["clean"].read_text().replace('"verdict": "pass"', '"verdict": "fail"'))
    res = lp("verify", str(runs["clean"]), str(broken), "--json")
    assert res.returncode == 2
    data = json.loads(res.stdout)
    assert [d["intact"] for d in data] == [True, False] and "digest" in data[1]["error"]
    assert "Traceback" not in res.stderr


# --- report --out, html, plots -----------------------------------------------------------------------------


def test_report_out_writes_markdown_with_plots_beside_it(tmp_path: Path) -> None:
    res = lp("report", str(FAILING_BF16), "--out", "rep", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    md = tmp_path / "rep" / "report.md"
    assert res.stdout.strip() == str(Path("rep") / "report.md")
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md.read_text(encoding="utf-8"))
    assert sorted(links) == sorted(f"{n}.png" for n in PLOTTED)
    for link in links:  # relative to the markdown: they resolve beside it
        assert not link.startswith(("/", "../")) and (md.parent / link).is_file()


def test_report_out_with_plots_is_refused() -> None:
    res = lp("report", str(FAILING_BF16), "--out", "x", "--plots", "y")
    assert res.returncode == 2 and "drop --plots" in res.stderr


def test_report_html_is_one_self_contained_page(tmp_path: Path) -> None:
    res = lp("report", str(FAILING_BF16), "--format", "html", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == len(PLOTTED) and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "href=" not in page and "<script" not in page
    assert "<strong>Verdict: FAIL</strong>" in page and "<table>" in page
    stdout = lp("report", str(FAILING_BF16), "--format", "html")
    assert stdout.returncode == 0 and stdout.stdout.startswith("<!DOCTYPE html>")


def test_html_escapes_receipt_text() -> None:
    page = rp.render_html([rp.Para("a `<b>x</b>` **bold** <i>"), rp.Table(["<h>"], [["<c>"]])], "t")
    assert "<code>&lt;b&gt;x&lt;/b&gt;</code>" in page and "<strong>bold</strong> &lt;i&gt;" in page
    assert "<th>&lt;h&gt;</th>" in page and "<td>&lt;c&gt;</td>" in page


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (apt-get install -y chromium); .ci/run installs it")
def test_html_report_renders_its_plots_in_a_headless_browser(tmp_path: Path) -> None:
    import matplotlib.image

    assert lp("report", str(FAILING_BF16), "--format", "html", "--out", str(tmp_path)).returncode == 0
    shot = tmp_path / "shot.png"
    res = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--screenshot={shot}", "--window-size=1200,2400",
                          (tmp_path / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), res.stderr
    pixels = matplotlib.image.imread(shot)[..., :3]
    # The plots' points are tab:blue (31, 119, 180); nothing else on the page is that colour.
    blue = ((abs(pixels[..., 0] - 31 / 255) < 0.08) & (abs(pixels[..., 1] - 119 / 255) < 0.08)
            & (abs(pixels[..., 2] - 180 / 255) < 0.08))
    assert blue.sum() > 200, "the inline plots did not render"


def _lines(fig: Any) -> dict[str, Any]:
    return {line.get_label(): line for line in fig.axes[0].get_lines()}


def test_plot_mean_line_is_unlike_the_budget_lines() -> None:
    receipt = verify(FAILING_BF16).receipt
    lines = _lines(figure(receipt, "A.trainer_vs_sampler"))
    mean = lines[f"observed mean {receipt.comparisons['A.trainer_vs_sampler'].mean_abs:.3g}"]
    budgets = [v for k, v in lines.items() if "(decided)" in k]
    assert len(budgets) == 3
    for b in budgets:
        assert (b.get_color(), b.get_linestyle()) != (mean.get_color(), mean.get_linestyle())
        assert mean.get_linewidth() > b.get_linewidth()


def test_plot_labels_sequence_boundaries(runs: dict[str, Path]) -> None:
    receipt = verify(runs["clean"]).receipt
    texts = [t.get_text() for t in figure(receipt, "A.trainer_vs_sampler").axes[0].texts]
    lengths = [len(s) for s in receipt.scores["zero"]]
    for s, n in enumerate(lengths):
        assert f"seq {s} ({n} positions)" in texts


def _with_reference(receipt: Receipt) -> Receipt:
    scores = {k: [list(s) for s in v] for k, v in receipt.scores.items()}
    scores["reference_fp32"] = [[x + 1e-3 * (i % 3) for i, x in enumerate(seq)] for seq in scores["trainer_zero"]]
    return receipt.model_copy(update={"scores": scores,
                                      "comparisons": checks_mod.compute_comparisons(scores, receipt.budgets)})


def test_plot_draws_the_fp32_reference_when_present(runs: dict[str, Path]) -> None:
    receipt = verify(runs["clean"]).receipt
    assert not any("fp32" in k for k in _lines(figure(receipt, "A.trainer_vs_sampler")))
    ref = _with_reference(receipt)
    assert "R.trainer_vs_fp32" in ref.comparisons
    lines = _lines(figure(ref, "A.trainer_vs_sampler"))
    trainer = lines["|trainer − fp32 reference|"]
    assert "|sampler − fp32 reference|" in lines
    assert max(trainer.get_ydata()) == pytest.approx(2e-3, rel=1e-6)
    assert not any("fp32" in k for k in _lines(figure(ref, "C.trainer_vs_sampler")))


# --- version, completion, models -----------------------------------------------------------------------------


def test_version() -> None:
    res = lp("--version")
    assert res.returncode == 0 and res.stdout == f"lora-parity {__version__}\n"


def test_completion_installs_and_completes(tmp_path: Path) -> None:
    # As a user types it: from bash (typer finds the shell among the process's ancestors, so a test run
    # detached from any shell would otherwise fail here).
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash",
           "LORA_PARITY_CONFIGS": str(ROOT / "configs")}
    res = subprocess.run(["bash", "-c", '"$0" -m lora_parity --install-completion; exit $?', sys.executable],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    script = tmp_path / ".bash_completions" / "lora-parity.sh"
    assert "complete -o default -F _lora_parity_completion lora-parity" in script.read_text()
    assert f"source '{script}'" in (tmp_path / ".bashrc").read_text()
    done = lp(env={"_LORA_PARITY_COMPLETE": "complete_bash", "COMP_WORDS": "lora-parity rep", "COMP_CWORD": "1"})
    assert done.stdout.split() == ["report"]


def test_models_marks_the_default_and_says_what_each_needs() -> None:
    res = lp("models", "--json")
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert [n for n, r in rows.items() if r["default"]] == [config.DEFAULT_MODEL]
    assert rows["tiny-qwen3"]["needs"] == {"device": "CPU", "extras": ["cpu"], "checkpoint": None}
    assert rows["qwen3-0.6b-synth"]["needs"]["device"] == "GPU"
    assert rows["glm-5.3"]["needs"] == {"device": "3 nodes x 8 GPUs", "extras": ["gpu", "megatron"],
                                        "checkpoint": "zai-org/GLM-5.3-BF16"}
    text = lp("models")
    line = next(x for x in text.stdout.splitlines() if x.startswith("tiny-qwen3 "))
    assert line.split()[1] == "*" and "CPU, [cpu]" in line
    assert "* the default" in text.stderr


# --- junit -----------------------------------------------------------------------------------------------------


def test_junit_one_case_per_check(runs: dict[str, Path]) -> None:
    receipt = verify(runs["skip-sync"]).receipt
    suite = ET.fromstring(junit_xml(receipt, "r.json"))
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [c.id for c in receipt.checks]
    failing = {c.id: c.reason for c in receipt.checks if c.status == CheckStatus.FAIL}
    failed = {c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert failed.keys() == failing.keys() and failing
    assert all(f is not None and failing[n] in (f.get("message") or "") for n, f in failed.items())
    assert suite.get("failures") == str(len(failing)) and suite.get("tests") == str(len(cases))


def test_junit_inconclusive_is_a_failure_and_an_error_run_is_an_error(runs: dict[str, Path]) -> None:
    frozen = ET.fromstring(junit_xml(verify(runs["frozen"]).receipt, "r.json"))
    stimulus = next(c for c in frozen.findall("testcase") if c.get("name") == "B.stimulus")
    failure = stimulus.find("failure")
    assert failure is not None and failure.get("type") == "inconclusive"
    crash = ET.fromstring(junit_xml(verify(runs["crash"]).receipt, "r.json"))
    assert crash.get("errors") == "1" and int(crash.get("skipped") or 0) > 0
    run_case = next(c for c in crash.findall("testcase") if c.get("name") == "run")
    error = run_case.find("error")
    assert error is not None and "injected crash" in (error.get("message") or "")


def test_run_junit_writes_the_report(tmp_path: Path) -> None:
    out, xml = tmp_path / "r.json", tmp_path / "junit.xml"
    res = lp("run", "--trainer", "fake", "--sampler", "fake", "--inject", "skip-sync", "--out", str(out),
             "--junit", str(xml))
    assert res.returncode == 1, res.stderr
    suite = ET.parse(xml).getroot()
    assert int(suite.get("failures") or 0) >= 1 and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    res = lp("run", "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "s.json"),
             "--junit", str(tmp_path / "no" / "j.xml"))
    assert res.returncode == 2 and "does not exist" in res.stderr and not (tmp_path / "s.json").exists()


# --- plan ----------------------------------------------------------------------------------------------------


def test_plan_for_a_yaml_file_prints_a_command_that_runs(tmp_path: Path) -> None:
    yaml_file = tmp_path / "my model.yaml"
    shutil.copy(ROOT / "configs" / "tiny-qwen3.yaml", yaml_file)
    res = lp("run", "--model", "my model.yaml", "--trainer", "fake", "--sampler", "fake", "--plan", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    command = res.stdout.split("on this machine: ", 1)[1].splitlines()[0].strip()
    assert command == "lora-parity run --model 'my model.yaml' --trainer fake --sampler fake"
    memory = res.stdout.split("memory: ", 1)[1]  # issue 46, case 7: what the run will hold, from the headers
    assert "GiB (float32) held by the trainer and by the sampler" in memory or "not estimated" in memory
    argv = shlex.split(command)
    ran = lp(*argv[1:], "--out", "r.json", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr


def test_plan_honours_trainer_and_tp_and_names_hf_download() -> None:
    default = plan.render(config.load("glm-5.3"))
    assert "hf download zai-org/GLM-5.3-BF16" in default and "huggingface-cli" not in default
    res = lp("run", "--model", "glm-5.3", "--plan", "--trainer", "megatron", "--tp", "2")
    assert res.returncode == 0, res.stderr
    assert "TP 2 x EP 8 x PP 1 = 16 ranks (data parallel 8" in res.stdout
    assert "-m lora_parity.launch run --model glm-5.3 --trainer megatron --tp 2 --sampler vllm" in res.stdout
    hf = lp("run", "--model", "glm-5.3", "--plan", "--trainer", "hf")
    assert "trainer     hf on nodes 0-1" in hf.stdout and "-m lora_parity run --model glm-5.3 --trainer hf" in hf.stdout
    bad = lp("run", "--model", "glm-5.3", "--plan", "--tp", "3")
    assert bad.returncode == 2 and "does not divide" in bad.stderr


# --- init ------------------------------------------------------------------------------------------------------


def fake_checkpoint(folder: Path, dtype: str, names: list[str], arch: str = "Qwen3ForCausalLM") -> Path:
    """config.json and a safetensors file whose header names `names` (1-element F32 tensors)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "qwen3",
                                                    "torch_dtype": dtype, "max_position_embeddings": 4096,
                                                    "vocab_size": 512}))
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    blob = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 4 * len(names))
    return folder


def _dense(layer: int = 0) -> list[str]:
    pre = f"model.layers.{layer}"
    return ([f"{pre}.self_attn.{k}.weight" for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
            + [f"{pre}.mlp.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")]
            + [f"{pre}.input_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"])


@pytest.mark.parametrize(("dtype", "profile"), [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "bf16")])
def test_init_writes_a_config_that_loads(dtype: str, profile: str, tmp_path: Path) -> None:
    ckpt = fake_checkpoint(tmp_path / "ckpt", dtype, _dense(0) + _dense(1))
    out = tmp_path / "cfg.yaml"
    res = lp("init", str(ckpt), "--out", str(out))
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    assert text.count("\n# ") + text.count("\n  # ") >= 15, "the fields are explained in comments"
    cfg = config.load(str(out))
    assert cfg.budgets == config.profile_budgets(profile) and cfg.budgets.profile == profile
    assert cfg.perturbation.std == "auto"
    assert cfg.model.dtype == dtype and Path(cfg.model.path or "") == ckpt.resolve()
    assert cfg.adapter.targets == config.HF_TARGETS
    assert lp("run", "--model", str(out), "--plan").returncode == 0
    ran = lp("run", "--model", str(out), "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "r.json"))
    assert ran.returncode == 0, ran.stderr
    assert lp("init", str(ckpt), "--out", str(out)).returncode == 2  # exists, no --force


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_init_config_is_the_config_the_folder_gets_by_path(dtype: str, kind: str, tmp_path: Path) -> None:
    """Issue 28 item 7: `run --model my.yaml` runs with the settings `run --model FOLDER` gets (perturbation,
    budget profile, adapter, probes, everything), whatever the folder: one source of truth."""
    names = _dense(0)
    if kind == "moe":
        names = [n for n in names if ".mlp." not in n]
        names += [f"model.layers.0.mlp.experts.{e}.{k}.weight" for e in range(2) for k in ("gate_proj", "up_proj")]
    ckpt = fake_checkpoint(tmp_path / "ckpt", dtype, names)
    out = tmp_path / "my.yaml"
    assert lp("init", str(ckpt), "--out", str(out)).returncode == 0
    by_path, from_init = config.load(str(ckpt)), config.load(str(out))
    assert by_path.perturbation.std == "auto" and by_path.budgets.profile == ("fp32" if dtype == "float32" else "bf16")
    assert by_path.adapter.targets == (config.HF_TARGETS if kind == "dense" else ["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"])
    same = {"name": "x", "description": ""}
    assert from_init.model_copy(update=same) == by_path.model_copy(update=same)
    assert from_init.model_copy(update=same).digest() == by_path.model_copy(update=same).digest()


def test_init_targets_for_moe_and_mla() -> None:
    moe = [f"model.layers.0.self_attn.{k}.weight" for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
    moe += [f"model.layers.0.mlp.experts.{e}.{k}.weight" for e in range(2) for k in ("gate_proj", "up_proj")]
    targets, notes = projection_targets(moe)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj"] and any("expert" in n for n in notes)
    mla = [f"model.layers.0.self_attn.{k}.weight" for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                             "kv_b_proj", "o_proj")]
    mla += ["model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.0.mlp.gate_proj.weight"]
    targets, notes = projection_targets(mla)
    assert targets == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj"]
    assert any("kv_b_proj" in n for n in notes) and any("indexer" in n for n in notes)


def test_init_refuses_a_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    res = lp("init", str(tmp_path))
    assert res.returncode == 2 and "no .safetensors weights" in res.stderr and res.stderr.count("\n") == 1
