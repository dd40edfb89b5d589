"""`selftest --seeds N`: the matrix once per seed on one load, the false-alarm rate of the clean runs and per
fault caught k of N with the closest margin, all computed from the receipts; on the fake backends."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.evidence.receipt import Check, CheckStatus, Receipt
from lora_parity.evidence.receipt import load as load_receipt
from lora_parity.run import selftest as st
from lora_parity.run.faults import faults_for
from lora_parity.run.runner import RunOptions

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit

FAKE = {"trainer": "fake", "sampler": "fake"}


def _check(id: str, observed: float | None, op: str, budget: float | None) -> Check:
    return Check(id=id, name="n", status=CheckStatus.PASS, observed=observed, budget=budget, op=op,  # type: ignore[arg-type]
                 reason="r")


def test_trip_ratio_is_observed_over_threshold_toward_tripping() -> None:
    assert st.trip_ratio(_check("C.parity.mean", 0.5, "<=", 0.1)) == pytest.approx(5.0)
    assert st.trip_ratio(_check("C.parity.mean", 0.02, "<=", 0.1)) == pytest.approx(0.2)
    assert st.trip_ratio(_check("B.stimulus", 0.01, ">=", 0.05)) == pytest.approx(5.0)
    assert st.trip_ratio(_check("C.moved.sampler", 2.0, ">", 1e-6)) == pytest.approx(5e-7)
    assert st.trip_ratio(_check("B.stimulus", 0.0, ">=", 0.05)) == float("inf")
    # A cosine is compared as 1 - cos against 1 - threshold: a sign flip is 2 / 0.001 past it.
    assert st.trip_ratio(_check("C.delta.cosine", -1.0, ">=", 0.999)) == pytest.approx(2000.0)
    assert st.trip_ratio(_check("T.q_proj.cosine", 0.9995, ">=", 0.999)) == pytest.approx(0.5)
    assert st.trip_ratio(_check("C.delta.cosine", None, ">=", 0.999)) is None
    assert st.trip_ratio(_check("A.zero_adapter_noop", 1e-3, "<=", 0.0)) == float("inf")


def test_margin_inverts_the_checks_that_must_pass_and_takes_the_closest() -> None:
    checks = [_check("A.parity.max", 9.0, "<=", 0.001), _check("A.parity.mean", 0.025, "<=", 0.1)]
    # one-token: A.parity.max trips by 9000x, A.parity.mean must pass and has 4x room: 4 is the closest.
    assert st.margin(checks, ("A.parity.max",), ("A.parity.mean",)) == (pytest.approx(4.0), "A.parity.mean")
    assert st.margin(checks, ("A.parity.max",), ()) == (pytest.approx(9000.0), "A.parity.max")
    assert st.margin(checks, (), ()) == (None, None)


def read_receipt(path: Path) -> Receipt:
    return load_receipt(path)[0]


def _ratio(receipt_path: str, check_id: str) -> float:
    c = next(c for c in read_receipt(Path(receipt_path)).checks if c.id == check_id)
    assert c.observed is not None and c.budget is not None
    return c.observed / c.budget if c.op == "<=" else c.budget / c.observed


def test_three_seeds_vary_probes_and_update_and_tally_from_the_receipts(tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE), tmp_path, seeds=3)
    faults = faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits)
    assert result.seeds == [0, 1, 2] and result.ok and result.false_alarms == 0
    assert [r.fault for r in result.rows] == (["none", *faults]) * 3
    receipts = {s: read_receipt(tmp_path / f"seed-{s:02d}" / "clean.json") for s in (0, 1, 2)}
    assert [receipts[s].perturbation.seed for s in (0, 1, 2)] == [0, 1, 2]  # type: ignore[union-attr]
    assert len({receipts[s].probes.digest for s in (0, 1, 2)}) == 3  # new probes per seed
    assert receipts[2].probes.seed == receipts[0].probes.seed + 2 * st.PROBE_SEED_STRIDE
    # Seed 0 is the single-seed selftest: same probes, same scores.
    single = st.selftest(RunOptions(**FAKE), tmp_path / "one", faults=[])
    assert single.seeds == [0] and (tmp_path / "one" / "clean.json").is_file()
    assert read_receipt(tmp_path / "one" / "clean.json").scores == receipts[0].scores

    # --first-seed 2: exactly seed 2 of the longer selftest, in its own seed folder.
    tail = st.selftest(RunOptions(**FAKE), tmp_path / "tail", faults=[], first_seed=2)
    assert tail.seeds == [2] and not (tmp_path / "tail" / "clean.json").exists()
    assert read_receipt(tmp_path / "tail" / "seed-02" / "clean.json").scores == receipts[2].scores

    tallies = {t.fault: t for t in result.tallies()}
    assert all(t.caught == t.runs == 3 for t in tallies.values())
    # skip-sync's margin is C.parity.mean's observed / budget in its receipt; the closest is the seeds' min.
    rows = [r for r in result.rows if r.fault == "skip-sync"]
    assert all(r.margin_check == "C.parity.mean" for r in rows)
    assert [r.margin for r in rows] == pytest.approx([_ratio(r.receipt, "C.parity.mean") for r in rows])
    assert tallies["skip-sync"].closest == min(r.margin for r in rows if r.margin is not None)
    assert tallies["skip-sync"].closest_seed == min(rows, key=lambda r: r.margin or 0).seed
    assert all(r.margin is not None and r.margin > 1 for r in rows)
    # frozen-trainer: budget / observed of B.stimulus (a '>=' check); nan: no check decides it.
    frozen = next(r for r in result.rows if r.fault == "frozen-trainer" and r.seed == 1)
    assert frozen.margin_check == "B.stimulus"
    assert tallies["nan"].closest is None and tallies["nan"].closest_check is None
    # A clean run's margin is the room left by its closest check (budget / observed), below which it fails.
    clean = result.clean_closest()
    assert clean is not None and clean.margin is not None and clean.margin > 1
    assert clean.margin == pytest.approx(1 / _ratio(clean.receipt, clean.margin_check or ""))


def _one_broken_run(monkeypatch: pytest.MonkeyPatch, seed: int, fault: str | None, inject: str | None) -> None:
    """Run `inject` instead of `fault` in seed `seed` (None: the clean run) and nothing else changes."""
    real = st.run_once

    def run_once(plan: Any, loaded: Any, fault_now: str | None, out: Path, force: bool, say: Any) -> Any:
        if plan.opts.seed == seed and fault_now == fault:
            return real(plan, loaded, inject, out, force, say)
        return real(plan, loaded, fault_now, out, force, say)

    monkeypatch.setattr(st, "run_once", run_once)


def test_a_fault_missed_in_one_seed_fails_the_selftest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _one_broken_run(monkeypatch, 1, "wrong-scale", None)  # seed 1's wrong-scale run injects nothing
    result = st.selftest(RunOptions(**FAKE), tmp_path, seeds=3, faults=["skip-sync", "wrong-scale"])
    tally = {t.fault: t for t in result.tallies()}
    assert (tally["wrong-scale"].caught, tally["wrong-scale"].runs) == (2, 3)
    assert tally["wrong-scale"].closest is not None and tally["wrong-scale"].closest < 1  # the miss is closest
    assert tally["wrong-scale"].closest_seed == 1 and tally["skip-sync"].caught == 3
    assert result.false_alarms == 0 and not result.ok


def test_a_clean_run_failing_in_one_seed_is_a_false_alarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _one_broken_run(monkeypatch, 2, None, "skip-sync")  # seed 2's clean run is broken
    result = st.selftest(RunOptions(**FAKE), tmp_path, seeds=3, faults=["skip-sync"])
    assert result.false_alarms == 1 and len(result.clean_rows) == 3 and not result.ok
    near = result.clean_closest()
    assert near is not None and near.seed == 2 and near.margin is not None and near.margin < 1
    assert all(t.caught == t.runs for t in result.tallies())


def test_repeat_per_seed(tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE), tmp_path, repeat=2, seeds=2, faults=["skip-sync"])
    assert [r.fault for r in result.rows] == ["none #1", "none #2", "skip-sync"] * 2
    assert sorted(p.name for p in (tmp_path / "seed-01").iterdir()) == [
        "clean-00.json", "clean-01.json", "fault-skip-sync.json"]
    assert result.identical_repeats and result.ok


def test_cli_seeds_prints_rates_margins_and_a_one_line_summary(tmp_path: Path) -> None:
    # As the acceptance script reads it: stdout and stderr in one stream, the last line.
    both = subprocess.run([sys.executable, "-m", "lora_parity", "selftest", "--trainer", "fake", "--sampler", "fake",
                           "--seeds", "2", "--out-dir", str(tmp_path / "both")], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=300)
    assert both.returncode == 0, both.stdout
    last = both.stdout.strip().splitlines()[-1]
    n = len(faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits))
    assert re.fullmatch(rf"selftest ok, 2 seeds: 0/2 false alarms; {n}/{n} faults caught in every seed "
                        r"\(closest: \S+ \S+ margin [0-9.e+]+\) in \d+\.\d s", last), last
    res = cli("selftest", "--trainer", "fake", "--sampler", "fake", "--seeds", "2", "--out-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert re.search(r"skip-sync\W+fail: C\.parity\.mean\W+2/2\W+[0-9.e+]+\W+C\.parity\.mean", res.stdout)
    assert re.search(r"clean\W+pass\W+2/2", res.stdout)
    assert re.search(r"caught seed 1 +skip-sync", res.stderr)
    res = cli("selftest", "--trainer", "fake", "--sampler", "fake", "--seeds", "2", "--json",
              "--out-dir", str(tmp_path / "j"))
    data = json.loads(res.stdout)
    assert data["ok"] and data["seeds"] == [0, 1] and data["false_alarms"]["rate"] == 0.0
    skip = next(f for f in data["faults"] if f["fault"] == "skip-sync")
    assert (skip["caught"], skip["runs"], skip["closest"]["check"]) == (2, 2, "C.parity.mean")
    rows = [r for r in data["rows"] if r["fault"] == "skip-sync"]
    assert skip["closest"]["margin"] == min(r["margin"] for r in rows)


def test_cli_exits_1_when_a_fault_is_missed_in_one_seed(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        import lora_parity.run.selftest as st
        real = st.run_once
        def run_once(plan, loaded, fault, out, force, say):
            return real(plan, loaded, None if (plan.opts.seed, fault) == (1, "leak") else fault, out, force, say)
        st.run_once = run_once
        sys.argv = ["lora-parity", "selftest", "--trainer", "fake", "--sampler", "fake", "--seeds", "2",
                    "--out-dir", {str(tmp_path)!r}]
        from lora_parity.cli import main
        main()
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 1, res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("selftest FAILED, 2 seeds: 0/2 false alarms;") and "(missed: leak 1/2)" in last


def test_pick_faults_keeps_the_selftest_order_and_takes_the_file_names() -> None:
    applicable = faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits)
    assert "crash-at=stale" in applicable
    picked = st.pick_faults(("wrong-scale", "crash-at-stale", "skip-sync"), applicable)
    assert picked == [f for f in applicable if f in {"wrong-scale", "crash-at=stale", "skip-sync"}]
    with pytest.raises(st.ConfigError, match=r"--faults: no-such-fault not among this run's faults: .*skip-sync"):
        st.pick_faults(("skip-sync", "no-such-fault"), applicable)


def test_faults_option_runs_the_clean_run_and_only_the_named_faults(tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE), tmp_path, seeds=2, first_seed=3, only=("skip-sync", "crash-at-stale"))
    assert [(r.seed, r.fault) for r in result.rows] == [(s, f) for s in (3, 4)
                                                          for f in ("none", "skip-sync", "crash-at=stale")]
    assert result.ok
    assert sorted(p.name for p in (tmp_path / "seed-03").iterdir()) == [
        "clean.json", "fault-crash-at-stale.json", "fault-skip-sync.json"]


def test_faults_none_runs_only_the_clean_runs(tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE), tmp_path, seeds=2, only=("none",))
    assert [(r.seed, r.fault) for r in result.rows] == [(0, "none"), (1, "none")]
    assert result.ok
    assert sorted(p.name for p in tmp_path.glob("seed-*/*.json")) == ["clean.json", "clean.json"]
    with pytest.raises(st.ConfigError, match="none not among"):  # none with a fault is no fault's name
        st.pick_faults(("none", "skip-sync"), faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits))


def test_cli_faults_option_refuses_a_name_it_does_not_run_in_one_line(tmp_path: Path) -> None:
    res = cli("selftest", "--trainer", "fake", "--sampler", "fake", "--faults", "skip-sync,gen-no-adapter",
              "--out-dir", str(tmp_path))
    assert res.returncode == 2, res.stderr  # gen-no-adapter runs only with --probes sampled
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "gen-no-adapter not among this run's faults" in res.stderr
    assert not list(tmp_path.glob("**/*.json"))


def test_cli_faults_option_refuses_an_unknown_name_before_any_backend_is_imported() -> None:
    spy = ("import sys\nfrom lora_parity.cli import app as cli\n"
           "sys.argv = ['lora-parity', 'selftest', '--faults', 'skip-sync,no-such-fault']\n"
           "try:\n    cli.main()\nexcept SystemExit as e:\n"
           "    heavy = ('torch', 'vllm', 'transformers', 'peft')\n"
           "    print('exit', e.code, sorted(m for m in heavy if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", spy], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.stdout.strip().endswith("exit 2 []"), res.stdout + res.stderr
    assert "no-such-fault not among this run's faults" in res.stderr and "Traceback" not in res.stderr


def test_drop_target_gets_its_coverage_where_the_config_leaves_coverage_off(tmp_path: Path) -> None:
    """The GPU configs set per_target: false; drop-target's declared check is per-target, so its run still covers
    the dropped target (and only it) instead of leaving the fault unmeasured; the clean run keeps the config's off."""
    off = tmp_path / "off.yaml"
    off.write_text((ROOT / "configs" / "tiny-qwen3.yaml").read_text() + "\nper_target: false\n")
    result = st.selftest(RunOptions(**FAKE, model=str(off)), tmp_path / "out", faults=["drop-target"])
    assert result.ok, result.rows
    clean, dropped = (load_receipt(Path(r.receipt))[0] for r in result.rows)
    assert not [p.name for p in clean.phases if p.name.startswith("target.")]
    assert [p.name for p in dropped.phases if p.name.startswith("target.")] == ["target.q_proj"]
    assert any(c.id == "T.q_proj.moved" and c.status == CheckStatus.FAIL for c in dropped.checks)
