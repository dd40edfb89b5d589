"""The terminal output of run and selftest: explanations, the closing line, quiet by default (third-party
output to a log file), --quiet/--verbose, the live line and colour on a real pseudo-terminal, plain
output when piped, and bad option values refused before any backend library is imported."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lora_parity.cli import output
from lora_parity.evidence.receipt import Check, CheckStatus
from lora_parity.verdict import explain

from .conftest import ROOT, cli

unit = pytest.mark.unit
FAKE = ("--trainer", "fake", "--sampler", "fake")


def _check(id: str, reason: str = "own reason") -> Check:
    return Check(id=id, name="n", status=CheckStatus.FAIL, observed=1.0, budget=0.01, op="<=", reason=reason)


@unit
def test_explanations_by_prefix_with_fallback_to_the_checks_reason() -> None:
    assert "stale scores" in explain.line(_check("C.parity.mean"))
    assert "target k_proj alone" in explain.line(_check("T.k_proj.cosine"))
    assert explain.line(_check("G.sampling.match", "sampled tokens differ")) == "sampled tokens differ"
    assert explain.measure("C.delta.scale") == "|scale-1|" and explain.measure("T.q_proj.scale") == "|scale-1|"
    assert explain.measure("Z.unknown") == ""


@unit
def test_counts_are_pytest_style() -> None:
    assert output.counts(["pass"] * 35 + ["fail"] * 2 + ["inconclusive"]) == "35 passed, 2 failed, 1 inconclusive"
    assert output.counts(["pass", "not_reached"]) == "1 passed, 1 not reached"


@unit
def test_failing_run_explains_itself_and_ends_with_a_count_line(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    res = cli("run", *FAKE, "--inject", "skip-sync", "--out", str(out))
    assert res.returncode == 1
    lines = res.stdout.strip().splitlines()
    assert re.fullmatch(rf"fail: 42 passed, 9 failed in \d+\.\d s · receipt {re.escape(str(out))}", lines[-1])
    assert "injected fault: skip-sync (the sync step does nothing); expected: fail, caught by C.parity.mean" \
        in res.stdout
    assert "fail C.delta.cosine, C.delta.scale, C.delta.rel_l2 (cosine undefined): follows from C.moved.sampler" \
        in res.stdout
    reason = next(x for x in lines if x.startswith("fail C.parity.mean"))
    assert "stale scores" in reason and "never reached the engine" in reason
    assert f"lora-parity report {out}" in res.stdout
    assert "|scale-1|" in next(x for x in lines if "C.delta.scale" in x)
    assert "|scale-1|" in explain.meaning("C.delta.scale")  # type: ignore[operator]
    # Piped: no colour codes, nothing wrapped at 80 columns.
    assert "\x1b[" not in res.stdout + res.stderr and max(len(x) for x in lines) > 120


@unit
def test_quiet_prints_only_the_closing_line_and_verbose_every_phase(tmp_path: Path) -> None:
    res = cli("run", *FAKE, "--quiet", "--out", str(tmp_path / "q.json"))
    assert res.returncode == 0 and res.stderr == ""
    assert re.fullmatch(r"pass: 53 passed in \d+\.\d s · receipt \S+q\.json\n", res.stdout)
    res = cli("run", *FAKE, "--verbose", "--out", str(tmp_path / "v.json"))
    assert res.returncode == 0 and "ok publish_zero" in res.stderr.replace("  ", " ")
    assert not (tmp_path / "v.log").exists()  # verbose: nothing redirected, no log


@unit
def test_selftest_prints_each_fault_and_labels_expected_errors(tmp_path: Path) -> None:
    res = cli("selftest", *FAKE, "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert re.search(r"caught skip-sync +fail: C\.parity\.mean", res.stderr)
    assert re.search(r"caught nan +expected error: ", res.stderr)
    assert re.search(r"caught crash-at=stale +expected error: .*injected crash", res.stderr)
    assert not re.search(r"^\s*error ", res.stderr, re.M)  # no bare "error base" lines
    assert re.search(r"selftest ok: 1 of 1 clean runs passed, (\d+) of \1 faults caught in \d", res.stdout)


_NOISY = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from lora_parity.cli import live
    s = live.Session("normal", "first line")
    with s:
        os.write(2, b"native fd2\\n")
        print("python stdout")
        warnings.warn("a FutureWarning", FutureWarning)
        logging.getLogger("vllm").warning("WARNING from a logger")
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('child stderr 10.0it/s]\\\\n')"])
        s.progress("base", "ok", 1.0)
    print("log:", s.keep_log(None))
""")


@unit
def test_third_party_output_goes_to_the_log(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", _NOISY], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    log = Path(res.stdout.split("log: ")[1].strip())
    text = log.read_text()
    log.unlink()
    for expected in ("native fd2", "python stdout", "a FutureWarning", "WARNING from a logger", "child stderr",
                     ):
        assert expected in text
    assert res.stdout.startswith("log: ")


def _in_pty(argv: list[str], timeout: float = 60) -> str:
    """Run `argv` on a real pseudo-terminal (stdout and stderr); return everything it wrote."""
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.environ.update({"PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "120"})
        os.environ.pop("NO_COLOR", None)
        os.chdir(ROOT)
        os.execv(argv[0], argv)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace")


_SLOW = textwrap.dedent("""
    import time
    from lora_parity.cli import live
    s = live.Session("normal", "first line")
    with s:
        s.progress("sampler.start", "ok", 1.0)
        time.sleep(1.2)
    print("done")
""")


@unit
def test_live_line_with_phase_and_elapsed_time_on_a_terminal() -> None:
    text = _in_pty([sys.executable, "-c", _SLOW])
    assert "done" in text
    assert re.search(r"first line · sampler\.start done · \d+\.\d s", text)


@unit
def test_colour_on_a_terminal(tmp_path: Path) -> None:
    text = _in_pty([sys.executable, "-m", "lora_parity", "run", *FAKE, "--inject", "skip-sync", "--out",
                    str(tmp_path / "t.json")])
    assert "\x1b[" in text and re.search(r"42 passed, 9 failed in", text)


_SPY = textwrap.dedent("""
    import sys
    from lora_parity.cli import app as cli
    sys.argv = ["lora-parity", "run", *sys.argv[1:]]
    try:
        cli.main()
    except SystemExit as e:
        heavy = [m for m in ("torch", "vllm", "transformers", "peft") if m in sys.modules]
        print("exit", e.code, "heavy", heavy)
""")


@unit
@pytest.mark.parametrize("args", [("--sampler", "foo"), ("--trainer", "foo"), ("--inject", "nope"),
                                  ("--inject", "stale-path"), ("--reference", "fp64"), ("--tp", "0"),
                                  ("--out", "EXISTING"), ("--inject", "crash-at=typo"), ("--probes", "text"),
                                  ("--probes", "NO_FILE"), ("--probes", "default-x100000000"),
                                  ("--trainer", "tinker"), ("--sampler", "tinker"),
                                  ("--trainer", "exact", "--sampler", "hf"),
                                  ("--trainer", "exact", "--sync", "merged")])
def test_bad_option_values_are_refused_before_heavy_imports(args: tuple[str, ...], tmp_path: Path) -> None:
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    argv = [a.replace("EXISTING", str(existing)).replace("NO_FILE", str(tmp_path / "none.jsonl")) for a in args]
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _SPY, *argv], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    # Refused before torch, vLLM, transformers or PEFT is imported (asserted below): about 0.4 s on an
    # idle machine (the acceptance check holds it to 2 s); the bound here only leaves room for a shared one.
    assert time.perf_counter() - start < 15.0
    assert res.stdout.strip().endswith("exit 2 heavy []"), res.stdout + res.stderr
    assert res.stderr.count("lora-parity: error:") == 1 and "Traceback" not in res.stderr


@unit
def test_selftest_runs_per_target_coverage_only_where_a_fault_needs_it(tmp_path: Path) -> None:
    from lora_parity.evidence.receipt import load
    from lora_parity.run.runner import RunOptions
    from lora_parity.run.selftest import selftest

    result = selftest(RunOptions(trainer="fake", sampler="fake"), tmp_path, faults=["skip-sync", "drop-target"])
    assert result.ok
    has_targets = {r.fault: any(c.id.startswith("T.") for c in load(Path(r.receipt))[0].checks)
                   for r in result.rows}
    assert has_targets == {"none": True, "skip-sync": False, "drop-target": True}


@unit
def test_opentelemetry_is_kept_out_unless_tracing_is_configured() -> None:
    probe = ("from lora_parity.util import lean; import sys; print(lean.skip_unused_imports())\n"
             "try:\n    import opentelemetry\n    print('imported')\nexcept ImportError:\n    print('absent')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.stdout.split() == ["['opentelemetry']", "absent"]
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT), "OTEL_SERVICE_NAME": "x"}, timeout=60)
    assert res.stdout.split()[0] == "[]"
    # The tinker SDK's HTTP client imports it: a run with a tinker backend keeps it.
    tinker = probe.replace("skip_unused_imports()", "skip_unused_imports('tinker', 'vllm')")
    res = subprocess.run([sys.executable, "-c", tinker], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert res.stdout.split() == ["[]", "imported"]


@pytest.mark.unit
def test_a_failing_run_says_which_verdict_failed_and_on_what(tmp_path: Path) -> None:
    from lora_parity.run.runner import RunOptions, execute

    skipped = execute(RunOptions(trainer="fake", sampler="fake", inject="skip-sync", out=tmp_path / "s.json")).receipt
    said = output._verdicts_line(skipped)
    assert said is not None and said.startswith("sync: fail (C.parity.mean") and "numerics: pass" in said
    token = execute(RunOptions(trainer="fake", sampler="fake", inject="one-token", out=tmp_path / "t.json")).receipt
    said = output._verdicts_line(token)
    assert said is not None and "numerics: fail (A.parity.max" in said  # (C.parity.max too: every scoring is off)
    clean = execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "c.json")).receipt
    assert output._verdicts_line(clean) is None
