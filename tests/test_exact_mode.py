"""Exact mode (issue 29): `--budgets exact` judges A, C and P bitwise, every comparison records the fraction of
bitwise equal tokens, and the `exact` trainer lays the adapter out as vLLM does and refuses what it cannot
mirror. Its forward runs vLLM's GPU kernels: the GPU evidence is scripts/exact-ops.py and the receipts in
receipts/ (docs/verdicts.md, "The exact trainer")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_parity.backends import fake
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError
from lora_parity.verdict.verify import verify

from .conftest import cli

pytestmark = pytest.mark.unit

FAKE = {"trainer": "fake", "sampler": "fake", "per_target": False}


def by_id(receipt: object) -> dict[str, object]:
    return {c.id: c for c in receipt.checks}  # type: ignore[attr-defined]


def test_exact_budgets_pass_a_bitwise_pair_and_record_the_equal_fraction(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    receipt = execute(RunOptions(**FAKE, budgets="exact", out=out)).receipt
    assert receipt.budgets.exact and receipt.budgets.profile == "exact"
    checks = by_id(receipt)
    for check_id in ("A.parity.mean", "A.parity.max", "C.parity.max"):
        assert checks[check_id].status == CheckStatus.PASS and checks[check_id].budget == 0  # type: ignore[attr-defined]
    assert receipt.comparisons["A.trainer_vs_sampler"].equal == 1.0
    assert receipt.comparisons["C.trainer_vs_sampler"].equal == 1.0
    assert receipt.comparisons["B.trainer_updated_vs_stale"].equal < 0.5  # the update moved nearly every token
    assert receipt.verdict == Verdict.PASS and verify(out).verdict == Verdict.PASS


def test_exact_budgets_fail_any_nonzero_difference_the_bf16_rules_accept(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake.FakeSampler, "noise", 1e-4)  # a sampler off by rounding: bf16's rules let it pass
    loose = execute(RunOptions(**FAKE, budgets="bf16", out=tmp_path / "bf16.json")).receipt
    assert by_id(loose)["A.parity.max"].status == CheckStatus.PASS  # type: ignore[attr-defined]
    out = tmp_path / "exact.json"
    exact = execute(RunOptions(**FAKE, budgets="exact", out=out)).receipt
    checks = by_id(exact)
    for check_id in ("A.parity.mean", "A.parity.p99", "A.parity.max", "C.parity.max"):
        assert checks[check_id].status == CheckStatus.FAIL, check_id  # type: ignore[attr-defined]
    assert exact.comparisons["A.trainer_vs_sampler"].equal < 0.01
    assert exact.verdict == Verdict.FAIL and verify(out).verdict == Verdict.FAIL


@pytest.mark.parametrize("fault", ["skip-sync", "stale-a", "partial-export", "wrong-scale"])
def test_exact_budgets_catch_sync_faults_on_c(fault: str, tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, budgets="exact", update="step", inject=fault,
                                 out=tmp_path / "r.json")).receipt
    c_max = by_id(receipt)["C.parity.max"]
    assert c_max.status == CheckStatus.FAIL and (c_max.observed or 0) > 0  # type: ignore[attr-defined]
    assert receipt.verdict == Verdict.FAIL


def test_a_tampered_equal_fraction_does_not_verify(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    execute(RunOptions(**FAKE, out=out))
    data = json.loads(out.read_text())
    data["comparisons"]["A.trainer_vs_sampler"]["equal"] = 0.5
    from lora_parity.evidence.receipt import compute_digest

    data["digest"] = compute_digest(data)
    out.write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"comparison A\.trainer_vs_sampler does not reproduce"):
        verify(out)


def test_the_profile_names_exact() -> None:
    budgets = config.profile_budgets("exact")
    bf16 = config.profile_budgets("bf16")
    assert budgets.exact and not bf16.exact
    assert budgets.model_dump(exclude={"exact", "profile"}) == bf16.model_dump(exclude={"exact", "profile"})


# The exact trainer: what it refuses, and the adapter as vLLM holds it.

def test_unsupported_names_what_the_exact_trainer_cannot_mirror(tmp_path: Path) -> None:
    from lora_parity.backends.exact import unsupported

    cfg = config.load("qwen3-0.6b-synth")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu"}))
    assert unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) is None
    assert "CUDA" in (unsupported(cfg, tmp_path, cuda=False, batch_invariant=True) or "")
    assert "--no-batch-invariant" in (unsupported(cfg, tmp_path, cuda=True, batch_invariant=False) or "")
    eager = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"enforce_eager": False})})
    assert "enforce_eager" in (unsupported(eager, tmp_path, cuda=True, batch_invariant=True) or "")
    fp32 = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "float32"})})
    assert "float32" in (unsupported(fp32, tmp_path, cuda=True, batch_invariant=True) or "")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert "Qwen2ForCausalLM" in (unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) or "")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "rope_scaling": {"rope_type": "llama3"}}))
    assert "rotary" in (unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) or "")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    assert "rotary" in (unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) or "")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}))
    assert unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "not a JSON object" in (unsupported(cfg, tmp_path, cuda=True, batch_invariant=True) or "")


def test_the_exact_trainer_refuses_on_this_machine_in_one_line(tmp_path: Path) -> None:
    import torch

    from lora_parity.backends.exact import ExactTrainer

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ConfigError, match=r"^--trainer exact: it needs CUDA"):
        ExactTrainer(config.load("tiny-qwen3"), tmp_path, 0, {})


@pytest.mark.parametrize(("args", "said"), [
    (["--sampler", "hf"], "mirrors the in-process vllm sampler, not hf"),
    (["--sampler", "vllm-server"], "mirrors the in-process vllm sampler, not vllm-server"),
    (["--sync", "merged"], "--sync merged serves merged weights"),
    (["--sync", "memory"], "--sync memory serves merged weights"),
])
def test_the_cli_refuses_pairs_the_exact_trainer_cannot_mirror(args: list[str], said: str, tmp_path: Path) -> None:
    result = cli("run", "--model", "tiny-qwen3", "--trainer", "exact", *args, "--out", str(tmp_path / "r.json"))
    assert result.returncode == 2, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_the_pair_it_mirrors_passes_the_option_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The refusals above come from `check_options`, before any backend is imported (tests/test_output.py
    asserts no heavy module is loaded then); the pair the exact trainer mirrors is not refused where a GPU is,
    and is refused at once where none is (issue 46, case 14: it failed after loading, with an error receipt)."""
    from lora_parity.run import preflight

    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(preflight, "NVIDIA_NODES", (str(driver),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    preflight.check_options(RunOptions(trainer="exact", sampler="vllm"), config.load("tiny-qwen3"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="--trainer exact runs vLLM's CUDA operations; this machine has no"):
        preflight.check_options(RunOptions(trainer="exact", sampler="vllm"), config.load("tiny-qwen3"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(preflight, "NVIDIA_NODES", (str(tmp_path / "absent"),))
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        preflight.check_options(RunOptions(trainer="exact", sampler="vllm"), config.load("tiny-qwen3"))


def test_the_adapter_is_laid_out_as_vllm_loads_it() -> None:
    """lora_group against vLLM's own loader arithmetic (LoRALayerWeights.optimize: B cast to the model's
    dtype, then alpha/r folded in there), padded to max_lora_rank, a slice without LoRA zero."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from lora_parity.backends.exact import lora_group

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("q", torch.nn.Linear(16, 12, bias=False))
    base.add_module("k", torch.nn.Linear(16, 4, bias=False))
    base = base.to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=6, lora_alpha=9, target_modules=["q"]))
    q = model.base_model.model.q
    with torch.no_grad():
        q.lora_B["default"].weight.normal_(0, 0.3)
    group = lora_group([q, model.base_model.model.k], rank=8)
    assert group.weight.shape == (16, 16) and group.a is not None and group.b is not None
    assert [t.shape for t in group.a] == [(1, 1, 8, 16), (1, 1, 8, 16)]
    assert [t.shape for t in group.b] == [(1, 1, 12, 8), (1, 1, 4, 8)]
    assert not group.a[1].any() and not group.b[1].any() and not group.a[0][0, 0, 6:].any()
    lora_weights = pytest.importorskip("vllm.lora.lora_weights")
    b = q.lora_B["default"].weight
    theirs = lora_weights.LoRALayerWeights("q", 6, 9, q.lora_A["default"].weight.to(torch.bfloat16),
                                           b.to(torch.bfloat16)).optimize()
    assert torch.equal(group.b[0][0, 0, :, :6], theirs.lora_b)
    assert torch.equal(group.a[0][0, 0, :6], theirs.lora_a)
    assert lora_group([model.base_model.model.k], rank=8).a is None  # no slice with LoRA: the plain GEMM


def test_one_token_is_caught_by_the_max_under_exact_budgets_too(tmp_path: Path) -> None:
    """bf16 rules: the max catches the token the mean hides (A.parity.mean must pass). Exact: every statistic is
    bitwise, so the mean fails as well, and the selftest still counts the fault caught by A.parity.max."""
    from lora_parity.run.selftest import judge

    for budgets, mean_status in (("bf16", CheckStatus.PASS), ("exact", CheckStatus.FAIL)):
        receipt = execute(RunOptions(**FAKE, budgets=budgets, inject="one-token",
                                     out=tmp_path / f"{budgets}.json")).receipt
        checks = by_id(receipt)
        assert checks["A.parity.max"].status == CheckStatus.FAIL  # type: ignore[attr-defined]
        assert checks["A.parity.mean"].status == mean_status  # type: ignore[attr-defined]
        n = receipt.probes.num_scored_positions
        assert judge("one-token", receipt, set(), {"x"}, ["q_proj"], n).caught
