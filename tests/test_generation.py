"""Sampled probes, the generation path after sync and `--adapter`, on the fake backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lora_parity.backends.fake import FakeTrainer
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import adapter_files as af
from lora_parity.models.config import load
from lora_parity.run import generation, probes
from lora_parity.run.faults import FAULTS, faults_for
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import ConfigError, PhaseError
from lora_parity.verdict import checks
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit

FAKE = {"trainer": "fake", "sampler": "fake"}


@pytest.fixture
def toy_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake backends' config is synthetic (no tokenizer): tokenize characters into the fake's vocabulary."""
    monkeypatch.setattr(probes, "checkpoint_tokenizer",
                        lambda cfg, kind="text": (lambda text: [ord(ch) % 64 for ch in text], "toy"))


def _status(receipt: object) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in receipt.checks}  # type: ignore[attr-defined]


def test_sampled_run_passes_and_records_what_was_sampled(toy_tokenizer: None, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    receipt = execute(RunOptions(**FAKE, probes="sampled", out=out)).receipt
    assert receipt.verdict == Verdict.PASS, [c for c in receipt.checks if c.status != CheckStatus.PASS]
    assert receipt.probes.source is not None and receipt.probes.source.kind == "sampled"
    names = [p.name for p in receipt.phases]
    assert names[:3] == ["publish_zero", "sample", "base"] and "generate_updated" in names
    cfg = load(None)
    text = probes.text_probes(cfg.probes, "default", [ord(ch) % 64 for ch in probes.shipped_text()],
                              receipt.probes.source)
    for seq, window in zip(receipt.probes.sequences, text.sequences, strict=True):
        n = generation.prompt_length(len(window))
        assert len(seq) == len(window) and seq[:n] == window[:n]
    # What was generated is not the text (it was sampled), and every G check ran and passed.
    assert receipt.probes.sequences != text.sequences
    status = _status(receipt)
    for prefix in ("G.sampled", "G.updated", "G.trainer"):
        assert all(status[f"{prefix}.parity.{s}"] == CheckStatus.PASS for s in ("mean", "p99", "max"))
    assert {"sampled_generation", "updated_generation", "updated_generation_prompt",
            "updated_generation_trainer"} <= receipt.scores.keys()
    verify(out)


def test_sampling_is_seeded(toy_tokenizer: None, tmp_path: Path) -> None:
    first = execute(RunOptions(**FAKE, probes="sampled", out=tmp_path / "a.json")).receipt
    again = execute(RunOptions(**FAKE, probes="sampled", out=tmp_path / "b.json")).receipt
    other = execute(RunOptions(**FAKE, probes="sampled", seed=1, out=tmp_path / "c.json")).receipt
    assert first.probes.sequences == again.probes.sequences != other.probes.sequences


@pytest.mark.parametrize("fault", ["gen-no-adapter", "prompt-no-adapter", "graphs-hold-old"])
def test_adapter_on_only_one_path_is_caught(fault: str, toy_tokenizer: None, tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, probes="sampled", inject=fault, out=tmp_path / "r.json")).receipt
    spec, status = FAULTS[fault], _status(receipt)
    assert receipt.verdict == Verdict.FAIL
    assert all(status[c] == CheckStatus.FAIL for c in spec.caught_by)
    assert all(status[c] == CheckStatus.PASS for c in spec.must_pass)
    # The prompt-scoring path alone (checks A, B, C) does not see it.
    assert all(s == CheckStatus.PASS for c, s in status.items() if not c.startswith("G."))


def test_generation_faults_need_sampled_probes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --probes sampled"):
        execute(RunOptions(**FAKE, inject="gen-no-adapter", out=tmp_path / "r.json"))
    assert "gen-no-adapter" not in faults_for("new-id") and "gen-no-adapter" in faults_for("new-id", sampled=True)


def test_selftest_with_sampled_probes_catches_the_generation_faults(toy_tokenizer: None, tmp_path: Path) -> None:
    result = selftest(RunOptions(**FAKE, probes="sampled"), tmp_path)
    assert {"gen-no-adapter", "prompt-no-adapter", "graphs-hold-old"} <= {r.fault for r in result.rows}
    assert result.ok, [r for r in result.rows if not r.caught]


def test_sampled_probes_are_refused_for_a_synthetic_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="synthetic checkpoint without a tokenizer; sampled probes"):
        execute(RunOptions(**FAKE, probes="sampled", out=tmp_path / "r.json"))


def test_a_sampler_that_cannot_generate_is_refused(toy_tokenizer: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import fake

    class Mute(fake.FakeSampler):
        generate = None  # type: ignore[assignment]

    monkeypatch.setattr(fake, "FakeSampler", Mute)
    with pytest.raises(ConfigError, match="needs a sampler that generates"):
        execute(RunOptions(**FAKE, probes="sampled", out=tmp_path / "r.json"))


def test_generation_checks_are_absent_without_generation_scores() -> None:
    cfg = load(None)
    ev = checks.evaluate({"zero": [[-1.0, -2.0]], "trainer_zero": [[-1.0, -2.0]]}, cfg.budgets, errored=False)
    assert not any(c.id.startswith("G.") for c in ev.checks)


def test_rollout_logprobs_off_by_a_little_fail_g_trainer() -> None:
    cfg = load(None)
    gen = [[-1.0, -2.0, -3.0]]
    off = [[-1.0, -2.0, -3.0 + 10 * cfg.budgets.max]]
    ev = checks.evaluate({"updated_generation": gen, "updated_generation_trainer": off,
                          "updated_generation_prompt": gen}, cfg.budgets, errored=False)
    status = {c.id: c.status for c in ev.checks}
    assert status["G.trainer.parity.max"] == CheckStatus.FAIL
    assert status["G.updated.parity.max"] == CheckStatus.PASS


def test_adapter_changed_on_disk_after_publish_is_caught(tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, inject="adapter-changed", out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.ERROR
    assert receipt.error is not None and "changed on disk after it was published" in receipt.error
    assert generation.prompt_length(65) == 32 and generation.prompt_length(3) == 2


@pytest.mark.parametrize("kept", [1 << 20, 0])  # the bytes kept; past the run's budget, a sha256
@pytest.mark.parametrize("change", ["same size", "longer", "new file", "renamed"])
def test_check_unchanged_passes_an_untouched_folder_and_catches_each_change(tmp_path: Path, kept: int, change: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "KEPT_BYTES", kept)
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "f").write_bytes(b"xyz")
    published: dict[Path, generation.FolderState] = {}
    generation.remember(published, folder)
    assert (published[folder].contents is None) == (kept == 0) and (published[folder].digest is None) == (kept > 0)
    generation.check_unchanged(folder, published)
    {"same size": lambda: (folder / "f").write_bytes(b"xyZ"), "longer": lambda: (folder / "f").write_bytes(b"xyzw"),
     "new file": lambda: (folder / "g").write_bytes(b""),
     "renamed": lambda: (folder / "f").rename(folder / "e")}[change]()
    with pytest.raises(PhaseError, match="changed on disk"):
        generation.check_unchanged(folder, published)


def test_a_run_keeps_bytes_up_to_its_budget_then_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "KEPT_BYTES", 10)
    published: dict[Path, generation.FolderState] = {}
    for name in "abc":
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"1234")
        generation.remember(published, tmp_path / name)
    assert [published[tmp_path / n].contents is not None for n in "abc"] == [True, True, False]
    assert published[tmp_path / "c"].digest == generation.folder_digest(tmp_path / "c")
    generation.remember(published, tmp_path / "a")  # published again: its own bytes no longer count against it
    assert published[tmp_path / "a"].contents == (b"1234",)


# --- --adapter -------------------------------------------------------------------------------

def _user_adapter(folder: Path, targets: list[str], rank: int = 4, alpha: float = 8.0, std: float = 0.05) -> Path:
    """A PEFT folder in the fake's layout with random A and non-zero B."""
    import random

    cfg = load(None).model_copy()
    cfg = cfg.model_copy(update={"adapter": cfg.adapter.model_copy(update={"rank": rank, "alpha": alpha,
                                                                             "targets": targets})})
    trainer = FakeTrainer(cfg, None, 3, {})
    rng = random.Random(11)
    for name in trainer.params:
        if ".lora_B." in name:
            trainer.params[name] = [rng.gauss(0, std) for _ in range(rank)]
    return trainer.export_adapter(folder)


def test_user_adapter_passes_and_both_sides_start_from_it(tmp_path: Path) -> None:
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"])
    out = tmp_path / "r.json"
    receipt = execute(RunOptions(**FAKE, adapter=adapter, out=out)).receipt
    assert receipt.verdict == Verdict.PASS, [c for c in receipt.checks if c.status != CheckStatus.PASS]
    status = _status(receipt)
    assert status["A.adapter_moved"] == CheckStatus.PASS and "A.zero_adapter_noop" not in status
    assert "adapter_base" in receipt.scores and "base" not in receipt.scores
    assert {c.id for c in receipt.checks if c.id.startswith("T.")} >= {"T.q_proj.moved", "T.v_proj.moved",
                                                                           "T.down_proj.moved"}
    assert receipt.trainer.settings["rank"] == 4
    verify(out)


def test_per_target_restores_the_starting_b_not_zero() -> None:
    folder_cfg = load(None)
    trainer = FakeTrainer(folder_cfg, None, 0, {})
    start = {n: [0.1 * (i + 1)] * len(v) for i, (n, v) in enumerate(trainer.params.items()) if ".lora_B." in n}
    trainer.params.update(start)
    trainer.start = {**trainer.start, **{n: list(v) for n, v in start.items()}}
    trainer.perturb(0.01, 0)
    with pytest.raises(PhaseError, match="non-zero before the update"):
        trainer.perturb(0.01, 0)
    trainer.zero_b()
    assert {n: trainer.params[n] for n in start} == start
    trainer.perturb(0.01, 0, only="q_proj")  # from the starting B again: accepted


def test_zero_adapter_given_by_path_fails_adapter_moved(tmp_path: Path) -> None:
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj"], std=0.0)
    receipt = execute(RunOptions(**FAKE, adapter=adapter, out=tmp_path / "r.json")).receipt
    assert _status(receipt)["A.adapter_moved"] == CheckStatus.FAIL


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "DoRA adapters are not supported"),
    ({"target_modules": "q_proj|v_proj"}, "target_modules must be a list"),
    ({"peft_type": "IA3"}, "not a LoRA adapter"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_adapter_config_that_cannot_be_compared_is_refused(change: dict, message: str, tmp_path: Path) -> None:
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj"])
    config = json.loads((adapter / af.CONFIG_FILE).read_text())
    (adapter / af.CONFIG_FILE).write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message):
        execute(RunOptions(**FAKE, adapter=adapter, out=tmp_path / "r.json"))


def test_pickled_adapter_is_refused(tmp_path: Path) -> None:
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj"])
    (adapter / af.WEIGHTS_FILE).rename(adapter / "adapter_model.bin")
    with pytest.raises(ConfigError, match="pickle: lora-parity loads safetensors only"):
        execute(RunOptions(**FAKE, adapter=adapter, out=tmp_path / "r.json"))


def test_a_trainer_that_cannot_start_from_an_adapter_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from lora_parity.backends import fake

    monkeypatch.setattr(fake.FakeTrainer, "traits", replace(fake.FakeTrainer.traits,
                                                            start_adapter_unavailable="it is frozen"))
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj"])
    with pytest.raises(ConfigError, match=r"cannot start from a user's adapter \(it is frozen\)"):
        execute(RunOptions(**FAKE, adapter=adapter, out=tmp_path / "r.json"))


def test_adapter_changed_fault_is_caught_with_a_user_adapter(tmp_path: Path) -> None:
    adapter = _user_adapter(tmp_path / "adapter", ["q_proj", "v_proj"])
    before = generation.folder_digest(adapter)
    receipt = execute(RunOptions(**FAKE, adapter=adapter, inject="adapter-changed", out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.ERROR and "changed on disk" in (receipt.error or "")
    assert generation.folder_digest(adapter) == before  # the user's own files are never rewritten


def test_selftest_with_a_user_adapter_starts_every_run_of_every_seed_from_it(tmp_path: Path) -> None:
    from lora_parity.evidence.receipt import load as load_receipt

    from .conftest import cli

    adapter = _user_adapter(tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"])
    res = cli("selftest", "--trainer", "fake", "--sampler", "fake", "--seeds", "2", "--adapter", str(adapter),
              "--out-dir", str(tmp_path / "st"))
    assert res.returncode == 0, res.stdout + res.stderr
    receipts = sorted((tmp_path / "st").glob("seed-*/*.json"))
    assert len({p.parent.name for p in receipts}) == 2 and len(receipts) > 4
    for path in receipts:
        receipt, _ = load_receipt(path)
        assert receipt.start_adapter is not None, path
        assert receipt.error is not None or "adapter_base" in receipt.scores, path
        if receipt.injected_fault is None:
            assert _status(receipt)["A.adapter_moved"] == CheckStatus.PASS, path


def test_graphs_hold_old_generates_with_the_version_the_sync_replaced(tmp_path: Path) -> None:
    from lora_parity.backends.base import AdapterHandle
    from lora_parity.run.faults import Faults

    old, new = AdapterHandle("v0", 1, tmp_path / "v0"), AdapterHandle("v1", 2, tmp_path / "v1")
    targets = ["q_proj"]
    held = Faults("graphs-hold-old", targets, 4, 1.0, sampled=True)
    assert held.generation_handle(new, old) == old and held.generation_handle(new, None) == new  # nothing kept: as is
    assert Faults("gen-no-adapter", targets, 4, 1.0, sampled=True).generation_handle(new, old) is None
    assert Faults(None, targets, 4, 1.0).generation_handle(new, old) == new
    assert "graphs-hold-old" not in faults_for("inplace", sampled=True)  # one id: no replaced version to serve
