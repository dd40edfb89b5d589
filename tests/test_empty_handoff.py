"""No check passes on nothing, through the real pipeline (issue 51): the fault `empty-handoff` hands the exact sync
check (X) the trainer's tensors as an empty set, as a transport that dropped an adapter's checksum reads as verified
while verifying nothing (miles #2730, sglang #36190). The run then loads no fresh adapter, records the fresh phase
empty, and X is not run (0 elements): the verdict is inconclusive, never a pass, and `verify` recomputes it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lora_parity import backends
from lora_parity.backends import fake
from lora_parity.backends.base import BackendTraits, TensorReadingTrainer
from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict, compute_digest
from lora_parity.models import adapter_files as af
from lora_parity.models import config, export_check
from lora_parity.report import pr
from lora_parity.run import selftest as st
from lora_parity.run.faults import FAULTS, faults_for, not_applicable_to_trainer, require_applies
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import execute
from lora_parity.util.errors import ConfigError, ReceiptError
from lora_parity.verdict import checks, findings
from lora_parity.verdict.verify import verify

from .conftest import cli

pytestmark = pytest.mark.unit

FAKE: dict[str, Any] = {"trainer": "fake", "sampler": "fake", "per_target": False}
HANDOFF = "empty-handoff"


def run(tmp_path: Path, **kw: Any) -> tuple[Receipt, Path]:
    out = tmp_path / f"{kw.get('inject') or 'clean'}.json"
    return execute(RunOptions(**FAKE, out=out, **kw)).receipt, out


def by_id(receipt: Receipt) -> dict[str, Any]:
    return {c.id: c for c in receipt.checks}


def test_an_empty_handoff_runs_x_over_nothing_and_the_run_cannot_pass(tmp_path: Path) -> None:
    receipt, out = run(tmp_path, inject=HANDOFF)
    x = by_id(receipt)["X.sync.identical"]
    assert x.status == CheckStatus.NOT_REACHED and x.elements == 0 and x.observed is None
    assert x.reason == "not run: it compared nothing (0 elements): the trainer handed no LoRA tensors"
    assert receipt.verdict == Verdict.INCONCLUSIVE and receipt.verdicts is not None
    assert receipt.verdicts.sync.verdict == Verdict.INCONCLUSIVE and receipt.verdicts.sync.decided_by == [x.id]
    # Every other check passes: X alone says the hand-off carried nothing.
    assert [c.id for c in receipt.checks if c.status != CheckStatus.PASS] == ["X.sync.identical"]
    # No fresh adapter was written, published or scored; the fresh phase ran and recorded no sequence.
    assert receipt.scores["fresh"] == [] and "score.fresh" not in receipt.timings
    assert [p.status.value for p in receipt.phases if p.name == "fresh"] == ["ok"]
    assert "X.synced_vs_fresh" not in receipt.comparisons
    assert receipt.worst_positions is not None and "X.synced_vs_fresh" not in receipt.worst_positions
    # The synced file was held to the same empty set: it says so, and nothing about the file's own tensors.
    synced = next(a for a in receipt.adapters if a.version == 1)
    assert synced.file_differences == [export_check.NOTHING]
    assert verify(out).verdict == Verdict.INCONCLUSIVE  # recomputed from the raw scores


def test_a_clean_run_loads_the_fresh_adapter_and_x_passes_over_every_position(tmp_path: Path) -> None:
    receipt, out = run(tmp_path)
    x = by_id(receipt)["X.sync.identical"]
    assert x.status == CheckStatus.PASS and x.elements == receipt.probes.num_scored_positions
    assert len(receipt.scores["fresh"]) == len(receipt.probes.sequences)
    assert receipt.verdict == Verdict.PASS and verify(out).verdict == Verdict.PASS


def test_in_place_and_with_a_step_update_x_is_still_not_run(tmp_path: Path) -> None:
    for kw in ({"sync": "inplace"}, {"update": "step"}):  # --sync tensors: test_sglang_unit's stand-in server
        receipt, _ = run(tmp_path / "-".join(map(str, kw.values())), inject=HANDOFF, **kw)
        x = by_id(receipt)["X.sync.identical"]
        assert (x.status, x.elements, receipt.verdict) == (CheckStatus.NOT_REACHED, 0, Verdict.INCONCLUSIVE), kw


def _scores(repeat: float) -> dict[str, list[list[float]]]:
    base = [[-1.0, -2.0, -3.0]]
    scores = {k: base for k in ("base", "zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat", "stale")}
    scores["trainer_updated"] = scores["updated"] = [[-1.5, -2.5, -3.5]]
    scores["updated_repeat"] = [[x + repeat for x in scores["updated"][0]]]
    scores["fresh"] = []
    return scores


def test_evaluate_turns_an_empty_fresh_phase_into_x_over_nothing_whatever_the_sampler() -> None:
    budgets = config.load(None).budgets
    for repeat in (0.0, 1e-9):  # also on an engine that does not repeat itself to the bit (X absent there else)
        ev = checks.evaluate(_scores(repeat), budgets, errored=False)
        x = {c.id: c for c in ev.checks}["X.sync.identical"]
        assert (x.status, x.elements, x.observed) == (CheckStatus.NOT_REACHED, 0, None)
        assert x.reason.endswith(checks.HANDED_NOTHING) and "X.synced_vs_fresh" not in ev.comparisons
        assert ev.verdict == Verdict.INCONCLUSIVE
    assert checks.handed_nothing({"fresh": []}) and not checks.handed_nothing({"fresh": [[-1.0]]})
    assert not checks.handed_nothing({})


def _reseal(path: Path, edit: Any) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    data["digest"] = compute_digest(data)
    edited = path.with_name(f"edited-{path.name}")
    edited.write_text(json.dumps(data))
    return edited


def test_verify_catches_a_receipt_edited_around_the_empty_handoff(tmp_path: Path) -> None:
    _, handed = run(tmp_path, inject=HANDOFF)
    _, clean = run(tmp_path)
    data = json.loads(handed.read_text())
    data["checks"] = [c for c in data["checks"] if c["id"] != "X.sync.identical"]
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match="digest mismatch"):  # an edit without a new digest
        verify(tampered)

    def passing_x(d: dict[str, Any]) -> None:  # X claimed to pass over nothing, the verdict a pass
        x = next(c for c in d["checks"] if c["id"] == "X.sync.identical")
        x.update(status="pass", observed=0.0, reason="0 <= 0", elements=0)
        d["verdict"], d["verdicts"]["sync"] = "pass", {"verdict": "pass", "decided_by": [c["id"] for c in d["checks"]]}

    def dropped(d: dict[str, Any]) -> None:  # the fresh phase's record removed: X is then no check at all
        del d["scores"]["fresh"]

    def emptied(d: dict[str, Any]) -> None:  # a clean receipt's fresh scores emptied: X is then not run
        d["scores"]["fresh"] = []

    def no_phase(d: dict[str, Any]) -> None:  # an empty fresh record with no fresh phase behind it
        d["phases"] = [p for p in d["phases"] if p["name"] != "fresh"]

    for path, edit, says in ((handed, passing_x, "check X.sync.identical does not reproduce"),
                             (handed, dropped, "check X.sync.identical is not backed by the raw scores"),
                             (clean, emptied, "comparison X.synced_vs_fresh is not backed by the raw scores"),
                             (handed, no_phase, "scores.fresh is empty, but no fresh phase ran")):
        with pytest.raises(ReceiptError, match=re.escape(says)):
            verify(_reseal(path, edit))
    # Only the fresh phase may be empty: another phase recorded empty is not aligned with the probes.
    with pytest.raises(ReceiptError, match=r"scores\.updated_repeat is not aligned with the probes"):
        verify(_reseal(handed, lambda d: d["scores"].update(updated_repeat=[])))


def test_the_selftest_lists_and_catches_it(tmp_path: Path) -> None:
    assert HANDOFF in faults_for("new-id", trainer=fake.FakeTrainer.traits)
    result = st.selftest(RunOptions(trainer="fake", sampler="fake"), tmp_path, faults=[HANDOFF])
    (row,) = [r for r in result.rows if r.fault == HANDOFF]
    assert row.caught and row.expected == "inconclusive: X.sync.identical" and result.ok
    assert row.observed == "inconclusive: X.sync.identical"


def test_the_judge_takes_a_check_over_nothing_only_for_an_inconclusive_fault(tmp_path: Path) -> None:
    receipt, _ = run(tmp_path, inject=HANDOFF)
    n = receipt.probes.num_scored_positions
    targets = list(config.load(None).adapter.targets)

    def judged(fault: str, r: Receipt) -> bool:
        return st.judge(fault, r, set(), set(), targets, n).caught

    assert judged(HANDOFF, receipt)
    # A declared check that was not reached because its phases did not run (elements unknown) catches nothing.
    unreached = [c.model_copy(update={"elements": None, "reason": "not reached: the phases it needs did not run"})
                 if c.id == "X.sync.identical" else c for c in receipt.checks]
    assert not judged(HANDOFF, receipt.model_copy(update={"checks": unreached}))
    # The run must end inconclusive: a pass (X dropped) is missed.
    passed = receipt.model_copy(update={"checks": [c for c in receipt.checks if c.id != "X.sync.identical"],
                                        "verdict": Verdict.PASS})
    assert not judged(HANDOFF, passed)
    # A fault that must fail is not caught by a declared check over nothing, even where the verdict fails:
    # partial-export's X (beside C) compared nothing here, and C passed.
    assert FAULTS["partial-export"].verdict == "fail" and "X.sync.identical" in FAULTS["partial-export"].caught_by[0]
    assert not judged("partial-export", receipt.model_copy(update={"verdict": Verdict.FAIL}))


def test_it_applies_only_where_x_runs() -> None:
    for mode in ("new-id", "inplace", "tensors"):
        assert HANDOFF in faults_for(mode)
    for mode in ("merged", "memory"):  # no adapter is published: no fresh load, no X
        assert HANDOFF not in faults_for(mode)
    assert HANDOFF not in faults_for("new-id", reads_tensors=False)
    assert not_applicable_to_trainer(HANDOFF, True) is None and not_applicable_to_trainer("skip-sync", False) is None
    with pytest.raises(ConfigError, match="does not apply to trainer 'tinker': its LoRA tensors cannot be read"):
        require_applies(HANDOFF, BackendTraits(), "tinker", reads_tensors=False, trainer_name="tinker")
    require_applies("skip-sync", BackendTraits(), "tinker", reads_tensors=False, trainer_name="tinker")
    pytest.importorskip("tinker", reason="the tinker SDK (the 'tinker' extra) is not installed")
    from lora_parity.backends.tinker import TinkerTrainer

    assert not issubclass(TinkerTrainer, TensorReadingTrainer)
    assert issubclass(fake.FakeTrainer, TensorReadingTrainer)


class UnreadableTrainer(fake.FakeTrainer):
    """The fake trainer, but its tensors cannot be read (as Tinker's service weights): no fresh phase, no X."""

    lora_tensors = None  # type: ignore[assignment]


def test_a_trainer_whose_tensors_cannot_be_read_is_refused_and_the_selftest_leaves_it_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(backends.TRAINERS, "unreadable", UnreadableTrainer)
    assert not issubclass(UnreadableTrainer, TensorReadingTrainer)
    opts = {"trainer": "unreadable", "sampler": "fake", "per_target": False}
    with pytest.raises(ConfigError, match="does not apply to trainer 'unreadable': its LoRA tensors cannot be read"):
        execute(RunOptions(**opts, inject=HANDOFF, out=tmp_path / "r.json"))
    result = st.selftest(RunOptions(**opts), tmp_path / "st")
    assert result.ok and HANDOFF not in [r.fault for r in result.rows] and len(result.rows) > 10
    clean = verify(Path(result.rows[0].receipt)).receipt
    assert "fresh" not in clean.scores and "X.sync.identical" not in by_id(clean)
    with pytest.raises(ConfigError, match=f"--faults: {HANDOFF} not among this run's faults"):
        st.selftest(RunOptions(**opts), tmp_path / "st2", only=(HANDOFF,))


def test_the_terminal_and_the_report_say_which_check_was_not_run_and_why(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--inject", HANDOFF,
              "--out", str(out))
    assert res.returncode == 1, res.stderr
    assert ("not run X.sync.identical: it compared nothing (0 elements): the trainer handed no LoRA tensors; a "
            "comparison over nothing verifies nothing, so the run cannot pass") in res.stdout
    assert "sync: inconclusive (X.sync.identical)" in res.stdout
    assert "the adapter file the sync handed the engine was compared with nothing" in res.stdout
    assert re.search(r"^inconclusive: \d+ passed, 1 not reached in ", res.stdout.splitlines()[-1])
    md = pr.report_markdown(verify(out).receipt, "r.json")
    assert "1 of" in md and "checks not reached (`X.sync.identical` compared nothing)" in md
    row = next(x for x in md.splitlines() if x.startswith("| X.sync.identical") and "what it means" not in x)
    assert "not run: it compared nothing (0 elements): the trainer handed no LoRA tensors" in row
    assert "a comparison handed an empty set verifies nothing" in row and "not the trainer's" not in row


def test_the_file_side_held_to_nothing_says_nothing_of_the_files_tensors(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    af.write_adapter(folder, {"r": 2, "lora_alpha": 4}, {"x.lora_A.weight": af.Tensor.from_floats("F32", [1], [1.0])})
    assert export_check.differences(folder, {}, 2, 4.0) == [export_check.NOTHING]
    assert export_check.differences(folder, {}, 3, 4.0) == ["r is 2, the trainer's 3", export_check.NOTHING]
    synced = [type("A", (), {"version": 1, "file_differences": [export_check.NOTHING]})()]
    line = findings.file_line(synced, set())
    assert line is not None and "compared with nothing" in line and "a wrong export" not in line
