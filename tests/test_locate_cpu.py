"""`lora-parity locate` on the real stack (HF + PEFT, the in-process vLLM-CPU engine, the embedded default): a clean
receipt names no layer; a divergence planted in one layer of the engine's base weights is named at that layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import cli

pytestmark = pytest.mark.cpu_e2e
vllm = pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")


@pytest.fixture(scope="module")
def receipt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("locate") / "clean.json"
    result = cli("run", "--out", str(path), "--quiet")
    assert result.returncode == 0, result.stderr
    return path


def test_a_clean_receipt_names_no_layer(receipt: Path) -> None:
    result = cli("locate", str(receipt))
    assert result.returncode == 0, result.stderr
    assert "no layer named" in result.stdout
    data = json.loads(receipt.with_name("clean.locate.json").read_text())
    assert data["divergences"] == [] and data["a_failed"] == []
    names = [p["name"] for p in data["points"]]
    assert names[0] == "embed" and names[-1] == "norm" and "layers.1.input_layernorm" in names
    trainer = [p["trainer"]["distance"]["median"]["value"] for p in data["points"]]
    engine = [p["engine"]["distance"]["median"]["value"] for p in data["points"]]
    assert max(trainer) == 0.0  # the fp32 trainer is the fp32 reference's arithmetic
    assert 0 < max(engine) < 1e-5  # the engine's kernels: fp32 rounding, witnessed by fp32 against fp64
    assert all(p["fp32_vs_fp64"] is not None for p in data["points"])
    again = cli("locate", str(receipt))
    assert again.returncode == 2 and "--force" in again.stderr


@pytest.mark.parametrize(("layer", "factor"), [(0, ""), (1, "x1.05")])
def test_a_norm_scaled_in_the_engine_is_named_at_its_layer(receipt: Path, tmp_path: Path, layer: int,
                                                           factor: str) -> None:
    out = tmp_path / "planted.json"
    inject = f"engine-norm@{layer}{factor}"
    result = cli("locate", str(receipt), "--inject", inject, "--out", str(out), "--markdown")
    assert result.returncode == 1, result.stderr
    data = json.loads(out.read_text())
    assert [(d["side"], d["point"], d["layer"]) for d in data["divergences"]] == [
        ("engine", f"layers.{layer}.input_layernorm", layer)]
    assert data["injected"].startswith(inject) and f"weight x {factor[1:] or '1.01'}, engine only" in data["injected"]
    assert f"the engine leaves at layers.{layer}.input" in result.stdout.replace("\\_", "_")
