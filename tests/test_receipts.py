import json
from pathlib import Path

import pytest

from lora_parity.evidence import receipt as rc
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ReceiptError
from lora_parity.verdict.verify import verify

from .conftest import cli

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def fake_receipt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("r") / "fake.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=out, revision="abc123"))
    return out


def rewrite(path: Path, dst: Path, mutate, reseal: bool = True) -> Path:
    data = json.loads(path.read_text())
    mutate(data)
    if reseal:
        data["digest"] = rc.compute_digest(data)
    dst.write_text(json.dumps(data))
    return dst


def test_round_trip_and_digest(fake_receipt: Path) -> None:
    r, data = rc.load(fake_receipt)
    assert r.digest == rc.compute_digest(data)
    assert r.revision.commit == "abc123" and r.revision.source == "flag"
    assert r.verdict == rc.Verdict.PASS
    assert set(r.scores) >= {"base", "zero", "zero_repeat", "trainer_zero", "trainer_updated", "stale", "updated"}
    assert verify(fake_receipt).verdict == rc.Verdict.PASS


def test_receipt_is_strict(fake_receipt: Path, tmp_path: Path) -> None:
    extra = rewrite(fake_receipt, tmp_path / "x.json", lambda d: d.update(surprise=1))
    with pytest.raises(ReceiptError, match="does not match the receipt schema"):
        rc.load(extra)
    wrong_type = rewrite(fake_receipt, tmp_path / "y.json", lambda d: d["budgets"].update(mean="0.05"))
    with pytest.raises(ReceiptError, match=r"budgets\.mean"):
        rc.load(wrong_type)


def test_tampered_score_is_a_digest_mismatch(fake_receipt: Path, tmp_path: Path) -> None:
    bad = rewrite(fake_receipt, tmp_path / "t.json", lambda d: d["scores"]["updated"][0].__setitem__(0, -1.0),
                  reseal=False)
    with pytest.raises(ReceiptError, match="digest mismatch"):
        verify(bad)


def test_resealed_tampering_does_not_reproduce(fake_receipt: Path, tmp_path: Path) -> None:
    # A forger who recomputes the digest still cannot change a score without the statistics noticing.
    bad = rewrite(fake_receipt, tmp_path / "t.json", lambda d: d["scores"]["updated"][0].__setitem__(0, -1.0))
    with pytest.raises(ReceiptError, match="does not reproduce"):
        verify(bad)
    flipped = rewrite(fake_receipt, tmp_path / "v.json", lambda d: d.update(verdict="fail"))
    with pytest.raises(ReceiptError, match="verdict"):
        verify(flipped)


def test_write_is_atomic_and_never_overwrites(fake_receipt: Path, tmp_path: Path) -> None:
    r, _ = rc.load(fake_receipt)
    dst = tmp_path / "out.json"
    rc.write_atomic(r, dst)
    dst.write_text("someone else's file")
    # A path taken after the run's check is left as it is; the receipt goes beside it, never lost.
    assert rc.write_atomic(r, dst) == tmp_path / "out.1.json"
    assert dst.read_text() == "someone else's file" and rc.load(tmp_path / "out.1.json")[0] == r
    assert rc.write_atomic(r, dst, force=True) == dst
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.1.json", "out.json"]


def test_verify_exit_codes(fake_receipt: Path, tmp_path: Path) -> None:
    assert cli("verify", str(fake_receipt)).returncode == 0
    out = tmp_path / "fail.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--inject", "skip-sync", "--out", str(out))
    assert res.returncode == 1, res.stderr
    assert cli("verify", str(out)).returncode == 1
    truncated = tmp_path / "trunc.json"
    truncated.write_bytes(fake_receipt.read_bytes()[:500])
    res = cli("verify", str(truncated))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "not valid JSON" in res.stderr and "Traceback" not in res.stderr
    res = cli("verify", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "cannot read" in res.stderr


def test_verify_json_output(fake_receipt: Path) -> None:
    res = cli("verify", str(fake_receipt), "--json")
    assert json.loads(res.stdout) == {"receipt": str(fake_receipt), "intact": True, "verdict": "pass",
                                      "signature": "unsigned"}
