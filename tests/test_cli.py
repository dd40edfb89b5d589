import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit


def test_help_does_not_import_torch() -> None:
    code = ("import sys; sys.argv=['lora-parity','--help']\nfrom lora_parity.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'vllm' in sys.modules, 'transformers' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.stdout.strip().splitlines()[-1] == "False False False"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--model", "./no/such/checkpoint"], "model path ./no/such/checkpoint not found"),
        (["run", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["run", "--trainer", "nope"], "unknown trainer backend 'nope'"),
        (["run", "--sampler", "nope"], "unknown sampler backend 'nope'"),
        (["run", "--trainer", "fake", "--sampler", "fake", "--probes", "nope"], "unknown probe set 'nope'"),
        (["run", "--trainer", "fake", "--sampler", "fake", "--inject", "nope"], "unknown fault 'nope'"),
        (["run", "--trainer", "fake", "--sampler", "fake", "--sync", "nope"], "unknown sync mode 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    res = cli(*args, cwd=tmp_path, env={"LORA_PARITY_CONFIGS": str(ROOT / "configs")})
    assert res.returncode == 2
    assert message in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir()), "bad input must not write a receipt"


def test_malformed_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    res = cli("run", "--model", str(bad))
    assert res.returncode == 2 and "malformed YAML at line" in res.stderr
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text((ROOT / "configs" / "tiny-qwen3.yaml").read_text().replace("rank: 8", "rank: -1"))
    res = cli("run", "--model", str(invalid))
    assert res.returncode == 2 and "adapter.rank" in res.stderr


def test_checkpoint_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    res = cli("run", "--model", str(tmp_path))
    assert res.returncode == 2 and "no .safetensors weights" in res.stderr


def test_existing_receipt_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    out.write_text("keep me")
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(out))
    assert res.returncode == 2 and "--force" in res.stderr
    assert out.read_text() == "keep me"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(out), "--force", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"] == "pass"


def test_default_receipt_path(tmp_path: Path) -> None:
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--probes", "held-out", "--json", cwd=tmp_path,
              env={"LORA_PARITY_CONFIGS": str(ROOT / "configs")})
    assert res.returncode == 0, res.stderr
    # A user's runs are kept apart from the committed evidence in receipts/.
    assert not (tmp_path / "receipts").exists()
    (path,) = (tmp_path / "lora-parity-receipts").iterdir()
    assert path.name.startswith("tiny-qwen3.held-out__fake__fake__") and path.suffix == ".json"
    assert json.loads(res.stdout)["receipt"] == str(Path("lora-parity-receipts") / path.name)
    assert "/lora-parity-receipts/" in (ROOT / ".gitignore").read_text().splitlines()


def test_models_lists_configs() -> None:
    res = cli("models")
    assert res.returncode == 0
    names = [line.split()[0] for line in res.stdout.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert "tiny-qwen3" in names


def test_revision_from_git_or_unknown(tmp_path: Path) -> None:
    from lora_parity.run.runner import git_revision

    unknown = git_revision(None, cwd=tmp_path)
    assert unknown.commit == "unknown" and unknown.reason
    here = git_revision(None, cwd=ROOT)
    assert here.source in ("git", "unknown")
    assert git_revision("deadbeef").commit == "deadbeef"


def test_per_target_flag_turns_coverage_on_off_or_leaves_it_to_the_config(tmp_path: Path) -> None:
    """A config with `per_target: false` (the GPU configs) gets coverage with --per-target; without the flag the
    config decides; --no-per-target turns it off where the config has it on (the flag once could only turn it off)."""
    off = tmp_path / "off.yaml"
    off.write_text((ROOT / "configs" / "tiny-qwen3.yaml").read_text() + "\nper_target: false\n")

    def targets(*args: str) -> list[str]:
        out = tmp_path / f"r{len(list(tmp_path.glob('*.json')))}.json"
        res = cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(out), *args)
        assert res.returncode == 0, res.stdout + res.stderr
        return [p["name"] for p in json.loads(out.read_text())["phases"] if p["name"].startswith("target.")]

    assert targets("--model", str(off)) == []
    assert targets("--model", str(off), "--per-target")
    assert targets("--model", "tiny-qwen3")
    assert targets("--model", "tiny-qwen3", "--no-per-target") == []
