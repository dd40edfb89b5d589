"""Issue 16, runner side: the calibrated update (std auto), the fp32 reference by default, error
receipts that say where, and the fp32-on-CUDA refusal."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from lora_parity.evidence import receipt as rc
from lora_parity.evidence import tracebacks
from lora_parity.models import config
from lora_parity.run import calibrate_trainer, faults
from lora_parity.run.runner import REFERENCE_MARGIN, RunOptions, execute, prepare, reference_decision
from lora_parity.util.errors import ConfigError, ReceiptError
from lora_parity.verdict import calibrate
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit


def _auto_config(tmp_path: Path, factor: float = 10.0) -> Path:
    data = config.load("tiny-qwen3").model_dump(mode="json", exclude_none=True)
    data["perturbation"] = {"std": "auto", "stimulus_factor": factor}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(tmp_path: Path, name: str, per_target: bool = False, **kw: Any) -> rc.Receipt:
    out = tmp_path / f"{name}.json"
    execute(RunOptions(model=str(_auto_config(tmp_path)), trainer="fake", sampler="fake", out=out,
                       per_target=per_target, **kw))
    return rc.load(out)[0]


def _reseal(data: dict[str, Any], dst: Path) -> Path:
    dst.write_text(json.dumps({**data, "digest": rc.compute_digest(data)}))
    return dst


# --- the search --------------------------------------------------------------------------------------


def test_search_picks_the_first_std_of_the_ladder_that_meets_the_target() -> None:
    calls: list[float] = []

    def linear(std: float) -> float:  # the trainer change of a model linear in B
        calls.append(std)
        return 5.0 * std

    cal = calibrate.search(linear, a_mean=0.004, factor=10, min_stimulus=0.1)
    assert cal.target == pytest.approx(0.1)  # max(10 x 0.004, 0.1)
    # 5 x std >= 0.1 first at std 0.032 = 0.002 x 2^4: five forwards, no more.
    assert calls == pytest.approx([0.002, 0.004, 0.008, 0.016, 0.032])
    assert cal.std == pytest.approx(0.032) and cal.met
    assert [s.std for s in cal.steps] == calls
    assert calibrate.search(linear, 0.004, 10, 0.1) == cal  # deterministic


def test_search_target_follows_a_when_the_noise_is_large() -> None:
    cal = calibrate.search(lambda std: 5.0 * std, a_mean=0.05, factor=10, min_stimulus=0.1)
    assert cal.target == pytest.approx(0.5) and cal.std == pytest.approx(0.128)


def test_search_is_bounded_and_keeps_the_last_std_when_the_target_is_out_of_reach() -> None:
    calls: list[float] = []
    cal = calibrate.search(lambda std: calls.append(std) or 1e-3 * std, a_mean=0.0, factor=10, min_stimulus=0.1)
    assert len(calls) == calibrate.MAX_STEPS == len(cal.steps)
    assert cal.std == pytest.approx(calibrate.START_STD * calibrate.GROWTH ** (calibrate.MAX_STEPS - 1))
    assert not cal.met


# --- the sequence on the fake backends ------------------------------------------------------------


def test_auto_std_is_calibrated_before_perturb_recorded_and_verified(tmp_path: Path) -> None:
    receipt = _run(tmp_path, "a")
    names = [p.name for p in receipt.phases]
    assert names.index("trainer_zero") < names.index("calibrate") == names.index("perturb") - 1
    p = receipt.perturbation
    assert p is not None and p.calibration is not None
    cal = p.calibration
    assert p.std == cal.std and cal.met and cal.upper == pytest.approx(1.5 * cal.target)
    # The window's floor is B.stimulus's threshold (at least min_stimulus), as the receipt records it.
    assert cal.min_stimulus == receipt.thresholds["B.stimulus"].budget >= receipt.budgets.min_stimulus
    assert cal.target == max(10 * cal.a_mean, cal.min_stimulus)
    # The trainer change of the update that was applied is the chosen step's, inside the window.
    change = calibrate.mean_change(receipt.scores["trainer_zero"], receipt.scores["trainer_updated"])
    chosen = next(s for s in cal.steps if s.std == cal.std)
    assert change == pytest.approx(chosen.trainer_change, rel=1e-12) and cal.target <= change <= cal.upper
    assert verify(tmp_path / "a.json").verdict == receipt.verdict
    assert _run(tmp_path, "b").perturbation == p  # same seed, same search


def test_per_target_coverage_calibrates_each_target(tmp_path: Path) -> None:
    receipt = _run(tmp_path, "t", per_target=True)
    p = receipt.perturbation
    assert p is not None and p.target_calibrations is not None
    assert set(p.target_calibrations) == set(config.load("tiny-qwen3").adapter.targets)
    for kind, cal in p.target_calibrations.items():
        change = calibrate.mean_change(receipt.scores["trainer_zero"], receipt.scores[f"target.{kind}.trainer"])
        assert change == pytest.approx(cal.steps[-1].trainer_change, rel=1e-12)
        assert cal.met == (change >= cal.target)
        assert cal.start_std == p.std  # one target moves less than all: its ladder starts at the whole update's std
    verify(tmp_path / "t.json")


def test_fixed_std_configs_do_not_calibrate(tmp_path: Path) -> None:
    out = tmp_path / "fixed.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False))
    receipt = rc.load(out)[0]
    assert "calibrate" not in [p.name for p in receipt.phases]
    assert receipt.perturbation is not None and receipt.perturbation.calibration is None


def test_verify_rejects_a_tampered_chosen_std(tmp_path: Path) -> None:
    receipt = _run(tmp_path, "c")
    data = json.loads((tmp_path / "c.json").read_text())
    steps = data["perturbation"]["calibration"]["steps"]
    assert len(steps) >= 2
    # Claim the search stopped one step earlier (a smaller update that "met" the target).
    data["perturbation"]["calibration"]["steps"] = steps[:-1]
    data["perturbation"]["calibration"]["std"] = data["perturbation"]["std"] = steps[-2]["std"]
    with pytest.raises(ReceiptError, match="calibration"):
        verify(_reseal(data, tmp_path / "tampered.json"))
    # Or keep the ladder and change only the chosen std.
    data = json.loads((tmp_path / "c.json").read_text())
    data["perturbation"]["calibration"]["std"] = steps[0]["std"]
    with pytest.raises(ReceiptError, match="chosen std"):
        verify(_reseal(data, tmp_path / "tampered2.json"))
    assert receipt.perturbation is not None


def test_verify_rejects_a_target_not_computed_from_a(tmp_path: Path) -> None:
    _run(tmp_path, "d")
    data = json.loads((tmp_path / "d.json").read_text())
    data["perturbation"]["calibration"]["a_mean"] = 0.5
    with pytest.raises(ReceiptError, match="a_mean"):
        verify(_reseal(data, tmp_path / "tampered.json"))


# --- the fp32 reference by default ---------------------------------------------------------------------


def _never() -> tuple[int, int]:
    raise AssertionError("measured memory where the decision needs none")


@pytest.mark.parametrize(("choice", "checkpoint", "dtype", "status", "reason"), [
    ("none", True, "bfloat16", "skipped", "--reference none"),
    (None, False, "bfloat16", "skipped", "no checkpoint"),
    ("fp32", True, "float32", "scored", "asked for"),
    (None, True, "float32", "skipped", "the model is fp32"),
])
def test_reference_decision_without_measuring(choice: str | None, checkpoint: bool, dtype: str, status: str,
                                              reason: str) -> None:
    decision = reference_decision(choice, checkpoint, dtype, _never)
    assert decision.status == status and reason in decision.reason


def test_reference_is_scored_by_default_in_bf16_when_the_fp32_copy_fits() -> None:
    need = 540 * 2**20
    fits = reference_decision(None, True, "bfloat16", lambda: (need, int(need * REFERENCE_MARGIN) + 1))
    assert fits.status == "scored" and fits.fp32_bytes == need
    tight = reference_decision(None, True, "float16", lambda: (need, int(need * REFERENCE_MARGIN) - 1))
    assert tight.status == "skipped" and "does not fit" in tight.reason
    assert tight.available_bytes == int(need * REFERENCE_MARGIN) - 1


def test_fake_run_records_the_reference_decision(tmp_path: Path) -> None:
    receipt = _run(tmp_path, "r")
    assert receipt.reference is not None and receipt.reference.status == "skipped"
    assert "reference_fp32" not in receipt.scores


def test_reference_option_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown reference"):
        prepare(RunOptions(trainer="fake", sampler="fake", reference="fp64"))
    prepare(RunOptions(trainer="fake", sampler="fake", reference="none"))


# --- errors that say where ---------------------------------------------------------------------------------


def test_crash_receipt_names_the_file_and_line(tmp_path: Path) -> None:
    receipt = _run(tmp_path, "crash", inject="crash-at=stale")
    line = inspect.getsourcelines(faults.Faults.on_phase)[1]
    body = inspect.getsource(faults.Faults.on_phase).splitlines()
    raise_line = line + next(i for i, text in enumerate(body) if "raise PhaseError" in text)
    where = f"lora_parity/run/faults.py:{raise_line} on_phase"
    failed = receipt.phases[-1]
    assert failed.name == "stale" and failed.error_type == "PhaseError"
    assert failed.frames is not None and failed.frames[-1] == where and len(failed.frames) <= tracebacks.MAX_FRAMES
    assert receipt.error_detail is not None
    assert (receipt.error_detail.where, receipt.error_detail.frames[-1]) == ("stale", where)
    assert not any(f.startswith("/") for f in receipt.error_detail.frames)
    verify(tmp_path / "crash.json")


def test_a_bare_exception_says_where_in_one_line() -> None:
    try:
        raise AssertionError  # the bare AssertionError vLLM raised on the GPU
    except AssertionError as e:
        line = tracebacks.one_line(e)
        detail = tracebacks.describe(e, "setup")
    assert line.startswith("AssertionError: ") and "tests/test_calibrate.py:" in line
    assert detail.type == "AssertionError" and detail.message == "" and detail.where == "setup"


def test_frame_paths_are_relative() -> None:
    rel = tracebacks.relative_path
    assert rel("/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py") == "vllm/v1/engine/core.py"
    assert rel(calibrate.__file__) == "lora_parity/verdict/calibrate.py"
    assert rel("/somewhere/else/thing.py") == "thing.py"


# --- fp32 on CUDA with vLLM ----------------------------------------------------------------------------


def test_vllm_fp32_on_cuda_is_refused_at_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "_has_cuda", lambda: True)
    with pytest.raises(ConfigError, match="fp32"):
        vllm_backend.refuse_fp32_on_cuda(config.load("tiny-qwen3"))
    vllm_backend.refuse_fp32_on_cuda(config.load("qwen3-0.6b-synth"))  # bf16: allowed
    from lora_parity.models import synthetic

    folder = synthetic.materialize(config.load("tiny-qwen3"))  # an fp32 checkpoint by path: --dtype casts it
    with pytest.raises(ConfigError, match="with --dtype bfloat16"):
        vllm_backend.refuse_fp32_on_cuda(config.load(str(folder)))
    vllm_backend.refuse_fp32_on_cuda(config.load(str(folder), dtype="bfloat16"))
    monkeypatch.setattr(vllm_backend, "_has_cuda", lambda: False)
    vllm_backend.refuse_fp32_on_cuda(config.load("tiny-qwen3"))  # the CPU build runs fp32


def test_vllm_fp32_on_cuda_refusal_is_a_preflight_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "_has_cuda", lambda: True)
    with pytest.raises(ConfigError, match="cannot start an fp32 model") as refused:
        prepare(RunOptions(model="tiny-qwen3", trainer="fake", sampler="vllm"))
    # a config names its own dtype (--dtype is refused for it): the way out the line names must work
    assert "model.dtype: bfloat16" in str(refused.value) and "--dtype" not in str(refused.value)
    # and its fp32 budgets would fail the bf16 run at A (measured: tiny-qwen3-moe in bf16 on an H100)
    assert "--budgets bf16" in str(refused.value)


# --- batch-invariant vLLM ------------------------------------------------------------------------------


@pytest.mark.parametrize(("wanted", "why_not", "user", "env", "said"), [
    (True, None, None, "1", "on"),
    (False, None, None, "0", "off (--no-batch-invariant or the config's sampler.batch_invariant)"),
    (True, "not on CUDA", None, "0", "off (not on CUDA)"),
    (True, None, "0", "0", "off (VLLM_BATCH_INVARIANT=0 set by the user)"),
    (True, "not on CUDA", "1", "1", "on (VLLM_BATCH_INVARIANT=1 set by the user)"),
])
def test_batch_invariant_environment(monkeypatch: pytest.MonkeyPatch, wanted: bool, why_not: str | None,
                                     user: str | None, env: str, said: str) -> None:
    import os

    from lora_parity.backends import vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "batch_invariant_support", lambda: why_not)
    # setenv first, so that monkeypatch removes what the code sets: a VLLM_BATCH_INVARIANT=1 left in
    # this process would reach every later in-process vLLM-CPU engine (which fails with it).
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    if user is not None:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", user)
    assert vllm_backend._batch_invariant_environment(wanted) == said
    assert os.environ["VLLM_BATCH_INVARIANT"] == env


def test_batch_invariant_is_off_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import vllm as vllm_backend

    monkeypatch.setattr(vllm_backend, "_has_cuda", lambda: False)
    assert vllm_backend.batch_invariant_support() is not None


def test_sampler_import_times_the_lookups_that_import_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 47: finding vLLM's batch-invariant module imports the vLLM packages above it (on CUDA); that time is
    the sampler's import, not a gap outside every timer."""
    import time

    from lora_parity.backends import vllm as vllm_backend

    class Stop(Exception):
        pass

    def slow_lookup(wanted: bool) -> str:
        time.sleep(0.3)
        return "off (this test)"

    def stop(*args: object) -> dict[str, object]:
        raise Stop

    pytest.importorskip("vllm")
    from vllm import LLM  # noqa: F401  (imported already: the sampler's imports then cost nothing, only the lookup)
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.lora.request import LoRARequest  # noqa: F401
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):  # restored afterwards, set or not
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(vllm_backend, "_batch_invariant_environment", slow_lookup)
    monkeypatch.setattr(vllm_backend, "_has_cuda", lambda: True)  # no CPU environment set in this process
    monkeypatch.setattr(vllm_backend, "engine_options", stop)  # right after the imports, before the engine
    timings: dict[str, float] = {}
    with pytest.raises(Stop):
        vllm_backend.VLLMSampler(config.load(None), tmp_path, timings)
    assert timings["sampler.import"] >= 0.3


def test_no_calibration_for_an_optimizer_step_trainer() -> None:
    cfg = config.load("tiny-qwen3")
    calls: list[str] = []

    class OptimizerTrainer:
        def zero_b(self) -> None:
            calls.append("zero_b")

        def perturb(self, std: float, seed: int, only: str | None = None) -> rc.Perturbation:
            calls.append("perturb")
            return rc.Perturbation(kind="optimizer_step", seed=seed, std=0.0, num_tensors=0, num_elements=0,
                                   tensors=[], learning_rate=0.01)

        def score(self, sequences: list[list[int]]) -> list[list[float]]:
            raise AssertionError("an optimizer-step trainer is not searched")

    scores = {"zero": [[-1.0, -2.0]], "trainer_zero": [[-1.0, -2.0]]}
    assert calibrate_trainer.on_trainer(OptimizerTrainer(), [[1, 2, 3]], scores, 0, cfg) is None  # type: ignore[arg-type]
    assert calls == ["zero_b", "perturb", "zero_b"]  # one update, then back to zero-init


def test_cli_takes_reference_none_and_no_batch_invariant(tmp_path: Path) -> None:
    from .conftest import cli

    out = tmp_path / "r.json"
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--reference", "none",
              "--no-batch-invariant", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    reference = rc.load(out)[0].reference
    assert reference is not None and reference.status == "skipped" and "--reference none" in reference.reason


def test_check_rejects_a_search_that_stopped_early_without_meeting_the_target() -> None:
    cal = calibrate.search(lambda std: 1e-3 * std, a_mean=0.0, factor=10, min_stimulus=0.1)
    assert calibrate.check(cal, cal.std, {}, "trainer_updated", 0.1) is None
    short = cal.model_copy(update={"steps": cal.steps[:3], "std": cal.steps[2].std})
    assert "stopped before" in (calibrate.check(short, short.std, {}, "trainer_updated", 0.1) or "")
    assert "min_stimulus" in (calibrate.check(cal, cal.std, {}, "trainer_updated", 0.2) or "")


class _LadderTrainer:
    """B noise whose trainer change is the std itself (scores: one position, -1 - std)."""

    def __init__(self) -> None:
        self.std = 0.0
        self.calls: list[str] = []

    def zero_b(self) -> None:
        self.calls.append("zero_b")
        self.std = 0.0

    def perturb(self, std: float, seed: int, only: str | None = None) -> rc.Perturbation:
        self.calls.append(f"perturb {only}")
        self.std = std
        return rc.Perturbation(kind="lora_b_noise", seed=seed, std=std, num_tensors=1, num_elements=1, tensors=["b"])

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        self.calls.append("score")
        return [[-1.0 - self.std]]


def test_kept_search_leaves_the_trainer_at_the_chosen_std_and_returns_its_scores() -> None:
    cfg = config.load("tiny-qwen3")  # min_stimulus 0.05, factor 10: the target is 0.05 with A = 0
    trainer = _LadderTrainer()
    scores = {"zero": [[-1.0]], "trainer_zero": [[-1.0]]}
    found = calibrate_trainer.on_trainer_kept(trainer, [[1, 2]], scores, 0, cfg, "q_proj", 0.02)  # type: ignore[arg-type]
    assert found is not None
    cal, kept = found
    # The window is [0.05, 0.075]: 0.08 overshoots it, so the search bisects between 0.04 and 0.08.
    mid = (0.04 * 0.08) ** 0.5
    assert [s.std for s in cal.steps] == pytest.approx([0.02, 0.04, 0.08, mid]) and cal.std == mid and cal.met
    assert kept == [[-1.0 - mid]] and trainer.std == mid  # the last forward's scores, and the trainer still there
    assert trainer.calls[-3:] == ["zero_b", "perturb q_proj", "score"]
    # on_trainer searches the same ladder and leaves B zero
    assert calibrate_trainer.on_trainer(trainer, [[1, 2]], scores, 0, cfg, "q_proj", 0.02) == cal  # type: ignore[arg-type]
    assert trainer.std == 0.0 and trainer.calls[-1] == "zero_b"


def test_kept_search_leaves_b_zero_when_a_forward_fails() -> None:
    cfg = config.load("tiny-qwen3")
    trainer = _LadderTrainer()

    def broken(sequences: list[list[int]]) -> list[list[float]]:
        raise RuntimeError("forward failed")

    trainer.score = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="forward failed"):
        calibrate_trainer.on_trainer_kept(trainer, [[1, 2]], {"zero": [[-1.0]], "trainer_zero": [[-1.0]]}, 0, cfg,  # type: ignore[arg-type]
                                  "q_proj", 0.02)
    assert trainer.std == 0.0


def test_per_target_trainer_scores_are_not_run_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends.fake import FakeTrainer

    forwards = [0]
    score = FakeTrainer.score

    def counted(self: FakeTrainer, sequences: list[list[int]]) -> list[list[float]]:
        forwards[0] += 1
        return score(self, sequences)

    monkeypatch.setattr(FakeTrainer, "score", counted)
    receipt = _run(tmp_path, "t", per_target=True)
    p = receipt.perturbation
    assert p is not None and p.calibration is not None and p.target_calibrations is not None
    searched = len(p.calibration.steps) + sum(len(c.steps) for c in p.target_calibrations.values())
    # trainer_zero twice, each search step once, trainer_updated once and once per sequence (trainer_updated_alt):
    # no per-target forward after its search
    assert forwards[0] == 2 + searched + 1 + len(receipt.probes.sequences)
    assert not any(k.startswith("score.target.") and k.endswith(".trainer") for k in receipt.timings)
    assert receipt.verdict == rc.Verdict.PASS
    verify(tmp_path / "t.json")


@pytest.mark.parametrize("fault", ["drop-target", "wrong-direction", "frozen-trainer", "skip-sync"])
def test_faults_are_caught_with_std_auto_and_per_target_coverage(tmp_path: Path, fault: str) -> None:
    receipt = _run(tmp_path, fault, per_target=True, inject=fault)
    expected = faults.Faults(fault, list(config.load("tiny-qwen3").adapter.targets), 1, 1.0).expected()
    failing = {c.id for c in receipt.checks if c.status.value == expected.verdict}
    assert receipt.verdict.value == expected.verdict and set(expected.caught_by) <= failing
    assert verify(tmp_path / f"{fault}.json").verdict == receipt.verdict


# --- the bounded window (noise rule) --------------------------------------------------------------


def test_window_search_bounds_an_overshooting_ladder() -> None:
    """Issue defect 2: a change that grows fast with std made the doubling ladder overshoot the target by
    up to 2x (and more at the next step); the window search bisects back into [target, 1.5 x target]."""
    quadratic = lambda std: 200.0 * std * std  # noqa: E731
    ladder = calibrate.search(quadratic, a_mean=0.01, factor=10, min_stimulus=0.1)
    window = calibrate.search_window(quadratic, a_mean=0.01, factor=10, lower=0.1, ceiling=1.5)
    assert ladder.steps[-1].trainer_change > 1.5 * ladder.target  # the ladder's choice: 2.9x the target
    chosen = next(s for s in window.steps if s.std == window.std)
    assert window.met and window.target <= chosen.trainer_change <= 1.5 * window.target
    assert len(window.steps) <= calibrate.WINDOW_STEPS


def test_window_search_halves_when_it_starts_above_the_window() -> None:
    window = calibrate.search_window(lambda std: 100.0 * std, a_mean=0.0, factor=10, lower=0.05, ceiling=1.5,
                                     start=0.01)
    assert window.steps[0].trainer_change > window.upper and window.std < 0.01 and window.met


def test_window_search_out_of_reach_keeps_the_largest_change() -> None:
    window = calibrate.search_window(lambda std: 1e-3 * std, a_mean=0.0, factor=10, lower=0.1, ceiling=1.5)
    assert not window.met and len(window.steps) == calibrate.WINDOW_STEPS
    assert window.std == max(s.std for s in window.steps)


def test_verify_replays_the_window_search_and_refuses_a_tampered_one() -> None:
    budgets = config.load("tiny-qwen3").budgets
    cal = calibrate.search_window(lambda std: 200.0 * std * std, a_mean=0.0, factor=10,
                                  lower=budgets.min_stimulus, ceiling=1.5)
    assert calibrate.check(cal, cal.std, {}, "trainer_updated", budgets.min_stimulus, 1.5) is None
    other = cal.steps[0] if cal.steps[0].std != cal.std else cal.steps[-1]
    picked = cal.model_copy(update={"std": other.std})
    assert "choice" in (calibrate.check(picked, picked.std, {}, "trainer_updated", budgets.min_stimulus, 1.5) or "")
    moved = cal.model_copy(update={"steps": [cal.steps[0].model_copy(update={"std": 0.005}), *cal.steps[1:]]})
    assert "window search" in (calibrate.check(moved, moved.std, {}, "trainer_updated", budgets.min_stimulus, 1.5)
                               or "")
    assert "calibration_ceiling" in (calibrate.check(cal, cal.std, {}, "trainer_updated", budgets.min_stimulus, 2.0)
                                     or "")
