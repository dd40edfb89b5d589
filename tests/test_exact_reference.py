"""The exact reference (E): where the sampler's arithmetic is mirrored bit for bit, the engine must equal the
mirror with the trainer's tensors at every point; a fault of any size in what the engine reads fails, names its
mechanism and place, and a mirror that does not reproduce the start point makes no check at all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lora_parity.backends import fake
from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict
from lora_parity.models.config import profile_budgets
from lora_parity.run import layer_coverage
from lora_parity.run import selftest as st
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import execute
from lora_parity.verdict import checks, exact_reference, findings
from lora_parity.verdict.verify import verify

FAKE: dict[str, Any] = {"trainer": "fake", "sampler": "fake"}


@pytest.fixture
def mirrored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(fake.FakeSampler, "mirrored", True)
    yield


def engine_reads(monkeypatch: pytest.MonkeyPatch, wrong) -> None:
    """Plant a fault in what the fake engine reads from every adapter file (its fresh load for X too)."""
    right = fake._coefficients
    monkeypatch.setattr(fake, "_coefficients", lambda config, tensors: wrong(right(config, tensors)))


def run(tmp_path: Path, **kw) -> Receipt:
    result = execute(RunOptions(**FAKE, out=tmp_path / "r.json", **kw))
    assert verify(tmp_path / "r.json").verdict == result.receipt.verdict  # verify derives E from the raw scores
    return result.receipt


def status(receipt: Receipt) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in receipt.checks}


def test_a_clean_run_equals_the_mirror_at_every_point(mirrored: None, tmp_path: Path) -> None:
    receipt = run(tmp_path)
    assert receipt.verdict == Verdict.PASS
    assert receipt.exact_reference is not None and receipt.exact_reference.status == "scored"
    e = {k: v for k, v in status(receipt).items() if k.startswith("E.")}
    targets = [k.split(".")[1] for k in receipt.scores if k.startswith("target.") and k.endswith(".sampler")]
    assert len(targets) == 7 and set(e) == {"E.updated.identical"} | {f"E.target.{k}.identical" for k in targets}
    assert all(s == CheckStatus.PASS for s in e.values())
    assert receipt.comparisons["E.zero"].max_abs == 0 and "exact_reference" in [p.name for p in receipt.phases]


def test_a_one_percent_scale_in_what_the_engine_reads_fails_and_is_named_a_scale(
        mirrored: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine_reads(monkeypatch, lambda c: {k: 0.99 * v for k, v in c.items()})
    receipt = run(tmp_path)
    s = status(receipt)
    assert s["X.sync.identical"] == CheckStatus.PASS  # every load reads the same wrong way: X cannot see it
    assert all(v == CheckStatus.FAIL for k, v in s.items() if k.startswith("E."))
    assert receipt.verdicts is not None and receipt.verdicts.sync.verdict == Verdict.FAIL
    first = findings.of_receipt(receipt)[0]
    assert "a scale: it applies every update at 0.9900 of the trainer's, in every module" in first
    assert not any(line.startswith("delivered, computes differently") for line in findings.of_receipt(receipt))


def test_one_module_the_engine_drops_fails_only_there_and_is_named(
        mirrored: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine_reads(monkeypatch, lambda c: {k: 0.0 if k == "down_proj" else v for k, v in c.items()})
    receipt = run(tmp_path)
    failed = {k for k, v in status(receipt).items() if k.startswith("E.") and v == CheckStatus.FAIL}
    assert failed == {"E.updated.identical", "E.target.down_proj.identical"}
    first = findings.of_receipt(receipt)[0]
    assert "down_proj (at 0 of the trainer's change), the whole update" in first and "2 of 8 points" in first


def test_a_swap_the_engine_makes_is_named_a_swap(mirrored: None, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    engine_reads(monkeypatch, lambda c: c | {"k_proj": c.get("v_proj", 0.0), "v_proj": c.get("k_proj", 0.0)})
    receipt = run(tmp_path)
    assert "a swap: the engine's change under k_proj is the reference's under v_proj" in findings.of_receipt(receipt)[0]


def test_a_mirror_that_misses_the_start_point_makes_no_check(mirrored: None, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    scorer = fake.FakeSampler.exact_scorer

    def off_by_a_little(self, base=None):  # a mirror of another engine version: it differs already at the start point
        score = scorer(self, base)
        return lambda seqs, states: [[[x - 1e-6 for x in row] for row in s] for s in score(seqs, states)]

    monkeypatch.setattr(fake.FakeSampler, "exact_scorer", off_by_a_little)
    receipt = run(tmp_path)
    assert receipt.comparisons["E.zero"].max_abs > 0
    assert not [k for k in status(receipt) if k.startswith("E.")] and receipt.verdict == Verdict.PASS


def test_where_no_mirror_exists_or_it_is_off_the_receipt_says_why(mirrored: None, tmp_path: Path) -> None:
    off = run(tmp_path, exact_reference=False)
    assert off.exact_reference is not None and off.exact_reference.reason == "--no-exact-reference"
    assert not [k for k in off.scores if k.startswith("exact.")]
    fake.FakeSampler.mirrored = False  # the fixture puts it back
    plain = run(tmp_path, force=True)
    assert plain.exact_reference is not None and plain.exact_reference.status == "skipped"
    assert "mirrored only where a unit test asks" in plain.exact_reference.reason


def test_the_selftest_with_a_mirror_still_judges_every_run_right(mirrored: None, tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE), tmp_path)
    assert result.ok, [r for r in result.rows if not r.caught]
    assert Receipt.model_validate_json((tmp_path / "clean.json").read_text()).exact_reference.status == "scored"


def test_layer_groups_are_named_from_the_scores_alone() -> None:
    zero = [[-1.0, -2.0, -3.0]]
    scores = {"zero": zero, "exact.zero": zero, "updated": [[-1.1, -2.1, -3.0]], "exact.updated": [[-1.2, -2.2, -3.1]],
              "target.down_proj@15-17.sampler": zero, "exact.target.down_proj@15-17": [[-1.1, -2.0, -3.2]],
              "target.q_proj.sampler": [[-1.1, -2.0, -3.0]], "exact.target.q_proj": [[-1.1, -2.0, -3.0]]}
    ev = checks.evaluate(scores, profile_budgets("bf16"), errored=False)
    assert [c.id for c in ev.checks if c.id.startswith("E.") and c.status == CheckStatus.FAIL] == [
        "E.updated.identical", "E.target.down_proj@15-17.identical"]
    line = exact_reference.lines(scores, {c.id for c in ev.checks if c.status == CheckStatus.FAIL})[0]
    assert "down_proj in layers 15-17 (at 0 of the trainer's change)" in line


class _LayeredTrainer:
    def layers(self) -> list[int]:
        return list(range(12))

    def restricted_to(self, layers):  # pragma: no cover - not entered here
        raise AssertionError


def _layered_run(scores: dict[str, list[list[float]]]) -> SimpleNamespace:
    return SimpleNamespace(trainer=_LayeredTrainer(), per_layer=True, steps=False, scores=scores,
                           covered_targets=["q_proj", "down_proj"])


def test_per_layer_coverage_runs_only_where_the_engine_parts_from_the_mirror() -> None:
    zero, moved, other = [[-1.0, -2.0]], [[-1.5, -2.0]], [[-1.4, -2.0]]
    plain = {"zero": zero, "target.q_proj.sampler": moved, "target.down_proj.sampler": moved}
    assert len(layer_coverage.groups_of(_layered_run(plain))) == 8  # no mirror: every target in 4 groups of 3
    exact = plain | {"exact.zero": zero, "exact.target.q_proj": moved, "exact.target.down_proj": other}
    assert {k for k, _ in layer_coverage.groups_of(_layered_run(exact))} == {"down_proj"}
    everywhere = exact | {"exact.target.q_proj": other}
    assert {k for k, _ in layer_coverage.groups_of(_layered_run(everywhere))} == {"q_proj"}
    assert layer_coverage.groups_of(_layered_run(exact | {"exact.target.down_proj": moved})) == []
    missed_start = everywhere | {"exact.zero": [[-1.0, -2.1]]}  # no mirror at the start point: coverage as without
    assert len(layer_coverage.groups_of(_layered_run(missed_start))) == 8
