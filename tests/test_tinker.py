"""The tinker backends against a real Tinker-compatible server (SkyRL's, JAX on the CPU), plus their
pure parts on fakes.

Expected against SkyRL's server: A and C pass; B fails with B.withheld, because a sampling client
obtained before the update already returns the updated logprobs (it is served from the training
client's own weights, not from a snapshot); and S.trainer_kept fails, because querying that old
client after a newer one was used loads its snapshot into the trainer's weights.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.evidence.receipt import CheckStatus, Verdict, load
from lora_parity.models import config
from lora_parity.run.faults import Faults
from lora_parity.run.phases import Run, StopRun, run_sequence
from lora_parity.run.probes import random_probes
from lora_parity.run.runner import RunOptions, execute, redact_url
from lora_parity.verdict import checks
from lora_parity.verdict.verify import verify

from . import tinker_server
from .conftest import cli

API_KEY = "tml-lora-parity-test-key"
"""SkyRL's server has no auth; the SDK wants a key that starts with 'tml-'. It must never reach a receipt."""


# --- The sequence on fakes: what the tinker capabilities change, and that S.trainer_kept fires ---------


class ServiceFakeSampler(FakeSampler):
    """A fake service whose sampling clients are served from the trainer's own weights, like SkyRL's:
    a client whose snapshot is not the one last loaded loads it into the trainer (`revert`), else the
    trainer's live weights are served. With `revert=False` every client serves its own snapshot."""

    traits = replace(FakeSampler.traits, shares_trainer_state=True, mixed_batch_unavailable="one route per call")

    def __init__(self, cfg: config.ModelConfig, trainer: FakeTrainer, revert: bool) -> None:
        super().__init__(cfg, None, {})
        self.trainer, self.revert = trainer, revert
        self.snapshots: dict[int, dict[str, list[float]]] = {}
        self.active: int | None = None

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> Any:
        handle = super().publish(directory, name, adapter_id, inplace)
        self.snapshots[adapter_id] = copy.deepcopy(self.trainer.params)
        return handle

    def retire(self, handle: Any) -> None:
        pass  # a service keeps its sampling clients

    def score(self, sequences: list[list[int]], adapter: Any) -> list[list[float]]:
        if adapter is None:
            return super().score(sequences, None)
        if not self.revert:
            live, self.trainer.params = self.trainer.params, self.snapshots[adapter.adapter_id]
            try:
                return self.trainer.score(sequences)
            finally:
                self.trainer.params = live
        if self.active != adapter.adapter_id:
            self.trainer.params = copy.deepcopy(self.snapshots[adapter.adapter_id])
            self.active = adapter.adapter_id
        return self.trainer.score(sequences)


def fake_run(tmp_path: Path, sampler: Any = None, trainer: Any = None) -> tuple[Run, checks.Evaluation]:
    cfg = config.load("tiny-qwen3")
    assert cfg.model.synthetic is not None
    probes = random_probes(cfg.probes, "default", cfg.model.synthetic.vocab_size)
    trainer = trainer or FakeTrainer(cfg, None, 0, {})
    run = Run(cfg=cfg, trainer=trainer, sampler=sampler or FakeSampler(cfg, None, {}), sequences=probes.sequences,
              seed=0, workdir=tmp_path, faults=Faults(None, list(cfg.adapter.targets),
                                                      probes.num_scored_positions, cfg.budgets.mean))
    try:
        run_sequence(run)
    except StopRun:
        pass
    return run, checks.evaluate(run.scores, cfg.budgets, errored=run.error is not None)


def statuses(ev: checks.Evaluation) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in ev.checks}


@pytest.mark.unit
def test_a_reverting_service_fails_b_withheld_and_s_trainer_kept(tmp_path: Path) -> None:
    cfg = config.load("tiny-qwen3")
    trainer = FakeTrainer(cfg, None, 0, {})
    run, ev = fake_run(tmp_path, ServiceFakeSampler(cfg, trainer, revert=True), trainer)
    names = [p.name for p in run.phases]
    at = names.index("updated")
    assert names[at + 1 : at + 5] == ["fresh", "base_after_sync", "stale_after_sync", "trainer_after_stale"]
    status = statuses(ev)
    assert status["B.withheld"] == CheckStatus.FAIL
    assert status["S.trainer_kept"] == CheckStatus.FAIL
    (kept,) = [c for c in ev.checks if c.id == "S.trainer_kept"]
    assert "querying an old sampling client reverted the trainer's weights" in kept.reason
    assert ev.comparisons["S.trainer_after_stale_vs_zero"].max_abs == 0.0
    assert all(s == CheckStatus.PASS for k, s in status.items() if k.startswith(("A.", "C.")))
    assert ev.verdict == Verdict.FAIL


@pytest.mark.unit
def test_a_snapshotting_service_passes_everything(tmp_path: Path) -> None:
    cfg = config.load("tiny-qwen3")
    trainer = FakeTrainer(cfg, None, 0, {})
    _, ev = fake_run(tmp_path, ServiceFakeSampler(cfg, trainer, revert=False), trainer)
    status = statuses(ev)
    assert status["S.trainer_kept"] == CheckStatus.PASS and status["B.withheld"] == CheckStatus.PASS
    assert ev.verdict == Verdict.PASS, [c for c in ev.checks if c.status != CheckStatus.PASS]


@pytest.mark.unit
def test_s_trainer_kept_names_a_change_that_is_not_a_revert(tmp_path: Path) -> None:
    run, _ = fake_run(tmp_path)
    scores = dict(run.scores)
    scores["stale_after_sync"] = scores["zero"]
    scores["trainer_after_stale"] = [[x + 0.5 for x in seq] for seq in scores["trainer_updated"]]
    cfg = config.load("tiny-qwen3")
    (kept,) = [c for c in checks.evaluate(scores, cfg.budgets, errored=False).checks if c.id == "S.trainer_kept"]
    assert kept.status == CheckStatus.FAIL and "changed the trainer's weights" in kept.reason


@pytest.mark.unit
def test_other_backends_get_no_s_check_and_keep_their_check_order(tmp_path: Path) -> None:
    run, ev = fake_run(tmp_path)
    assert "stale_after_sync" not in run.scores and "trainer_after_stale" not in run.scores
    ids = [c.id for c in ev.checks]
    assert not [i for i in ids if i.startswith("S.")]
    assert ids[:3] == ["A.parity.mean", "A.parity.p99", "A.parity.max"] and ids[-1].startswith("T.")
    out = tmp_path / "fake.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False))
    assert verify(out).verdict == Verdict.PASS


@pytest.mark.unit
def test_base_and_per_target_are_skipped_where_a_backend_cannot_do_them(tmp_path: Path) -> None:
    cfg = config.load("tiny-qwen3")

    class NoBaseSampler(FakeSampler):
        traits = replace(FakeSampler.traits, base_unavailable="the service does not sample base models")

    class AllTargetsTrainer(FakeTrainer):
        traits = replace(FakeTrainer.traits, per_target_unavailable="every target trains together")

    run, ev = fake_run(tmp_path, NoBaseSampler(cfg, None, {}), AllTargetsTrainer(cfg, None, 0, {}))
    names = [p.name for p in run.phases]
    assert "base" not in names and not [n for n in names if n.startswith("target.")] and names[0] == "publish_zero"
    assert statuses(ev)["A.zero_adapter_noop"] == CheckStatus.NOT_REACHED
    assert ev.verdict == Verdict.INCONCLUSIVE


@pytest.mark.unit
def test_tokenizer_is_deterministic_and_fills_the_vocabulary(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from lora_parity.models import synthetic

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    synthetic.add_tokenizer(a, 512)
    synthetic.add_tokenizer(b, 512)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    assert tok.decode(tok.encode("kalo rising, 2024").ids) == "kalo rising, 2024"


@pytest.mark.unit
def test_redact_url_drops_credentials() -> None:
    assert redact_url("https://u:secret@tinker.example:8443/svc/?token=x#f") == "https://tinker.example:8443/svc"
    assert redact_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


# --- The backend's own rules (needs the tinker SDK; no server) ----------------------------------------


@pytest.mark.tinker
def test_sampler_alignment_is_detected_and_anything_else_refused() -> None:
    pytest.importorskip("tinker", reason="the tinker SDK (the 'tinker' extra) is not installed")
    from lora_parity.backends.tinker import align_sampler_logprobs
    from lora_parity.util.errors import ScoreError

    assert align_sampler_logprobs([None, -1.0, -2.0], 3, "s") == ([-1.0, -2.0], "leading None")
    assert align_sampler_logprobs([-1.0, -2.0], 3, "s") == ([-1.0, -2.0], "n - 1")
    for bad in ([-1.0, -2.0, -3.0], [None, -1.0], [-1.0], [None, None, -1.0], [None, -1.0, None], []):
        with pytest.raises(ScoreError, match="expected 3 starting with None, or 2"):
            align_sampler_logprobs(bad, 3, "s")


def test_the_update_uses_the_configs_learning_rate() -> None:
    pytest.importorskip("tinker", reason="the tinker SDK (the 'tinker' extra) is not installed")
    from lora_parity.backends.tinker import TinkerTrainer

    class Done:
        def result(self, timeout: float | None = None) -> None:
            return None

    class Client:
        def __init__(self) -> None:
            self.steps: list[Any] = []

        def forward_backward(self, data: Any, loss: str) -> Done:
            return Done()

        def optim_step(self, adam: Any) -> Done:
            self.steps.append(adam)
            return Done()

    base = config.load("tiny-qwen3")
    cfg = base.model_copy(update={"perturbation": base.perturbation.model_copy(update={"learning_rate": 3e-3})})
    trainer = TinkerTrainer.__new__(TinkerTrainer)  # no service: only the update is exercised
    client = Client()
    trainer.cfg, trainer.client, trainer.model_id, trainer.vocab_size, trainer.updated = cfg, client, "m", 512, False
    p = trainer.perturb(std=0.0, seed=0)
    assert [a.learning_rate for a in client.steps] == [3e-3] and p.learning_rate == 3e-3
    assert base.perturbation.learning_rate == 1e-2  # the default the real-server tests run with


@pytest.mark.tinker
def test_unreachable_service_is_one_line_exit_2_within_seconds(tmp_path: Path) -> None:
    pytest.importorskip("tinker", reason="the tinker SDK (the 'tinker' extra) is not installed")
    url = f"http://lp-user:lp-secret@127.0.0.1:{tinker_server.free_port()}"
    out = tmp_path / "r.json"
    start = time.monotonic()
    res = cli("run", "--trainer", "tinker", "--sampler", "tinker", "--tinker-url", url, "--out", str(out),
              env={"TINKER_API_KEY": API_KEY})
    assert res.returncode == 2 and time.monotonic() - start < 30, res.stderr
    assert res.stderr.count("\n") == 1 and "cannot reach the Tinker service" in res.stderr
    assert "Traceback" not in res.stderr and "lp-secret" not in res.stderr
    assert not out.exists()
    bad = [
        (["--trainer", "tinker", "--sampler", "fake", "--tinker-url", url], {}, "work as a pair"),
        (["--trainer", "fake", "--sampler", "fake", "--tinker-url", url], {}, "tinker backends only"),
        (["--trainer", "tinker", "--sampler", "tinker"], {}, "--tinker-url URL"),
        (["--trainer", "tinker", "--sampler", "tinker", "--tinker-url", url], {"TINKER_API_KEY": ""}, "TINKER_API_KEY"),
        (["--trainer", "tinker", "--sampler", "tinker", "--tinker-url", url, "--inject", "wrong-scale"], {},
         "exports none"),
    ]
    for args, env, message in bad:
        res = cli("run", *args, env={"TINKER_API_KEY": API_KEY, **env})
        assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, (args, res.stderr)


# --- Against SkyRL's server ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def skyrl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker_server.Server]:
    pytest.importorskip("tinker", reason="the tinker SDK (the 'tinker' extra) is not installed")
    if not tinker_server.installed():
        pytest.skip("SkyRL's server is not installed in .venv-skyrl/: run `bash scripts/skyrl-server.sh install`")
    with tinker_server.skyrl_server(tmp_path_factory.mktemp("skyrl")) as server:
        yield server
    assert not tinker_server.alive(server.pid), "the server outlived `skyrl-server.sh stop`"


@pytest.fixture(scope="module")
def tinker_run(skyrl: tinker_server.Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tinker") / "tinker.json"
    url = skyrl.url.replace("http://", "http://lp-user:lp-secret@")  # credentials must not reach the receipt
    start = time.monotonic()
    res = cli("run", "--trainer", "tinker", "--sampler", "tinker", "--tinker-url", url, "--base-model",
              skyrl.base_model, "--out", str(out), "--json", env={"TINKER_API_KEY": API_KEY})
    return {"res": res, "out": out, "seconds": time.monotonic() - start, "server": skyrl}


@pytest.mark.tinker
def test_real_server_a_and_c_pass_b_withheld_and_s_trainer_kept_fail(tinker_run: dict[str, Any]) -> None:
    res, out = tinker_run["res"], tinker_run["out"]
    assert res.returncode == 1, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["verdict"] == "fail" and summary["error"] is None
    receipt = load(out)[0]
    status = {c.id: c for c in receipt.checks}
    a_and_c = [c for c in receipt.checks if c.id.startswith(("A.", "C."))]
    assert len(a_and_c) == 16 and all(c.status == CheckStatus.PASS for c in a_and_c), a_and_c
    assert status["B.withheld"].status == CheckStatus.FAIL
    assert status["B.withheld"].reason.startswith("unpublished update visible to the sampler")
    assert status["S.trainer_kept"].status == CheckStatus.FAIL
    assert status["S.trainer_kept"].reason.startswith("querying an old sampling client reverted the trainer's weights")
    # The evidence: the stale client already served the update; queried again after the newer one,
    # it served its zero-init snapshot, and the trainer's next forward was back at zero-init.
    cmp = receipt.comparisons
    assert cmp["B.stale_vs_zero"].mean_abs >= receipt.budgets.min_stimulus
    assert cmp["S.stale_after_sync_vs_zero"].max_abs <= receipt.budgets.max
    assert cmp["S.trainer_after_stale_vs_zero"].max_abs <= receipt.budgets.max
    assert cmp["S.trainer_after_stale_vs_updated"].mean_abs >= receipt.budgets.min_stimulus
    assert verify(out).verdict == Verdict.FAIL


@pytest.mark.tinker
def test_real_server_receipt_records_the_service_and_the_update(tinker_run: dict[str, Any]) -> None:
    out, server = tinker_run["out"], tinker_run["server"]
    assert tinker_run["res"].returncode == 1, tinker_run["res"].stderr[-3000:]
    receipt = load(out)[0]
    text = out.read_text()
    assert API_KEY not in text and "lp-secret" not in text and "lp-user" not in text
    for side in (receipt.trainer, receipt.sampler):
        assert side.backend == "tinker" and side.versions == {"tinker": "0.24.1"}
        assert side.settings["service_url"] == server.url
        assert side.settings["service_models"] == [server.base_model]
        assert side.settings["base_model"] == server.base_model
        assert str(side.settings["per_target"]).startswith("skipped:")
    assert receipt.sampler.settings["alignment"] == "n - 1"  # SkyRL: no leading None
    assert receipt.sampler.settings["base_model_sampling"] == "ok"
    assert receipt.environment.device == f"Tinker service at {server.url}"
    p = receipt.perturbation
    assert p is not None and p.kind == "optimizer_step" and p.learning_rate == 1e-2 and p.std == 0.0
    assert p.update_tokens and len(p.update_tokens) == 64
    names = [ph.name for ph in receipt.phases]
    assert names == ["base", "publish_zero", "zero", "trainer_zero", "perturb", "trainer_updated",
                     "trainer_updated_alt", "stale", "sync", "updated", "base_after_sync", "stale_after_sync",
                     "trainer_after_stale"]
    assert [a.version for a in receipt.adapters] == [0, 1]
    assert receipt.comparisons["A.trainer_vs_sampler"].n == receipt.probes.num_scored_positions


@pytest.mark.tinker
def test_server_log_shows_the_sequence_reached_the_engine(tinker_run: dict[str, Any]) -> None:
    log = tinker_run["server"].log.read_text(errors="replace")
    # SkyRL loads a sampling client's snapshot into the training client's own adapter slot.
    assert "Loading LoRA sampler checkpoint" in log
