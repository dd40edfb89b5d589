"""Issue 18: every failure path keeps its promise (receipt, verify, config, output rows, and trust)."""

from __future__ import annotations

import base64
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lora_parity.evidence import outpath, signing
from lora_parity.evidence import receipt as rc
from lora_parity.evidence.receipt_io import MAX_RECEIPT_BYTES, read_bounded
from lora_parity.models import config
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError, ReceiptError, ReceiptExistsError
from lora_parity.verdict import breakdown, checks, lifecycle
from lora_parity.verdict.verify import verify

from .conftest import ROOT, cli

unit = pytest.mark.unit


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fail") / "fake.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False))
    return out


def reseal(data: dict[str, Any], dst: Path) -> Path:
    data = {**data, "digest": rc.compute_digest(data)}
    dst.write_text(json.dumps(data, indent=1))
    return dst


def errored_like(data: dict[str, Any], phases: list[dict[str, Any]], scores: dict[str, Any]) -> dict[str, Any]:
    """The receipt a run that stopped with an error outside the phases writes."""
    budgets = rc.Budgets.model_validate(data["budgets"])
    ev = checks.evaluate(scores, budgets, errored=True)
    worst = checks.compute_worst_positions(scores, data["probes"]["sequences"])
    error_breakdown = breakdown.compute(scores)
    return {**data, "phases": phases, "scores": scores, "error": "setup: ValueError: truncated checkpoint",
            "comparisons": {k: v.model_dump(mode="json") for k, v in ev.comparisons.items()},
            "deltas": {k: v.model_dump(mode="json") for k, v in ev.deltas.items()},
            "checks": [c.model_dump(mode="json") for c in ev.checks], "verdict": ev.verdict.value,
            "verdicts": ev.verdicts.model_dump(mode="json"),
            "noise": ev.noise.model_dump(mode="json") if ev.noise else None,
            "thresholds": {k: v.model_dump(mode="json") for k, v in (ev.thresholds or {}).items()},
            "worst_positions": {k: [w.model_dump(mode="json") for w in v] for k, v in worst.items()},
            "breakdown": {k: v.model_dump(mode="json") for k, v in error_breakdown.items()},
            "lifecycle": [r.model_dump(mode="json") for r in lifecycle.derive(
                data["sampler"]["backend"], data["sampler"]["settings"],
                [rc.PhaseRecord.model_validate(p) for p in phases])]}


# --- error and phase statuses -------------------------------------------------------------------

@unit
def test_setup_error_with_no_phase_is_intact_error(fake: Path, tmp_path: Path) -> None:
    data = errored_like(json.loads(fake.read_text()), phases=[], scores={})
    path = reseal(data, tmp_path / "setup.json")
    assert verify(path).verdict == rc.Verdict.ERROR
    res = cli("verify", str(path))
    assert res.returncode == 1, res.stderr
    assert "intact; verdict error" in res.stdout


@unit
def test_error_after_all_phases_ok_is_intact_error(fake: Path, tmp_path: Path) -> None:
    data = json.loads(fake.read_text())
    assert all(p["status"] == "ok" for p in data["phases"])
    path = reseal(errored_like(data, phases=data["phases"], scores=data["scores"]), tmp_path / "late.json")
    assert verify(path).verdict == rc.Verdict.ERROR


@unit
def test_failed_phase_without_error_still_disagrees(fake: Path, tmp_path: Path) -> None:
    data = json.loads(fake.read_text())
    data["phases"][-1] = {**data["phases"][-1], "status": "error", "message": "boom"}
    with pytest.raises(ReceiptError, match="error and phase statuses disagree"):
        verify(reseal(data, tmp_path / "x.json"))


def _tiny_checkpoint(tmp_path: Path) -> Path:
    """The tiny-qwen3 checkpoint's config.json, with its safetensors cut to half."""
    from lora_parity.models import synthetic

    src = synthetic.materialize(config.load("tiny-qwen3"))
    dst = tmp_path / "truncated"
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    weights = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return dst


@pytest.mark.cpu_e2e
@pytest.mark.parametrize("case", ["truncated-safetensors", "config-with-only-vocab-size"])
def test_real_setup_error_receipt_verifies_as_error(case: str, tmp_path: Path) -> None:
    if case == "truncated-safetensors":
        model = _tiny_checkpoint(tmp_path)
    else:
        model = tmp_path / "vocab-only"
        model.mkdir()
        (model / "config.json").write_text('{"vocab_size": 64}')
        # A readable header with no tensors passes preflight (an unreadable one is refused there); the
        # load then fails in setup.
        header = b'{"__metadata__":{}}'
        (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    out = tmp_path / "r.json"
    res = cli("run", "--model", str(model), "--trainer", "hf", "--sampler", "hf", "--out", str(out))
    assert res.returncode == 2, res.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "error" and data["error"].startswith("setup:") and data["phases"] == []
    assert case != "truncated-safetensors" or "SafetensorError" in data["error"]
    res = cli("verify", str(out))
    assert res.returncode == 1, res.stderr
    assert "intact; verdict error" in res.stdout


# --- what verify reads --------------------------------------------------------------------------

@unit
def test_verify_dev_zero_refused_at_once() -> None:
    start = time.perf_counter()
    res = cli("verify", "/dev/zero")
    assert res.returncode == 2
    assert "not a regular file" in res.stderr and "unexpected" not in res.stderr
    assert time.perf_counter() - start < 30


@unit
def test_verify_fifo_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(ReceiptError, match="not a regular file"):
        read_bounded(fifo)
    res = subprocess.run([sys.executable, "-m", "lora_parity", "verify", str(fifo)], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "not a regular file" in res.stderr


@unit
def test_size_cap_is_documented_close_to_real_sizes(tmp_path: Path) -> None:
    largest = max(p.stat().st_size for p in (ROOT / "receipts").glob("*.json"))
    assert 100 * largest < MAX_RECEIPT_BYTES <= 64 * 2**20
    assert f"{MAX_RECEIPT_BYTES // 2**20} MiB" in (ROOT / "README.md").read_text()
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_RECEIPT_BYTES + 1)  # sparse: costs no disk
    start = time.perf_counter()
    with pytest.raises(ReceiptError, match="larger than a receipt can be"):
        rc.load(big)
    assert time.perf_counter() - start < 1


@unit
def test_duplicate_verdict_key_is_refused(fake: Path, tmp_path: Path) -> None:
    text = fake.read_text()
    assert '"verdict": "pass"' in text
    dup = tmp_path / "dup.json"
    dup.write_text(text.replace("{", '{\n "verdict": "fail",', 1))  # the last "verdict" (pass) would win
    res = cli("verify", str(dup))
    assert res.returncode == 2 and "duplicate key 'verdict'" in res.stderr


@unit
@pytest.mark.parametrize("version", [True, 1.0])
def test_schema_version_must_be_the_integer_1(fake: Path, tmp_path: Path, version: Any) -> None:
    data = json.loads(fake.read_text())
    path = reseal({**data, "schema_version": version}, tmp_path / "v.json")
    with pytest.raises(ReceiptError, match="schema_version"):
        verify(path)


@unit
def test_overflowing_score_names_the_field(fake: Path, tmp_path: Path) -> None:
    data = json.loads(fake.read_text())
    phase = next(iter(data["scores"]))
    data["scores"][phase][0][1] = "OVERFLOW"
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(data).replace('"OVERFLOW"', "1e400"))
    res = cli("verify", str(path))
    assert res.returncode == 2
    assert f"scores.{phase}.0.1: a number too large for a float" in res.stderr
    assert "unexpected" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


@unit
def test_infinite_budget_in_yaml_names_the_field(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "tiny-qwen3.yaml").read_text()
    assert "  max: " in text
    cfg = tmp_path / "inf.yaml"
    cfg.write_text("\n".join(("  max: .inf" if line.startswith("  max: ") else line) for line in text.splitlines()))
    with pytest.raises(ConfigError, match=r"budgets\.max: not a finite number"):
        config.load(str(cfg))
    res = cli("run", "--model", str(cfg), "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "r.json"))
    assert res.returncode == 2 and "budgets.max: not a finite number" in res.stderr
    assert "unexpected" not in res.stderr


# --- paths printed literally --------------------------------------------------------------------

@unit
def test_markup_in_paths_is_printed_literally(tmp_path: Path) -> None:
    folder = tmp_path / "d["
    folder.mkdir()
    out = folder / "b]c[red]:thumbs_up:.json"  # "[/b]", "c[red]" and an emoji code, all literal
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert f"receipt {out}" in res.stdout
    res = cli("verify", str(out))
    assert res.returncode == 0 and "MarkupError" not in res.stderr
    assert f"{out}: intact" in res.stdout
    out.write_text("{")
    res = cli("verify", str(out))
    assert res.returncode == 2 and str(out) in res.stderr and "unexpected" not in res.stderr


# --- --out preflight, lock and fallback ---------------------------------------------------------

@unit
def test_out_folder_with_force_refused_before_the_run(tmp_path: Path) -> None:
    said: list[str] = []
    with pytest.raises(ConfigError, match="is a folder"):
        execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path, force=True, per_target=False),
                progress=lambda phase, status, s: said.append(phase))
    assert said == []


@unit
def test_out_not_writable_or_full_refused_at_preflight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(outpath.tempfile, "NamedTemporaryFile", read_only)
        with pytest.raises(ConfigError, match=r"not writable.*Read-only file system"):
            outpath.check_writable(tmp_path / "r.json", force=False)
    with monkeypatch.context() as m:
        m.setattr(outpath.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
        with pytest.raises(ConfigError, match="free"):
            outpath.check_writable(tmp_path / "r.json", force=False)
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(ReceiptExistsError):
        outpath.check_writable(tmp_path / "r.json", force=False)
    outpath.check_writable(tmp_path / "r.json", force=True)
    outpath.check_writable(tmp_path / "new" / "deeper" / "r.json", force=False)


@unit
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_out_in_read_only_folder_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            outpath.check_writable(ro / "r.json", force=False)
    finally:
        ro.chmod(0o700)


@unit
def test_write_failure_goes_to_a_printed_fallback(fake: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    receipt, _ = rc.load(fake)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for target, force in ((blocker / "r.json", False), (tmp_path, True)):  # a file in the way; a folder
        written = rc.write_atomic(receipt, target, force=force)
        try:
            assert written != target and verify(written).verdict == rc.Verdict.PASS
            assert f"the receipt was written to {written}" in capsys.readouterr().err
        finally:
            written.unlink()


@unit
def test_second_run_on_the_same_out_refuses_at_start(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        outpath.lock_path(out).write_text(f"{holder.pid}\n")
        said: list[str] = []
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=f"another run \\(pid {holder.pid}\\)"):
            execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False),
                    progress=lambda phase, status, s: said.append(phase))
        assert said == [] and time.perf_counter() - start < 5 and not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # Its process is gone: the lock is stale, ignored, and the run releases its own at the end.
    execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False))
    assert out.exists() and not outpath.lock_path(out).exists()


@unit
def test_lock_is_released_when_the_run_fails(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False, inject="crash-at=stale"))
    assert res.receipt.verdict == rc.Verdict.ERROR and not outpath.lock_path(out).exists()


# --- trust: what verify proves, and signatures --------------------------------------------------

@unit
def test_verify_says_what_it_proves() -> None:
    res = cli("verify", "--help")
    assert "it does not prove who made the receipt" in " ".join(res.stdout.replace("│", " ").split())
    assert "not who made it" in " ".join((ROOT / "README.md").read_text().split())


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("keys")
    res = cli("keygen", str(d / "signer.pem"))
    assert res.returncode == 0, res.stderr
    assert (d / "signer.pem").stat().st_mode & 0o077 == 0
    other, _ = signing.keygen(d / "other.pem")
    return d / "signer.pem", d / "signer.pem.pub", Path(str(other) + ".pub")


@unit
def test_sign_then_verify(keys: tuple[Path, Path, Path], tmp_path: Path) -> None:
    private, public, _ = keys
    out = tmp_path / "signed.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--out", str(out),
              "--sign", str(private))
    assert res.returncode == 0, res.stderr
    env = json.loads(out.read_text())
    assert env["payloadType"] == signing.PAYLOAD_TYPE and len(env["signatures"]) == 1
    assert json.loads(base64.b64decode(env["payload"]))["verdict"] == "pass"
    res = cli("verify", str(out), "--public-key", str(public))
    assert res.returncode == 0 and "signature: valid" in res.stdout, res.stderr
    res = cli("verify", str(out))
    assert res.returncode == 0 and "signature: not checked" in res.stdout
    res = cli("report", str(out))  # report, table and diff read envelopes too (signature not checked)
    assert res.returncode == 0 and "PASS" in res.stdout, res.stderr


@unit
def test_tampered_or_wrongly_keyed_envelope_exits_2(keys: tuple[Path, Path, Path], fake: Path,
                                                    tmp_path: Path) -> None:
    private, public, other_public = keys
    key = signing.load_private_key(private)
    signed = tmp_path / "signed.json"
    signed.write_text(json.dumps(signing.envelope(fake.read_bytes(), key)))
    # Rewritten to "fail" and resealed: the digest is right again, the signature is not.
    data = json.loads(fake.read_text())
    checks_ = [{**c, "status": "fail"} if c["id"] == "A.parity.max" else c for c in data["checks"]]
    forged = rc.compute_digest({**data, "checks": checks_, "verdict": "fail"})
    payload = json.dumps({**data, "checks": checks_, "verdict": "fail", "digest": forged}).encode()
    env = json.loads(signed.read_text())
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps({**env, "payload": base64.b64encode(payload).decode()}))
    for path, pub, why in ((tampered, public, "signature does not verify"),
                           (signed, other_public, "signature does not verify"),
                           (fake, public, "not signed")):
        res = cli("verify", str(path), "--public-key", str(pub))
        assert res.returncode == 2 and why in res.stderr, (path, res.stderr)
    assert verify(signed, public).signature.startswith("valid")


@unit
def test_pae_matches_the_dsse_spec() -> None:
    # The example in DSSE's protocol.md.
    assert signing.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
