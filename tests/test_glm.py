"""GLM-5.3: the config, the launch plan (golden), and the preflight that stops a run this machine
cannot hold within seconds, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lora_parity.evidence.receipt import Budgets, ComparisonStats
from lora_parity.models import config, synthetic
from lora_parity.run import plan
from lora_parity.run.runner import RunOptions, prepare
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import checks

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit
GOLDEN = ROOT / "tests" / "golden" / "glm-5.3-plan.txt"


@pytest.fixture(autouse=True)
def _no_gpu_no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Deterministic preflight on any machine: an empty Hugging Face cache, no torchrun job.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def fake_hub_snapshot(root: Path, hf_id: str, vocab: int = 154880) -> Path:
    """A hub-cache layout with refs/main -> snapshots/REV holding config.json and a safetensors file."""
    base = root / ("models--" + hf_id.replace("/", "--"))
    snap = base / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0123abc")
    (snap / "config.json").write_text(json.dumps({"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": vocab}))
    (snap / "model-00001-of-00282.safetensors").write_bytes(b"")
    return snap


def test_glm53_config_is_the_real_model() -> None:
    cfg = config.load("glm-5.3")
    assert cfg.model.hf_id == "zai-org/GLM-5.3-BF16" and cfg.model.dtype == "bfloat16"
    assert cfg.model.trust_remote_code is False
    assert (cfg.adapter.rank, cfg.adapter.alpha) == (32, 32)
    assert cfg.adapter.targets == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj"]
    assert cfg.launch is not None
    t, s = cfg.launch.trainer, cfg.launch.sampler
    assert (t.backend, t.nodes, t.tp, t.ep) == ("megatron", 2, 8, 8) and cfg.launch.gpus_per_node == 8
    assert (s.tp, s.expert_parallel) == (8, True)
    assert (cfg.budgets.mean, cfg.budgets.max) == (0.05, 0.5)


def test_glm53_budgets_fail_the_seeds_zero_init_result() -> None:
    # The seed's GLM-5.3 run: zero-init mean 0.21, p99 2.95, max 5.84 over 192 tokens.
    budgets = config.load("glm-5.3").budgets
    seed = ComparisonStats(a="zero", b="trainer_zero", n=192, mean_abs=0.209653, p50=0.1, p99=2.95165,
                           max_abs=5.83631, argmax=[0, 0], frac_over=0.5, k3_kl=0.1, mult_prob_error=1.3)
    status = {c.id: c.status.value for c in checks.compute_checks({"A.trainer_vs_sampler": seed}, {}, budgets)}
    assert status["A.parity.mean"] == status["A.parity.p99"] == status["A.parity.max"] == "fail"
    # A run at SkyRL's budget edge with one 0.6-nat token fails on the tail alone.
    edge = seed.model_copy(update={"mean_abs": 0.04, "p99": 0.15, "max_abs": 0.6})
    status = {c.id: c.status.value for c in checks.compute_checks({"A.trainer_vs_sampler": edge}, {}, budgets)}
    assert (status["A.parity.mean"], status["A.parity.max"]) == ("pass", "fail")


def test_plan_matches_golden() -> None:
    assert plan.render(config.load("glm-5.3")) == GOLDEN.read_text(encoding="utf-8")


def test_cli_plan_prints_the_golden_plan_and_runs_nothing() -> None:
    res = cli("run", "--model", "glm-5.3", "--plan")
    assert res.returncode == 0, res.stderr
    assert res.stdout == GOLDEN.read_text(encoding="utf-8")
    plan_text = res.stdout
    assert "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d" in plan_text
    assert "--tensor-parallel-size 8 --enable-expert-parallel" in plan_text


def test_plan_memory_numbers() -> None:
    cfg = config.load("glm-5.3")
    # 753.3e9 bf16 parameters = 1,403 GiB; TP8/EP8 over 16 GPUs and vLLM TP8 hold 1/8 each.
    assert plan.weights_gib(cfg) == pytest.approx(753.3e9 * 2 / 2**30)
    assert plan.trainer_gib_per_gpu(cfg) == pytest.approx(plan.weights_gib(cfg) / 8)
    assert plan.sampler_gib_per_gpu(cfg) == pytest.approx(plan.weights_gib(cfg) / 8)
    assert plan.num_nodes(cfg.launch) == 3  # type: ignore[arg-type]
    small = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"gpu_memory_gib": 131})})  # type: ignore[union-attr]
    assert "DOES NOT FIT: 175.4 of 131 GiB" in plan.render(small)


def test_single_process_configs_have_a_one_line_plan() -> None:
    text = plan.render(config.load("tiny-qwen3"))
    assert "runs in one process" in text and "torchrun" not in text


def test_preflight_fails_fast_in_one_line_without_torch() -> None:
    start = time.perf_counter()
    res = cli("run", "--model", "glm-5.3", env={"CUDA_VISIBLE_DEVICES": ""})
    elapsed = time.perf_counter() - start
    assert res.returncode == 2 and elapsed < 15, (res.returncode, elapsed)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("lora-parity: error: preflight: glm-5.3 needs 3 nodes x 8 GPUs")
    assert "zai-org/GLM-5.3-BF16 is not in the local Hugging Face cache" in lines[0]
    assert "8 GPUs per node, found 0 (CUDA_VISIBLE_DEVICES hides every GPU)" in lines[0] and "--plan" in lines[0]
    probe = "\n".join([
        "import sys",
        "from lora_parity.util.errors import ConfigError",
        "from lora_parity.run.runner import RunOptions, prepare",
        "try:",
        "    prepare(RunOptions(model='glm-5.3'))",
        "except ConfigError:",
        "    print('torch' in sys.modules, 'vllm' in sys.modules)",
    ])
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_preflight_names_each_missing_resource(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cfg = config.load("glm-5.3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as e:
        plan.preflight(cfg, "hf", "vllm")
    msg = str(e.value)
    assert "CUDA_VISIBLE_DEVICES hides every GPU" in msg
    assert "a torchrun job of 16 ranks over 2 nodes (WORLD_SIZE is unset)" in msg
    assert "--trainer megatron (the plan's trainer; hf cannot hold it)" in msg
    # With the checkpoint in the cache and the right trainer, only the hardware is missing.
    fake_hub_snapshot(tmp_path / "hub", "zai-org/GLM-5.3-BF16")
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(ConfigError) as e:
        plan.preflight(cfg, "megatron", "vllm")
    assert "Hugging Face cache" not in str(e.value) and "WORLD_SIZE" not in str(e.value)
    assert "hides every GPU" in str(e.value)


def test_preflight_without_nvidia_smi_and_with_a_failing_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert plan._visible_gpus() == (0, "no CUDA GPU (nvidia-smi not found)")
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert plan._visible_gpus() == (0, "nvidia-smi lists no GPU")


def test_configs_without_launch_or_hub_id_need_nothing() -> None:
    plan.preflight(config.load("tiny-qwen3"), "hf", "vllm")
    plan.preflight(config.load("tiny-glm-moe"), "hf", "vllm")


def test_hub_id_resolves_to_the_local_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    snap = fake_hub_snapshot(tmp_path / "hub", "zai-org/GLM-5.3-BF16", vocab=1024)
    assert plan.hub_checkpoint("zai-org/GLM-5.3-BF16") == snap
    assert plan.hub_checkpoint("zai-org/GLM-5.3") is None
    cfg = config.load("glm-5.3")
    assert synthetic.materialize(cfg) == snap
    # A hub-id config without a launch section runs like a local checkpoint once it is in the cache.
    single = tmp_path / "glm-local.yaml"
    data = yaml.safe_load((ROOT / "configs" / "glm-5.3.yaml").read_text())
    data.pop("launch")
    data["name"] = "glm-local"
    data["route_replay"] = "auto"  # the stand-in snapshot's config.json names no experts: a dense model to preflight
    single.write_text(yaml.safe_dump(data))
    prepared = prepare(RunOptions(model=str(single), trainer="fake", sampler="fake"))
    assert all(0 <= t < 1024 for s in prepared.probes.sequences for t in s)


def test_hub_id_without_cache_is_refused_before_any_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    single = tmp_path / "glm-local.yaml"
    data = yaml.safe_load((ROOT / "configs" / "glm-5.3.yaml").read_text())
    data.pop("launch")
    data["name"] = "glm-local"
    single.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        prepare(RunOptions(model=str(single), trainer="hf", sampler="vllm"))


@pytest.mark.parametrize(("change", "message"), [
    ({"trainer": {"backend": "megatron", "nodes": 2, "tp": 3}}, "trainer tp x pp = 3 does not divide its 16 GPUs"),
    ({"trainer": {"backend": "megatron", "nodes": 2, "tp": 8, "ep": 5}}, "trainer ep 5 does not divide"),
    ({"sampler": {"tp": 16}}, "sampler tp 16 exceeds the 8 GPUs of node 0"),
])
def test_launch_layouts_that_cannot_exist_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    data = yaml.safe_load((ROOT / "configs" / "glm-5.3.yaml").read_text())
    data["launch"].update(change)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="invalid config"):
        config.load(str(bad))
    with pytest.raises(ValueError, match=message):
        config.LaunchSpec.model_validate(data["launch"])


def test_synthetic_moe_specs_are_checked() -> None:
    base = config.load("tiny-qwen3-moe").model.synthetic
    assert base is not None
    with pytest.raises(ValueError, match="needs moe section"):
        config.SyntheticSpec.model_validate({**base.model_dump(), "moe": None})
    with pytest.raises(ValueError, match="takes no moe section"):
        config.SyntheticSpec.model_validate({**base.model_dump(), "architecture": "Qwen3ForCausalLM"})
    glm = config.load("tiny-glm-moe").model.synthetic
    assert glm is not None and glm.mla is not None
    with pytest.raises(ValueError, match="DSA indexer"):
        config.SyntheticSpec.model_validate({**glm.model_dump(), "architecture": "GlmMoeDsaForCausalLM"})
    dsa = {**glm.model_dump(), "architecture": "GlmMoeDsaForCausalLM",
           "mla": {**glm.mla.model_dump(), "index_topk": 64, "index_head_dim": 32, "index_n_heads": 4}}
    assert config.SyntheticSpec.model_validate(dsa).mla.index_topk == 64  # type: ignore[union-attr]


def test_existing_synthetic_cache_keys_do_not_change() -> None:
    # The optional MoE/MLA fields are left out of the cache key while unset.
    spec = config.load("tiny-qwen3").model.synthetic
    assert spec is not None
    legacy = {k: v for k, v in spec.model_dump(mode="json").items() if k not in ("rms_norm_eps", "moe", "mla")}
    from lora_parity.evidence.receipt import sha256_json

    assert synthetic.spec_digest(spec, "float32") == sha256_json({"spec": legacy, "dtype": "float32",
                                                                   "generator": 1})[:16]
    # An MoE spec keeps its key while expert_std is unset (its moe section as it was before the field existed).
    moe = config.load("tiny-qwen3-moe").model.synthetic
    assert moe is not None and moe.moe is not None
    before = {k: v for k, v in moe.model_dump(mode="json").items() if k not in ("rms_norm_eps", "mla")}
    before["moe"] = {k: v for k, v in before["moe"].items() if k != "expert_std"}
    assert synthetic.spec_digest(moe, "float32") == sha256_json({"spec": before, "dtype": "float32",
                                                                  "generator": 1})[:16]


def test_expert_std_redraws_the_routed_experts_only(tmp_path: Path) -> None:
    """`moe.expert_std`: the routed experts' weights drawn at that std, everything else as HF's init left it."""
    from safetensors.torch import load_file

    spec = config.load("tiny-qwen3-moe").model.synthetic
    assert spec is not None and spec.moe is not None
    wide = spec.model_copy(update={"moe": spec.moe.model_copy(update={"expert_std": 0.5})})
    assert synthetic.spec_digest(wide, "float32") != synthetic.spec_digest(spec, "float32")
    synthetic.generate(spec, "float32", tmp_path / "plain")
    synthetic.generate(wide, "float32", tmp_path / "wide")
    plain, drawn = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plain", "wide"))
    experts = [n for n in drawn if ".experts." in n]
    assert experts and all(abs(float(drawn[n].std()) - 0.5) < 0.05 for n in experts)
    assert all(float(plain[n].std()) < 0.1 for n in experts)
    assert all(bool((plain[n] == drawn[n]).all()) for n in drawn if ".experts." not in n)


def test_budgets_in_configs_are_consistent() -> None:
    for name in ("glm-5.3", "tiny-qwen3-moe", "tiny-glm-moe"):
        b: Budgets = config.load(name).budgets
        assert b.mean <= b.p99 <= b.max and b.min_stimulus >= b.mean
