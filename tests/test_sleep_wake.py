"""Sleep and wake after the sync (issue 44; docs/deployment.md, "Sleep and wake"): for each level asked, the engine
sleeps, wakes its weights, gets the sync, wakes its KV cache and scores (`sleep_wake.levelN`), then sleeps and wakes
again without a sync (`wake_again.levelN`); both must give the synced adapter's scores (W.*). On the fakes, and the
in-process vLLM sampler's calls against a stand-in `LLM` (the GPU run is a later session's)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lora_parity.backends import fake, sleep
from lora_parity.backends.base import AdapterHandle, BackendTraits
from lora_parity.backends.vllm import VLLMSampler
from lora_parity.evidence.receipt import BackendInfo, CheckStatus, Receipt, Verdict, compute_digest
from lora_parity.models import config
from lora_parity.run import selftest as st
from lora_parity.run import sleep_wake
from lora_parity.run.faults import FAULTS, Faults, faults_for, not_applicable
from lora_parity.run.options import RunOptions
from lora_parity.run.phases import Run
from lora_parity.run.runner import execute
from lora_parity.util.errors import ConfigError, PhaseError, ReceiptError
from lora_parity.verdict import lifecycle
from lora_parity.verdict.verify import verify

from .conftest import cli, run_fakes

FAKE: dict[str, Any] = {"trainer": "fake", "sampler": "fake"}
SLEEP_CHECKS = ("W.sleep_wake.level1", "W.wake_again.level1", "W.sleep_wake.level2", "W.wake_again.level2")


def run(tmp_path: Path, **kw: Any) -> Receipt:
    return run_fakes(tmp_path, f"-{kw.get('sleep_levels')}", **kw)


def checks(receipt: Receipt) -> dict[str, Any]:
    return {c.id: c for c in receipt.checks}


def rows(receipt: Receipt) -> dict[str, Any]:
    return {r.condition: r for r in lifecycle.of_receipt(receipt)}


@pytest.mark.parametrize("sync", ["new-id", "inplace", "merged", "memory"])
def test_a_clean_run_sleeps_at_both_levels_after_the_sync_and_covers_both_rows(tmp_path: Path, sync: str) -> None:
    receipt = run(tmp_path, sync=sync, sleep_levels="1,2")
    assert receipt.verdict == Verdict.PASS
    names = [p.name for p in receipt.phases]
    sleeps = [n for level in (1, 2) for n in lifecycle.SLEEP_PHASES[level]]
    assert [n for n in names if n in sleeps] == sleeps  # level 1 first, each sleep_wake before its wake_again
    assert names.index("updated") < names.index(sleeps[0]) and names.index(sleeps[-1]) < min(
        i for i, n in enumerate(names) if n.startswith("target."))  # after the sync's phases, before coverage
    c = checks(receipt)
    assert {c[i].status for i in SLEEP_CHECKS} == {CheckStatus.PASS}
    assert all(receipt.scores[name] == receipt.scores["updated"] for name in sleeps)
    assert rows(receipt)["sleep level 1 + wake"].status == rows(receipt)["sleep level 2 + wake"].status == "covered"
    # Each sleep_wake synced a new version as the mode publishes one; wake_again at level 2 put the current one back:
    # under a new name and id where the mode keeps a name per version, in place or as merged weights otherwise.
    assert [a.version for a in receipt.adapters[:4]] == [0, 1, 2, 3] and receipt.adapters[2].mode == sync
    restores = [a.name for a in receipt.adapters if a.name.endswith("-restore")]
    assert restores == (["lora-parity-5-v4-restore"] if sync == "new-id" else [])


def test_one_level_asked_runs_that_level_only(tmp_path: Path) -> None:
    receipt = run(tmp_path, sleep_levels="2")
    assert [c for c in checks(receipt) if c.startswith("W.")] == ["W.sleep_wake.level2", "W.wake_again.level2"]
    r = rows(receipt)
    assert r["sleep level 2 + wake"].status == "covered" and r["sleep level 1 + wake"].status == "not covered"
    assert "asked for no level-1 sleep (--sleep-levels" in r["sleep level 1 + wake"].detail


@pytest.mark.parametrize(("fault", "sync", "check", "says"), [
    ("wake-drops-adapter", "new-id", "W.sleep_wake.level1", "after the wake the adapter no longer applies"),
    ("wake-drops-adapter", "inplace", "W.sleep_wake.level1", "after the wake the adapter no longer applies"),
    ("wake-reloads-base", "merged", "W.sleep_wake.level1", "the checkpoint's weights reloaded over the synced ones"),
    ("wake-reloads-base", "memory", "W.sleep_wake.level2", "after the wake the adapter no longer applies"),
    ("level2-base-lost", "new-id", "W.sleep_wake.level2", "the base or the adapter was not restored (verl #7289"),
    ("level2-base-lost", "inplace", "W.wake_again.level2", "which discarded them"),
])
def test_each_sleep_fault_fails_its_check_with_its_line_while_c_passes(tmp_path: Path, fault: str, sync: str,
                                                                       check: str, says: str) -> None:
    receipt = run(tmp_path, sync=sync, inject=fault, sleep_levels="1,2")
    c = checks(receipt)
    assert c[check].status == CheckStatus.FAIL and says in c[check].reason
    assert c["C.parity.mean"].status == CheckStatus.PASS  # the sync before any sleep was fine
    assert receipt.verdicts is not None and receipt.verdicts.sync.verdict == Verdict.FAIL
    for declared in FAULTS[fault].caught_by:
        assert any(c.get(i) is not None and c[i].status == CheckStatus.FAIL for i in declared.split("|"))


def test_a_level1_fault_leaves_level2_alone_and_the_reverse(tmp_path: Path) -> None:
    dropped = checks(run(tmp_path, inject="wake-drops-adapter", sleep_levels="1,2"))
    assert dropped["W.sleep_wake.level2"].status == dropped["W.wake_again.level2"].status == CheckStatus.PASS
    lost = checks(run(tmp_path, inject="level2-base-lost", sleep_levels="1,2"))
    assert lost["W.sleep_wake.level1"].status == lost["W.wake_again.level1"].status == CheckStatus.PASS


def test_the_selftest_catches_every_sleep_fault_in_every_seed_and_the_others_still(tmp_path: Path) -> None:
    result = st.selftest(RunOptions(**FAKE, sleep_levels="1,2"), tmp_path / "adapter", seeds=2)
    assert result.ok and result.false_alarms == 0, [(r.fault, r.observed) for r in result.rows if not r.caught]
    ran = {r.fault for r in result.rows}
    assert {"wake-drops-adapter", "level2-base-lost"} <= ran and "wake-reloads-base" not in ran  # adapter modes
    merged = st.selftest(RunOptions(**FAKE, sync="merged", sleep_levels="1,2"), tmp_path / "merged", seeds=2,
                         only=("wake-reloads-base",))
    assert merged.ok and [r.fault for r in merged.rows if not r.clean] == ["wake-reloads-base"] * 2


def test_sleep_faults_apply_only_to_the_levels_a_run_exercises_on_a_sampler_that_sleeps(tmp_path: Path) -> None:
    traits = fake.FakeSampler.traits
    assert not {"wake-drops-adapter", "level2-base-lost"} & set(faults_for("new-id", traits))  # no level asked
    assert "wake-drops-adapter" in faults_for("new-id", traits, sleeps=(1,))
    assert "level2-base-lost" not in faults_for("new-id", traits, sleeps=(1,))
    assert "wake-reloads-base" in faults_for("merged", traits, sleeps=(2,))
    assert "wake-reloads-base" not in faults_for("new-id", traits, sleeps=(1, 2))  # an adapter sync keeps the base
    assert "level2-base-lost" not in faults_for("new-id", BackendTraits(), sleeps=(1, 2))
    assert "does not do" in (not_applicable("wake-drops-adapter", BackendTraits()) or "")
    with pytest.raises(ConfigError, match="needs --sleep-levels 2"):
        execute(RunOptions(**FAKE, inject="level2-base-lost", sleep_levels="1", out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match="--sleep-levels '3'"):
        execute(RunOptions(**FAKE, sleep_levels="3", out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match=r"no phase 'sleep_wake\.level1'"):  # a crash where no sleep runs
        execute(RunOptions(**FAKE, inject="crash-at=sleep_wake.level1", out=tmp_path / "r.json"))


def test_a_sampler_without_sleep_mode_skips_the_phases_and_the_rows_say_why(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    why = "vLLM-CPU has no sleep mode: the platform's is_sleep_mode_available() is False"
    monkeypatch.setattr(fake.FakeSampler, "traits", BackendTraits(needs_checkpoint=False, mixed_batch_unavailable=None,
                                                                  sleep_unavailable=why))
    monkeypatch.setattr(fake.FakeSampler, "info", lambda self: BackendInfo(
        backend="fake", versions={}, settings={"sleep_mode": sleep.setting(why, ())}))
    receipt = run(tmp_path, sleep_levels="1,2")
    assert receipt.verdict == Verdict.PASS and not any(p.name.startswith(("sleep_", "wake_")) for p in receipt.phases)
    assert not any(c.startswith("W.") for c in checks(receipt))
    for level in (1, 2):
        row = rows(receipt)[f"sleep level {level} + wake"]
        assert row.status == "not covered" and row.detail == f"no sleep/wake phase ran: off ({why})"
    with pytest.raises(ConfigError, match="breaks sleep and wake, which this sampler does not do"):
        execute(RunOptions(**FAKE, inject="wake-drops-adapter", sleep_levels="1", out=tmp_path / "f.json"))


def test_a_phase_that_failed_is_said_so_and_not_covered(tmp_path: Path) -> None:
    receipt = run(tmp_path, inject="crash-at=wake_again.level2", sleep_levels="1,2")
    r = rows(receipt)
    assert r["sleep level 1 + wake"].status == "covered"
    assert r["sleep level 2 + wake"].detail == "the sleep/wake phases did not complete"


def test_verify_recomputes_the_sleep_checks(tmp_path: Path) -> None:
    out = tmp_path / "sleep.json"
    execute(RunOptions(**FAKE, out=out, sleep_levels="1,2"))
    data = json.loads(out.read_text())  # the check removed, the receipt sealed again: verify makes it anyway
    data["checks"] = [c for c in data["checks"] if c["id"] != "W.wake_again.level2"]
    data["digest"] = compute_digest(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match=r"W\.wake_again\.level2"):
        verify(edited)


def test_receipts_made_before_the_sleep_phases_verify_without_them(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # the sequence as it was: no sleep phase, whatever was asked
        m.setattr(sleep_wake, "levels", lambda run: ())
        old = run(tmp_path, sleep_levels="1,2")
    assert old.verdict == Verdict.PASS and not any(k.startswith(("sleep_wake", "wake_again")) for k in old.scores)
    assert not any(c.id.startswith("W.") for c in old.checks)
    assert rows(old)["sleep level 1 + wake"].status == "not covered"
    plain = run(tmp_path)  # the default asks for no sleep level
    assert not any(c.id.startswith("W.") for c in plain.checks)


def test_the_fake_engine_sleeps_as_vllm_level1_keeps_weights_level2_loses_them_until_loaded(tmp_path: Path) -> None:
    cfg = config.load(None)
    sampler = fake.FakeSampler(cfg, None, {})
    trainer = fake.FakeTrainer(cfg, None, 0, {})
    trainer.perturb(0.05, 0)
    folder = trainer.export_adapter(tmp_path / "a")
    handle = sampler.publish(folder, "a", 1)
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    adapter, base = sampler.score(seqs, handle), sampler.score(seqs, None)
    sampler.sleep(1)
    with pytest.raises(PhaseError, match="cannot score: its kv_cache and weights sleep"):
        sampler.score(seqs, handle)
    sampler.wake_up([sleep.WEIGHTS])
    with pytest.raises(PhaseError, match="its kv_cache sleep"):
        sampler.score(seqs, handle)
    sampler.wake_up([sleep.KV_CACHE])
    assert sampler.score(seqs, handle) == adapter  # level 1 kept everything
    sampler.sleep(2)
    with pytest.raises(PhaseError, match="cannot load an adapter"):
        sampler.publish(folder, "a", 1, inplace=True)
    sampler.wake_up()
    assert sampler.score(seqs, None) == [[sleep.LOST_LOGPROB] * 3, [sleep.LOST_LOGPROB] * 2]  # the base lost
    sampler.reset_base()
    assert sampler.score(seqs, None) == base and sampler.score(seqs, handle) == base  # the adapter's values lost
    sampler.publish(folder, "a", 1)  # vLLM keeps what it has under a loaded id without load_inplace
    assert sampler.score(seqs, handle) == base
    sampler.publish(folder, "a", 1, inplace=True)
    assert sampler.score(seqs, handle) == adapter


class StandInLLM:
    """`vllm.LLM` as the sampler calls it around a sleep, each call recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.llm_engine = SimpleNamespace(add_lora=lambda r: self.calls.append(("add_lora", r.lora_int_id,
                                                                                 r.load_inplace)),
                                          remove_lora=lambda i: self.calls.append(("remove_lora", i)))

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """A method name, or a callable run with the (one) worker first, as vLLM's `run_method` does."""
        def reload_weights(weights_path: str | None = None, **_: Any) -> None:
            self.calls.append(("reload_weights", weights_path))

        if callable(method):  # backends.vllm_reload: an unwrapped model (LoRA off here) takes the engine's own route
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0", "a callable sent to an engine core process"
            worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2)),
                                     reload_weights=reload_weights)
            method(worker, *args, **(kwargs or {}))
        else:
            self.calls.append((method, (kwargs or {}).get("weights_path")))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts: list[dict[str, Any]], params: Any, lora_request: Any, use_tqdm: bool) -> list[Any]:
        self.calls.append(("generate", lora_request.lora_int_id if lora_request else None))
        return [SimpleNamespace(prompt_logprobs=[None] + [{t: SimpleNamespace(logprob=-1.0)} for t in
                                                          p["prompt_token_ids"][1:]]) for p in prompts]


def lora_request(name: str, adapter_id: int, path: str, load_inplace: bool = False) -> Any:
    """vLLM's `LoRARequest`, as far as the sampler fills it."""
    return SimpleNamespace(lora_name=name, lora_int_id=adapter_id, lora_path=path, load_inplace=load_inplace)


def vllm_run(tmp_path: Path, sync: str = "new-id") -> Run:
    """A run of the fake trainer against the vLLM sampler on a stand-in LLM, synced (versions 0 and 1 published)."""
    cfg = config.load(None)
    engine = object.__new__(VLLMSampler)
    engine.cfg, engine.cuda, engine.pack, engine.params, engine.model_dir = cfg, True, 0, None, tmp_path / "ckpt"
    engine._TokensPrompt, engine._LoRARequest, engine.llm = dict, lora_request, StandInLLM()
    engine.traits = replace(VLLMSampler.traits, sleep_unavailable=None)
    r = Run(cfg=cfg, trainer=fake.FakeTrainer(cfg, None, 0, {}), sampler=engine, sequences=[[1, 2, 3], [4, 5]],
            seed=0, workdir=tmp_path, faults=Faults(None, list(cfg.adapter.targets), 3, 1e-3), sync_mode=sync)
    r.mode.publish(r, version=0)
    r.trainer.perturb(0.05, 0)
    r.mode.sync(r)
    engine.llm.calls.clear()
    return r


@pytest.mark.parametrize("in_process", ["0", "1"])
def test_the_vllm_sampler_sleeps_wakes_the_weights_reloads_syncs_then_wakes_the_kv_cache(
        tmp_path: Path, in_process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # in process the reload runs backends.vllm_reload in the worker; an engine core of its own gets the method name
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", in_process)
    r = vllm_run(tmp_path)
    engine: Any = r.sampler
    assert isinstance(engine, sleep.SleepingSampler) and engine.sleep_levels == (1, 2)
    synced = r.handle
    assert synced is not None
    sleep_wake.sleep_sync_wake(r, 2)
    calls = engine.llm.calls
    new = r.handle
    assert new is not None and new.adapter_id != synced.adapter_id  # a new version, as new-id publishes one
    assert calls[:3] == [("sleep", 2), ("wake_up", ["weights"]), ("reload_weights", str(tmp_path / "ckpt"))]
    order = [c[0] for c in calls]
    assert order.index("reload_weights") < order.index("add_lora") < calls.index(("wake_up", ["kv_cache"])) \
        < order.index("generate")
    assert ("add_lora", new.adapter_id, False) in calls and ("remove_lora", synced.adapter_id) in calls
    assert ("generate", new.adapter_id) in calls and "sleep_wake.level2" in r.scores

    calls.clear()
    sleep_wake.wake_again(r, 2)  # the loop's restore: the base reloaded, the same folder under a new name and id
    assert [c[0] for c in calls[:4]] == ["sleep", "wake_up", "reload_weights", "reset_prefix_cache"]
    restored = r.handle
    assert restored is not None and restored.adapter_id not in (synced.adapter_id, new.adapter_id)
    assert restored.path == new.path and calls[1] == ("wake_up", None)
    assert calls[4] == ("add_lora", restored.adapter_id, False) and ("remove_lora", new.adapter_id) in calls
    assert calls[-1] == ("generate", restored.adapter_id) and r.adapters[-1].name.endswith("-restore")

    calls.clear()
    sleep_wake.sleep_sync_wake(r, 1)  # level 1 keeps the weights: no reload
    assert calls[:2] == [("sleep", 1), ("wake_up", ["weights"])] and "reload_weights" not in [c[0] for c in calls]
    calls.clear()
    sleep_wake.wake_again(r, 1)
    assert [c[0] for c in calls] == ["sleep", "wake_up", "generate", "generate"]  # one request per sequence


def test_inplace_restores_a_level2_wake_in_place_under_its_own_id(tmp_path: Path) -> None:
    # --sync inplace keeps one name and id: its restore reloads in place (vLLM 0.26 served the base after it)
    r = vllm_run(tmp_path, sync="inplace")
    engine: Any = r.sampler
    synced = r.handle
    assert synced is not None
    sleep_wake.sleep_sync_wake(r, 2)
    engine.llm.calls.clear()
    before = len(r.adapters)
    sleep_wake.wake_again(r, 2)
    assert ("add_lora", synced.adapter_id, True) in engine.llm.calls
    assert r.handle is not None and (r.handle.name, r.handle.adapter_id) == (synced.name, synced.adapter_id)
    assert len(r.adapters) == before  # no version recorded: the same one put back


def test_the_vllm_sampler_sleeps_only_where_started_with_sleep_mode_and_refuses_levels_without_it() -> None:
    engine = object.__new__(VLLMSampler)
    engine.traits = replace(VLLMSampler.traits, sleep_unavailable=sleep.VLLM_CPU)
    assert engine.sleep_levels == ()
    assert sleep.setting(sleep.VLLM_CPU, ()).startswith("off (vLLM-CPU has no sleep mode")
    assert sleep.setting(None, sleep.LEVELS) == "on (levels 1, 2)"
    cfg = config.load(None)
    asked = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"sleep_levels": [1, 2]})})
    with pytest.raises(ConfigError, match="add --engine-arg enable_sleep_mode=true"):
        sleep.require_sleep_mode(asked, cuda=True)
    sleep.require_sleep_mode(asked, cuda=False)  # vLLM-CPU: the phases are skipped, the rows say why
    on = asked.model_copy(update={"sampler": asked.sampler.model_copy(update={"engine_args": {
        "enable_sleep_mode": True}})})
    sleep.require_sleep_mode(on, cuda=True)


def test_sleep_levels_parse_from_the_command_line() -> None:
    assert sleep_wake.parse_levels(None) is None and sleep_wake.parse_levels("none") == ()
    assert sleep_wake.parse_levels("2,1") == (1, 2) and sleep_wake.parse_levels("1") == (1,)
    for bad in ("0", "1,3", "x"):
        with pytest.raises(ConfigError, match="expected levels among 1 and 2"):
            sleep_wake.parse_levels(bad)


def test_a_handle_stays_a_handle_where_no_sleep_fault_acts() -> None:
    handle = AdapterHandle("a", 1, Path("a"))
    faults = Faults(None, ["q_proj"], 3, 1e-3)
    assert faults.woken_handle(handle, 1) is handle and not faults.skips_base_reload(2)
    dropping = Faults("wake-drops-adapter", ["q_proj"], 3, 1e-3)
    assert dropping.woken_handle(handle, 1) is None and dropping.woken_handle(handle, 2) is handle


def test_the_command_line_asks_for_sleep_levels_and_refuses_a_bad_one_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "cli.json"
    done = cli("run", "--trainer", "fake", "--sampler", "fake", "--sleep-levels", "1,2", "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    ids = [c["id"] for c in json.loads(out.read_text())["checks"]]
    assert [i for i in ids if i.startswith("W.")] == list(SLEEP_CHECKS)
    bad = cli("run", "--trainer", "fake", "--sampler", "fake", "--sleep-levels", "3", "--out", str(tmp_path / "b.json"))
    assert bad.returncode == 2 and "expected levels among 1 and 2" in bad.stderr and "Traceback" not in bad.stderr
    caught = cli("selftest", "--trainer", "fake", "--sampler", "fake", "--sleep-levels", "1", "--faults",
                 "wake-drops-adapter", "--quiet")
    assert caught.returncode == 0, caught.stdout + caught.stderr


@pytest.mark.parametrize("caching", [False, True])
def test_the_vllm_samplers_retire_resets_the_prefix_cache_only_where_it_caches(tmp_path: Path, caching: bool) -> None:
    """Without prefix caching nothing is cached: the retire removes the adapter and leaves the reset (which walks
    every block of the engine's cache) out (issue 47); with it, the retire clears what the old adapter cached."""
    r = vllm_run(tmp_path)
    engine: Any = r.sampler
    engine.cfg = engine.cfg.model_copy(update={"sampler": engine.cfg.sampler.model_copy(
        update={"enable_prefix_caching": caching})})
    engine.retire(AdapterHandle("lora-parity-1-v0", 1, tmp_path / "adapter-v0"))
    resets = [("reset_prefix_cache",)] if caching else []
    assert engine.llm.calls == [("remove_lora", 1), *resets]
