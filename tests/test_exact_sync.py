"""The exact sync check (X): the trainer's tensors, written by a writer of the tool's own and loaded
fresh under a new name and id, must score bit for bit as the synced adapter, on a sampler that repeats
itself exactly. The real-backend runs are in test_e2e_cpu.py and test_megatron.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import adapter_files as af
from lora_parity.models import config, fresh_adapter
from lora_parity.run.phases import FRESH_ID_OFFSET
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict import checks
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit

FAKE = {"trainer": "fake", "sampler": "fake", "per_target": False}


def test_the_fresh_writer_gives_a_peft_folder_the_readers_take(tmp_path: Path) -> None:
    a = ("F32", [2, 3], struct.pack("<6f", *range(6)))
    b = ("BF16", [3, 2], bytes(range(12)))
    folder = fresh_adapter.write(tmp_path / "fresh", {"m.lora_B.weight": b, "m.lora_A.weight": a}, 2, 4.0,
                                 ["v_proj", "q_proj"])
    config, tensors = af.read_adapter(folder)
    assert config["r"] == 2 and config["lora_alpha"] == 4.0 and config["target_modules"] == ["q_proj", "v_proj"]
    assert {n: (t.dtype, t.shape, t.data) for n, t in tensors.items()} == {"m.lora_A.weight": a,
                                                                            "m.lora_B.weight": b}
    header_len = struct.unpack("<Q", (folder / af.WEIGHTS_FILE).read_bytes()[:8])[0]
    assert header_len % 8 == 0  # the body starts aligned, as safetensors writes it
    with pytest.raises(ValueError, match="5 bytes for a F32 tensor of shape"):
        fresh_adapter.write(tmp_path / "bad", {"x": ("F32", [2], b"12345")}, 1, 1.0, ["q_proj"])


def test_a_clean_run_loads_the_trainers_tensors_fresh_and_they_score_identically(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    receipt = execute(RunOptions(**FAKE, out=out)).receipt
    names = [p.name for p in receipt.phases]
    assert names[names.index("updated") + 1] == "fresh"
    exact = {c.id: c for c in receipt.checks}["X.sync.identical"]
    assert exact.status == CheckStatus.PASS and exact.observed == 0 and exact.budget == 0
    assert receipt.scores["fresh"] == receipt.scores["updated"]
    assert verify(out).verdict == Verdict.PASS


@pytest.mark.parametrize("fault", ["skip-sync", "partial-export", "wrong-scale", "drop-target", "wrong-direction",
                                   "reuse-adapter-id", "up-gets-gate"])
def test_every_fault_in_what_the_sampler_got_fails_the_exact_check(fault: str, tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, inject=fault, out=tmp_path / "r.json")).receipt
    exact = {c.id: c for c in receipt.checks}["X.sync.identical"]
    assert exact.status == CheckStatus.FAIL and (exact.observed or 0) > 0
    assert "X.sync.identical" in receipt.verdicts.sync.decided_by


def _scores(updated: float, repeat: float, fresh: float) -> dict[str, list[list[float]]]:
    base = [[-1.0, -2.0, -3.0]]
    scores = {k: base for k in ("base", "zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat", "stale")}
    moved = [[-1.5, -2.5, -3.5]]
    scores["trainer_updated"] = moved
    scores["updated"] = [[x + updated for x in moved[0]]]
    scores["updated_repeat"] = [[x + repeat for x in scores["updated"][0]]]
    scores["fresh"] = [[x + fresh for x in scores["updated"][0]]]
    return scores


def test_the_check_is_bitwise_and_made_only_where_the_sampler_repeats_itself_exactly() -> None:
    ids = lambda scores: {c.id: c for c in checks.evaluate(scores, config.load(None).budgets, errored=False).checks}  # noqa: E731
    assert ids(_scores(0.0, 0.0, 0.0))["X.sync.identical"].status == CheckStatus.PASS
    one_ulp = ids(_scores(0.0, 0.0, 1e-12))["X.sync.identical"]
    assert one_ulp.status == CheckStatus.FAIL and one_ulp.observed == pytest.approx(1e-12)
    assert "X.sync.identical" not in ids(_scores(0.0, 1e-9, 1e-12))  # the engine itself is not bitwise
    without = _scores(0.0, 0.0, 0.0)
    del without["fresh"]
    assert "X.sync.identical" not in ids(without)  # receipts made before it, and trainers it cannot read


def test_the_fresh_adapter_id_never_meets_a_syncs(tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, out=tmp_path / "r.json")).receipt
    assert max(a.adapter_id for a in receipt.adapters) < FRESH_ID_OFFSET
    assert json.loads((tmp_path / "r.json").read_text())["scores"]["fresh"]
