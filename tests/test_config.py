from pathlib import Path

import pytest

from lora_parity.models import config
from lora_parity.run.probes import random_probes
from lora_parity.util.errors import ConfigError

from .conftest import ROOT

pytestmark = pytest.mark.unit


def test_default_config_is_the_tiny_qwen3() -> None:
    cfg = config.load(None)
    assert cfg.name == "tiny-qwen3" and cfg.model.dtype == "float32"
    assert cfg.adapter.targets == config.HF_TARGETS
    assert cfg.model.trust_remote_code is False


def test_probes_are_deterministic_and_sized_like_the_seed() -> None:
    cfg = config.load(None)
    p1 = random_probes(cfg.probes, "default", 512)
    p2 = random_probes(cfg.probes, "default", 512)
    held = random_probes(cfg.probes, "held-out", 512)
    assert p1 == p2 and p1.digest != held.digest
    assert [len(s) for s in p1.sequences] == [65, 129] and p1.num_scored_positions == 192
    assert all(0 <= t < 512 for s in p1.sequences for t in s)


def test_every_committed_config_loads() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = config.load(str(path))
        assert cfg.name == path.stem


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        config.load(str(evil))


def test_hub_ids_are_not_downloaded() -> None:
    from lora_parity.models import synthetic

    cfg = config.load(None)
    hub = cfg.model_copy(update={"model": config.ModelSpec(hf_id="some-org/some-model")})
    with pytest.raises(ConfigError, match="does not download"):
        synthetic.materialize(hub)


def test_moe_checkpoints_refuse_batched_scoring(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "tiny-qwen3-moe.yaml").read_text(encoding="utf-8")
    path = tmp_path / "moe-batched.yaml"
    path.write_text(text + "scoring:\n  batch_size: 4\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="batch_size must be 1 for MoE"):
        config.load(str(path))
    path.write_text(text + "scoring:\n  batch_size: 1\n", encoding="utf-8")
    assert config.load(str(path)).scoring.batch_size == 1
