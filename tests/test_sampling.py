"""The user's sampling parameters on the decode path (issue 44; `models.sampling`): `--sampling KEY=VALUE` over the
config's `sampler.sampling`, sent with every generation request of the vllm and vllm-server samplers, the logprobs
compared kept raw, refused where they cannot be honoured, recorded and said in the lifecycle table."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lora_parity.models import config, sampling
from lora_parity.models.sampling import SamplingSpec
from lora_parity.run.runner import RunOptions, prepare
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import lifecycle

from .conftest import cli
from .test_lifecycle import ok
from .test_sglang_unit import checkpoint  # noqa: F401  (the fixture)
from .vllm_server_standin import VLLMStandIn

ROW = "the user's sampling parameters"


def row(settings: dict[str, object], *phases: str) -> list[tuple[str, str]]:
    return [(r.status, r.detail) for r in lifecycle.derive("vllm", settings, ok(*phases)) if r.condition == ROW]


@pytest.fixture
def server() -> Iterator[VLLMStandIn]:
    stand_in = VLLMStandIn()
    yield stand_in
    stand_in.close()


@pytest.mark.unit
def test_the_options_are_checked_in_one_line_each() -> None:
    spec = sampling.merged(SamplingSpec(), sampling.parse(["temperature=0.7", " top_k = 50"]))
    assert (spec.temperature, spec.top_p, spec.top_k, spec.identity) == (0.7, 1.0, 50, False)
    assert spec.engine_params() == {"temperature": 0.7, "top_k": 50}
    assert SamplingSpec().engine_params() == {"temperature": 1.0}  # the identity sends what lora-parity always sent
    for bad, said in (("top_p=0", "top_p"), ("temperature=0", "temperature"), ("top_k=-1", "top_k"),
                      ("min_p=0.1", "min_p"), ("top_p=x", "top_p")):
        with pytest.raises(ConfigError, match=said) as e:
            sampling.merged(SamplingSpec(), sampling.parse([bad]))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        sampling.parse(["temperature"])


@pytest.mark.unit
def test_refused_where_they_cannot_be_honoured_and_the_identity_never() -> None:
    warm = SamplingSpec(temperature=0.6)
    assert sampling.refusal(warm, "vllm", {}) is None and sampling.refusal(warm, "vllm-server", {}) is None
    assert "temperature 1 only" in str(sampling.refusal(warm, "sglang", {}))
    processed = {"logprobs_mode": "processed_logprobs"}
    assert sampling.refusal(warm, "vllm", processed, "hf") is None  # at a temperature alone: the trainer tempers
    assert "cannot score the drawn tokens" in str(sampling.refusal(warm, "vllm", processed, "megatron"))
    for spec in (SamplingSpec(top_p=0.9), SamplingSpec(temperature=0.6, top_k=20)):  # the trainer rebuilds the set
        assert sampling.refusal(spec, "vllm", processed) is None
        assert sampling.tempered(spec, processed) == spec.temperature
        assert "cannot score the drawn tokens" in str(sampling.refusal(spec, "vllm", processed, "megatron"))
    assert "would return logits" in str(sampling.refusal(warm, "vllm", {"logprobs_mode": "processed_logits"}))
    assert sampling.refusal(SamplingSpec(), "hf", processed) is None
    # Drawn probes compare the decode path's values as logprobs: a logits mode is refused there, identity or not.
    for mode in ("raw_logits", "processed_logits"):
        assert "would return logits" in str(sampling.refusal(SamplingSpec(), "vllm", {"logprobs_mode": mode},
                                                             sampled=True))
        assert sampling.refusal(SamplingSpec(), "vllm", {"logprobs_mode": mode}) is None  # prompt logprobs: raw
    assert sampling.refusal(SamplingSpec(), "vllm", processed, sampled=True) is None
    # Raw logprobs: min_tokens and ignore_eos keep the lengths; tempered: ignore_eos alone (min_tokens' stop-token
    # mask would be in the processed logprobs).
    assert warm.request(5, {}) == {"temperature": 0.6, "max_tokens": 5, "ignore_eos": True, "min_tokens": 5}
    assert warm.request(5, processed) == {"temperature": 0.6, "max_tokens": 5, "ignore_eos": True}
    assert sampling.tempered(warm, processed) == 0.6 and sampling.tempered(warm, {}) is None
    assert sampling.tempered(SamplingSpec(top_k=3), processed) == 1.0  # processed at temperature 1: top-k's set
    assert sampling.tempered(SamplingSpec(), processed) is None
    # From the CLI, before any backend is imported: exit 2, one line.
    for given, said in (("top_k=5", "temperature 1 only"), ("top_p=2", "top_p")):
        result = cli("run", "--trainer", "fake", "--sampler", "fake", "--sampling", given)
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = cli("run", "--sampler", "vllm", "--probes", "sampled", "--engine-arg", "logprobs_mode=raw_logits")
    assert result.returncode == 2 and "would return logits" in result.stderr, result.stderr


@pytest.mark.unit
def test_a_decode_path_fault_that_cannot_act_is_refused_for_a_run() -> None:
    with pytest.raises(ConfigError, match="needs processed decode logprobs under your sampling"):
        prepare(RunOptions(trainer="fake", sampler="fake", probes="sampled", inject="raw-decode-logprobs"))


@pytest.mark.unit
@pytest.mark.usefixtures("checkpoint")
def test_the_config_digest_holds_for_the_identity_and_moves_for_the_users_parameters(server: VLLMStandIn) -> None:
    plain = config.load(None)
    said = plain.model_copy(update={"sampler": plain.sampler.model_copy(update={"sampling": SamplingSpec()})})
    warm = plain.model_copy(update={"sampler": plain.sampler.model_copy(
        update={"sampling": SamplingSpec(temperature=0.7)})})
    assert said.digest() == plain.digest() != warm.digest()
    plan = prepare(RunOptions(trainer="fake", sampler="vllm-server", sampling=("temperature=0.7",),
                              sampler_url=server.url))
    assert plan.cfg.sampler.sampling == SamplingSpec(temperature=0.7)


@pytest.mark.unit
def test_the_lifecycle_row_says_what_the_decode_path_was_drawn_with() -> None:
    assert SamplingSpec().describe() == lifecycle.IDENTITY_SAMPLING
    assert row({}) == []  # a receipt made before the row: its table as recorded
    [(status, detail)] = row({"sampling": SamplingSpec().describe()}, "sample")
    assert status == "not covered" and "lora-parity's own" in detail
    warm = SamplingSpec(temperature=0.7, top_p=0.9).describe()
    [(status, detail)] = row({"sampling": warm}, "zero", "updated")
    assert status == "not covered" and "no phase generated" in detail
    [(status, detail)] = row({"sampling": warm}, "sample", "generate_updated")
    assert status == "covered" and detail.startswith("rollouts drawn with temperature 0.7, top_p 0.9, top_k off")
    tempered = {"sampling": SamplingSpec(temperature=0.5).describe(), "logprobs_mode": "processed_logprobs"}
    rows = {r.condition: r for r in lifecycle.derive("vllm", tempered, ok("sample", "generate_updated"))}
    assert rows["processed logprobs"].status == "covered"
    assert "drawn at temperature 0.5" in rows["processed logprobs"].detail and "G.updated not" in rows[
        "processed logprobs"].detail
    assert rows[ROW].detail.endswith("processed logprobs compared (the row above)")
    # Prompt logprobs alone read no processed logprob: not covered where the sampler records its sampling (older
    # receipts, which do not, keep the table they recorded).
    prompts_only = {r.condition: r for r in lifecycle.derive("vllm", tempered, ok("zero", "updated"))}
    assert prompts_only["processed logprobs"].status == "not covered"
    assert "no phase generated" in prompts_only["processed logprobs"].detail
    older = {"logprobs_mode": "processed_logprobs"}
    assert {r.condition: r for r in lifecycle.derive("vllm", older, ok("zero"))}["processed logprobs"].status \
        == "covered"


@pytest.mark.unit
@pytest.mark.usefixtures("checkpoint")
def test_the_vllm_server_sampler_sends_them_with_every_generation_request(server: VLLMStandIn) -> None:
    from lora_parity.backends.vllm_server import VLLMServerSampler

    cfg = config.load(None)
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
        update={"sampling": SamplingSpec(temperature=0.5, top_p=0.8, top_k=7)})})
    sampler = VLLMServerSampler(cfg, None, {}, url=server.url)
    sampler.generate([[1, 2, 3], [4, 5]], 3, 11, None)
    bodies = [body for _, path, _, body in server.requests if path == "/v1/completions"]
    assert len(bodies) == 2
    assert all((b["temperature"], b["top_p"], b["top_k"], b["min_tokens"]) == (0.5, 0.8, 7, 3) for b in bodies)
    assert sampler.info().settings["sampling"] == "temperature 0.5, top_p 0.8, top_k 7"


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_top_k_1_draws_the_same_tokens_whatever_the_seed_and_the_logprobs_stay_raw() -> None:
    # top_k 1 is greedy: two seeds draw the same completion, where the default (temperature 1, every token) draws
    # others; the logprob of a token drawn with probability 1 after top-k is 0 processed, below 0 raw.
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.backends import vllm
    from lora_parity.backends.base import BackendOptions
    from lora_parity.models import synthetic

    cfg = config.load(None)  # tiny-qwen3, fp32
    model_dir = synthetic.materialize(cfg)
    sampler = vllm.VLLMSampler.create(cfg, model_dir, {}, BackendOptions())
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 512) for _ in range(8)] for _ in range(3)]
    try:
        default = [sampler.generate(prompts, 6, seed, None)[0] for seed in (0, 1000)]
        assert default[0] != default[1]
        sampler.cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
            update={"sampling": SamplingSpec(top_k=1)})})
        greedy = [sampler.generate(prompts, 6, seed, None) for seed in (0, 1000)]
        assert greedy[0][0] == greedy[1][0]
        drawn = [lp for row_ in greedy[0][1] for lp in row_[7:]]  # the generated tokens' logprobs
        assert len(drawn) == 3 * 6 and max(drawn) < -1e-3
        assert sampler.info().settings["sampling"] == "temperature 1, top_p 1, top_k 1"
    finally:
        sampler.close()


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_processed_logprobs_at_a_temperature_pass_clean_and_a_decode_path_fault_is_still_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # logprobs_mode=processed_logprobs at temperature 0.5: the engine's drawn tokens' logprobs are log_softmax(z / 0.5)
    # (1.28 nats from the raw ones on this model), its prompt logprobs raw. The trainer scores the drawn tokens
    # tempered alike, so G.trainer passes clean and still fails where the engine generates without the adapter;
    # G.sampled and G.updated are not computed (no raw decode logprobs to compare with the prompt's).
    from lora_parity.evidence.receipt import Receipt, Verdict
    from lora_parity.verdict.verify import verify

    opts, result = _processed_selftest(monkeypatch, tmp_path, ("temperature=0.5",))
    clean, faulty, raw = (Receipt.model_validate_json(Path(r.receipt).read_text()) for r in result.rows)
    ids = {c.id for c in clean.checks}
    assert "G.trainer.parity.mean" in ids and not any(i.startswith(("G.updated.", "G.sampled.")) for i in ids)
    assert clean.verdict == Verdict.PASS and "sampled_generation_tempered" in clean.scores
    for r in result.rows:  # at 565c61a these receipts did not verify (the tempered key was not a known phase)
        checked = verify(Path(r.receipt))
        assert checked.verdict == checked.receipt.verdict
    row = next(r for r in clean.lifecycle or [] if r.condition == "processed logprobs")
    assert row.status == "covered" and "drawn at temperature 0.5" in row.detail
    for receipt in (faulty, raw):  # the engine without the adapter; its drawn tokens' logprobs raw (TRL #4873)
        assert "G.trainer.parity.mean" in {c.id for c in receipt.checks if c.status.value == "fail"}
    # prompt-no-adapter cannot act there: not among the selftest's faults, and refused for a run.
    with pytest.raises(ConfigError, match="does not apply with tempered decode logprobs"):
        prepare(RunOptions(**{**opts.__dict__, "inject": "prompt-no-adapter"}))


@pytest.mark.unit
def test_verify_takes_the_tempered_decode_scores_and_still_refuses_a_made_up_phase(tmp_path: Path) -> None:
    import json

    from lora_parity.evidence.receipt import compute_digest
    from lora_parity.run.runner import execute
    from lora_parity.util.errors import ReceiptError
    from lora_parity.verdict.verify import verify

    path = tmp_path / "r.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=path))
    data = json.loads(path.read_text())
    for key, refused in (("sampled_generation_tempered", False), ("made_up_phase", True)):
        data["scores"][key] = data["scores"]["zero"]
        data["digest"] = compute_digest(data)
        path.write_text(json.dumps(data))
        if refused:
            with pytest.raises(ReceiptError, match=r"scores\.made_up_phase is not a phase lora-parity records"):
                verify(path)
        else:
            assert verify(path).verdict.value == "pass"


@pytest.mark.unit
def test_the_trainer_rebuilds_vllms_processed_logprobs_from_its_logits() -> None:
    # vLLM's own mask (vllm/v1/sample/ops/topk_topp_sampler.py, the PyTorch path) then log_softmax, as its sampler
    # returns processed logprobs, against `backends.processed` on the same fp32 logits.
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from lora_parity.backends.processed import processed_logprobs

    rows = torch.randn(6, 257, generator=torch.Generator().manual_seed(3)) * 3
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (0.5, 40, 0.8), (1.3, 300, 0.95)):
        ours = processed_logprobs(rows, temperature, top_k, top_p)
        k = torch.full((6,), min(top_k, 257)) if top_k else None
        p = torch.full((6,), top_p) if top_p < 1.0 else None
        theirs = apply_top_k_top_p_pytorch(rows.clone() / temperature, k, p).log_softmax(dim=-1, dtype=torch.float32)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (temperature, top_k, top_p)
        kept = ~torch.isinf(theirs)
        assert torch.allclose(ours[kept], theirs[kept], atol=1e-6), (temperature, top_k, top_p)
        if top_k or top_p < 1.0:
            assert kept.sum(dim=-1).max() < 257  # the masks took something away
            # a drawn token this side's masks drop is scored over the set and it: finite, below every kept token's
            dropped = (~kept).int().argmax(dim=-1)
            scored = processed_logprobs(rows, temperature, top_k, top_p, keep=dropped)
            at = scored.gather(1, dropped[:, None])[:, 0]
            assert torch.isfinite(at).all() and (at <= scored.masked_fill(~kept, 0).max(dim=-1).values).all()


@pytest.mark.cpu_e2e
def test_on_vllm_cpu_processed_logprobs_under_top_k_and_top_p_pass_clean_and_need_the_trainers_masks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # logprobs_mode=processed_logprobs with temperature 0.7, top-k 20 and top-p 0.9: the engine renormalizes the drawn
    # tokens' logprobs over the kept set; the hf trainer rebuilds the same (`backends.processed`), so G.trainer passes
    # clean and still catches the decode path's faults. With the trainer's masks left out, the same clean run fails.
    from lora_parity.backends import hf
    from lora_parity.evidence.receipt import Receipt, Verdict
    from lora_parity.run.runner import execute

    opts, result = _processed_selftest(monkeypatch, tmp_path / "st", ("temperature=0.7", "top_k=20", "top_p=0.9"))
    clean = Receipt.model_validate_json(Path(result.rows[0].receipt).read_text())
    g = next(c for c in clean.checks if c.id == "G.trainer.parity.mean")
    assert clean.verdict == Verdict.PASS and g.observed < 1e-4
    row = next(r for r in clean.lifecycle or [] if r.condition == "processed logprobs")
    assert row.status == "covered" and "as processed (top-k, top-p)" in row.detail
    unmasked = hf.processed_logprobs
    monkeypatch.setattr(hf, "processed_logprobs", lambda rows, temperature, top_k, top_p, keep=None: unmasked(
        rows, temperature))
    without = execute(RunOptions(**{**opts.__dict__, "out": tmp_path / "w.json"})).receipt
    assert without.error is None and without.verdict == Verdict.FAIL
    assert "G.trainer.parity.mean" in {c.id for c in without.checks if c.status.value == "fail"}


def _processed_selftest(monkeypatch: pytest.MonkeyPatch, folder: Path,
                        given: tuple[str, ...]) -> tuple[RunOptions, Any]:
    """A vLLM-CPU selftest with processed logprobs under the sampling `given`, the sampled probes, the clean run and the
    two decode-path faults, each of which must be caught."""
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.run import probes
    from lora_parity.run.selftest import selftest

    # tiny-qwen3 has no tokenizer: the text probes' characters as its token ids
    monkeypatch.setattr(probes, "checkpoint_tokenizer",
                        lambda cfg, kind="text": (lambda text: [ord(ch) % 64 for ch in text], "toy"))
    opts = RunOptions(probes="sampled", engine_args=("logprobs_mode=processed_logprobs",), sampling=given,
                      per_target=False)
    result = selftest(opts, folder, only=("gen-no-adapter", "raw-decode-logprobs"))
    assert [(r.fault, r.caught) for r in result.rows] == [("none", True), ("gen-no-adapter", True),
                                                         ("raw-decode-logprobs", True)], result.rows
    return opts, result
