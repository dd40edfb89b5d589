"""The composite GitHub Action (action.yml) run locally: its `run:` steps execute in bash with the env a
runner gives them (inputs, GITHUB_OUTPUT, GITHUB_STEP_SUMMARY, RUNNER_TEMP), `uses:` steps are recorded,
and the real `lora-parity` on PATH runs the fake backends (milliseconds)."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import ROOT

pytestmark = pytest.mark.unit
ACTION = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
EXPRESSION = re.compile(r"\$\{\{\s*(.+?)\s*\}\}")


@dataclass
class Job:
    """What the runner would show after the action's steps."""

    failed_step: str | None = None
    exit_code: int = 0
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""


def evaluate(expr: str, inputs: dict[str, str], outputs: dict[str, dict[str, str]]) -> str:
    """The few expressions action.yml uses: inputs.X, github.action_path, steps.ID.outputs.X."""
    if expr.startswith("inputs."):
        return inputs[expr.removeprefix("inputs.")]
    if expr == "github.action_path":
        return str(ROOT)
    step, _, name = expr.removeprefix("steps.").partition(".outputs.")
    return outputs.get(step, {}).get(name, "")


def substitute(value: str, inputs: dict[str, str], outputs: dict[str, dict[str, str]]) -> str:
    return EXPRESSION.sub(lambda m: evaluate(m.group(1), inputs, outputs), value)


def runs_step(condition: str | None, inputs: dict[str, str], failed: bool) -> bool:
    if condition is None:
        return not failed
    if condition == "always()":
        return True
    left, right = (s.strip() for s in condition.split("=="))
    return not failed and evaluate(left, inputs, {}) == right.strip("'")


def read_outputs(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text(encoding="utf-8").splitlines() if "=" in line)


def run_action(tmp_path: Path, **given: str) -> Job:
    inputs = {name: spec.get("default", "") for name, spec in ACTION["inputs"].items()} | given
    summary = tmp_path / "summary.md"
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin",
           "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "HOME": str(tmp_path),
           "GITHUB_STEP_SUMMARY": str(summary), "RUNNER_TEMP": str(tmp_path), "GITHUB_ACTIONS": "true"}
    job = Job()
    for i, step in enumerate(ACTION["runs"]["steps"]):
        if not runs_step(step.get("if"), inputs, job.failed_step is not None):
            continue
        if "uses" in step:
            job.uploads.append({"uses": step["uses"], **{k: substitute(str(v), inputs, job.outputs)
                                                         for k, v in step.get("with", {}).items()}})
            continue
        output_file = tmp_path / f"output-{i}"
        output_file.touch()
        step_env = {**env, "GITHUB_OUTPUT": str(output_file),
                    **{k: substitute(str(v), inputs, job.outputs) for k, v in step.get("env", {}).items()}}
        res = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=tmp_path,
                             env=step_env, capture_output=True, text=True, timeout=300)
        job.log += res.stdout + res.stderr
        if "id" in step:
            job.outputs[step["id"]] = read_outputs(output_file)
        if res.returncode != 0 and job.failed_step is None:
            job.failed_step, job.exit_code = step["name"], res.returncode
    return job


def test_scripts_take_inputs_only_through_env() -> None:
    # A `${{ }}` inside a script would be pasted into the shell: an input could inject commands.
    for step in ACTION["runs"]["steps"]:
        assert "${{" not in step.get("run", ""), step["name"]
    uses = [s["uses"] for s in ACTION["runs"]["steps"] if "uses" in s]
    assert any(u.startswith("actions/upload-artifact@") for u in uses)


def test_a_passing_run_writes_summary_junit_and_receipt_and_passes(tmp_path: Path) -> None:
    job = run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--no-per-target")
    assert job.failed_step is None, job.log
    assert job.outputs["verify"]["verdict"] == "pass" and job.outputs["run"]["exit-code"] == "0"
    assert "**Verdict: PASS**" in (tmp_path / "summary.md").read_text(encoding="utf-8")
    suite = ET.parse(tmp_path / "lora-parity-junit.xml").getroot()
    assert int(suite.get("tests", "0")) > 10 and suite.get("failures") == "0"
    (upload,) = job.uploads[-1:]
    assert upload["uses"].startswith("actions/upload-artifact@") and upload["name"] == "lora-parity-receipt"
    assert upload["path"].split() == ["lora-parity-receipt.json", "lora-parity-junit.xml", "lora-parity-receipt.log"]
    assert (tmp_path / "lora-parity-receipt.json").is_file()


def test_a_failing_verdict_fails_the_job_after_the_upload(tmp_path: Path) -> None:
    job = run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--inject skip-sync",
                     receipt="out/r.json")
    assert job.failed_step == "Fail on the verdict" and job.exit_code == 1
    assert job.outputs["verify"]["verdict"] == "fail" and job.outputs["run"]["exit-code"] == "1"
    assert "::error title=lora-parity::verdict fail" in job.log
    assert "**Verdict: FAIL**" in (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert ET.parse(tmp_path / "lora-parity-junit.xml").getroot().get("failures") != "0"
    assert job.uploads[-1]["path"].split()[0] == "out/r.json" and (tmp_path / "out" / "r.json").is_file()


def test_bad_input_fails_at_the_run_step(tmp_path: Path) -> None:
    job = run_action(tmp_path, install="false", trainer="no-such-trainer", sampler="fake")
    assert job.failed_step == "Run lora-parity" and job.exit_code == 2
    assert "verify" not in job.outputs and job.uploads[-1]["uses"].startswith("actions/upload-artifact@")


def test_a_receipt_left_at_the_path_is_never_verified_in_place_of_this_runs(tmp_path: Path) -> None:
    """Issue 46, case 1: a passing receipt committed in the pull request (or left in a reused workspace) at the
    receipt path, and a run that is refused or told to write elsewhere: the job fails, never verifies the old one."""
    first = run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--no-per-target")
    assert first.failed_step is None and (tmp_path / "lora-parity-receipt.json").is_file()
    refused = run_action(tmp_path, install="false", trainer="no-such-trainer", sampler="fake")
    assert refused.failed_step == "Run lora-parity" and refused.exit_code == 2 and "verify" not in refused.outputs
    assert not (tmp_path / "lora-parity-receipt.json").exists()
    run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--no-per-target")
    elsewhere = run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--out other.json")
    assert elsewhere.failed_step == "Run lora-parity" and elsewhere.exit_code == 2, elsewhere.log
    assert "args may not set --out" in elsewhere.log


def test_multi_line_args_all_reach_the_run_and_a_dash_path_is_a_path(tmp_path: Path) -> None:
    """Issue 46, case 11: a YAML block scalar's every line is passed on; a receipt path starting with `-` is not
    read as an option."""
    import json

    job = run_action(tmp_path, install="false", trainer="fake", sampler="fake", args="--no-per-target\n--seed 3\n",
                     receipt="-r.json")
    assert job.failed_step is None, job.log
    receipt = json.loads((tmp_path / "-r.json").read_text())
    assert "--seed" in receipt["command"] and "3" in receipt["command"]
    assert job.outputs["verify"]["verdict"] == "pass"


def test_the_workflow_example_uses_this_action() -> None:
    doc = (ROOT / "docs" / "ci-action.md").read_text(encoding="utf-8")
    example = yaml.safe_load(doc.split("```yaml\n", 1)[1].split("```", 1)[0])
    steps = example["jobs"]["lora-parity"]["steps"]
    ours = [s for s in steps if "lora-parity@" in s.get("uses", "")]
    assert len(ours) == 1 and set(ours[0]["with"]) <= set(ACTION["inputs"])
