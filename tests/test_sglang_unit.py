"""The `sglang` sampler without SGLang: its HTTP client against a stand-in SGLang server
(`tests/sglang_server.py`, the fake model served over SGLang's native API) on a thread or as a process:
the requests it sends, the alignment of what it reads back, errors, timeouts, attach and launch, the
faults that apply to it, and the refusals before anything loads."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lora_parity import backends
from lora_parity.backends import sglang_server
from lora_parity.backends.base import (
    AdapterHandle,
    BackendTraits,
    CachedScoringSampler,
    EarlyLaunchingSampler,
    GeneratingSampler,
)
from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.backends.server_process import free_port
from lora_parity.backends.sglang import SGLangSampler, tensor_payload
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import adapter_files as af
from lora_parity.models import config, synthetic
from lora_parity.run.faults import FAULTS, faults_for
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import BackendUnavailableError, ConfigError, ScoreError
from lora_parity.verdict import findings

from .conftest import ROOT, cli
from .sglang_server import StandIn

pytestmark = pytest.mark.unit
SECRET = "sglang-test-key-0123456789abcdef"
SEQS = [[5, 17, 3, 9, 44, 2, 511, 8], [7, 7, 1, 30, 12]]
"""Two probes; 511 is the stand-in's last vocabulary id, which SGLang reports as token 0."""


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    yield server
    server.close()


@pytest.fixture
def checkpoint() -> Path:
    """The default config's synthetic checkpoint on disk (a run with a sampler that serves one needs it)."""
    return synthetic.materialize(config.load(None))


def attach(url: str, **kwargs: Any) -> SGLangSampler:
    return SGLangSampler(kwargs.pop("cfg", None) or config.load(None), None, {}, url=url, **kwargs)


def exported(tmp_path: Path, name: str, std: float = 0.05, seed: int = 3) -> tuple[Path, FakeTrainer]:
    """A fake trainer after a seeded update, and its adapter exported to `tmp_path/name`."""
    trainer = FakeTrainer(config.load(None), None, 0, {})
    trainer.perturb(std, seed)
    return trainer.export_adapter(tmp_path / name), trainer


def answer_with(status: int, body: bytes, headers: dict[str, str] | None = None) -> Callable[..., bool]:
    def override(h: http.server.BaseHTTPRequestHandler, _: dict[str, Any]) -> bool:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)
        return True

    return override


# --- what it is, and the refusals before anything loads ----------------------------------------------


def test_sglang_is_a_served_sampler_that_reads_the_cache_generates_and_launches_early() -> None:
    assert backends.resolve("sampler", "sglang") is SGLangSampler
    for protocol in (CachedScoringSampler, GeneratingSampler, EarlyLaunchingSampler):
        assert issubclass(SGLangSampler, protocol)
    traits = SGLangSampler.traits
    assert traits.served_over_http and "already loaded" in (traits.same_name_reload_refused or "")
    assert "sgl-project/sglang#8261" in (traits.reload_gets_fresh_cache or "")


def test_without_sglang_or_a_url_the_run_is_refused_before_the_trainer_is_imported(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sglang_server, "installed", lambda: False)
    resolved: list[str] = []
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda kind, name: resolved.append(kind) or real(kind, name))
    with pytest.raises(ConfigError, match=r"^--sampler sglang: SGLang is not installed .*--sampler-url$"):
        execute(RunOptions(trainer="hf", sampler="sglang", out=tmp_path / "r.json"))
    assert resolved == ["sampler"] and not (tmp_path / "r.json").exists()


@pytest.mark.skipif(sglang_server.installed(), reason="SGLang is installed here")
def test_the_cli_refusal_is_one_line_exit_2_and_imports_no_torch(tmp_path: Path) -> None:
    r = cli("run", "--sampler", "sglang", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SGLang is not installed" in lines[0], r.stderr
    probe = ("import sys\nfrom lora_parity.run.runner import RunOptions, prepare\n"
             "try:\n    prepare(RunOptions(trainer='hf', sampler='sglang'))\nexcept ValueError as e:\n"
             "    print(type(e).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == ["ConfigError", "False", "False"], out.stderr


def test_sglang_takes_no_tinker_trainer_and_other_samplers_take_no_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the tinker backends work as a pair"):
        execute(RunOptions(trainer="tinker", sampler="sglang", out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match=r"served over HTTP only \(--sampler vllm-server or sglang\)"):
        execute(RunOptions(trainer="fake", sampler="fake", sampler_url="http://127.0.0.1:1", out=tmp_path / "r.json"))


def test_an_attached_url_is_checked_at_preflight(stand_in: StandIn, tmp_path: Path) -> None:
    def run(**kw: Any) -> None:
        execute(RunOptions(trainer="fake", sampler="sglang", out=tmp_path / "r.json", **kw))

    with pytest.raises(ConfigError, match="is not an http"):
        run(sampler_url="ftp://127.0.0.1:1")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"cannot reach the SGLang server at http://127\.0\.0\.1:\d+: "):
        run(sampler_url=f"http://u:pw@127.0.0.1:{free_port()}")
    assert time.perf_counter() - start < 10
    with pytest.raises(ConfigError, match="environment variable is not set"):
        run(sampler_url=stand_in.url, api_key_env="LORA_PARITY_UNSET_VAR")
    stand_in.overrides["/health"] = answer_with(503, b"")
    with pytest.raises(ConfigError, match="/health answered 503"):
        run(sampler_url=stand_in.url)
    assert not (tmp_path / "r.json").exists()


# --- the server's command line -----------------------------------------------------------------------


def test_the_users_server_arguments_go_on_the_command_line_as_given_and_lora_paritys_own_step_aside() -> None:
    from lora_parity.backends import engine_args
    from lora_parity.run import runner
    from lora_parity.run.options import RunOptions

    cfg = config.load(None)
    given = ("disable_cuda_graph=false", "enable-deterministic-inference=false", "disable_radix_cache=true",
             "max_loras_per_batch=4", "mem_fraction_static=0.3", "attention_backend=fa3")
    user = runner._with_engine_args(cfg, RunOptions(sampler="sglang", engine_args=given))
    assert user.sampler.engine_args == {"disable_cuda_graph": False, "enable_deterministic_inference": False,
                                        "disable_radix_cache": True, "max_loras_per_batch": 4,
                                        "mem_fraction_static": 0.3, "attention_backend": "fa3"}
    argv = sglang_server.server_argv(user, Path("c"), 1)
    assert "--disable-cuda-graph" not in argv and "--enable-deterministic-inference" not in argv  # the user's false
    assert "--disable-radix-cache" in argv  # the user's switch
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--max-loras-per-batch"] == "4" and flag["--attention-backend"] == "fa3"
    assert argv.count("--mem-fraction-static") == 1 and flag["--mem-fraction-static"] == "0.3"  # theirs, not ours
    assert engine_args.record(user.sampler.engine_args)[0] == "disable_cuda_graph=false"  # what the receipt records
    # Refused in one line: a key lora-parity sets, one naming a file the server would load, an unknown one, a value
    # of another kind; and vLLM's keys are not SGLang's.
    for bad, said in (("random_seed=3", "lora-parity seeds the server"), ("tokenizer_path=/x", "names code or files"),
                      ("max_num_seqs=4", "unknown SGLang server argument"), ("page_size=big", "expected int"),
                      ("trust_remote_code=true", "use --trust-remote-code")):
        with pytest.raises(ConfigError, match=said) as e:
            runner._with_engine_args(cfg, RunOptions(sampler="sglang", engine_args=(bad,)))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown engine argument 'disable_radix_cache'"):
        runner._with_engine_args(cfg, RunOptions(sampler="vllm", engine_args=("disable_radix_cache=true",)))


def test_server_arguments_are_refused_for_an_attached_server(tmp_path: Path) -> None:
    from lora_parity.run.runner import RunOptions, execute

    with pytest.raises(ConfigError, match="an attached server runs with its own"):
        execute(RunOptions(trainer="fake", sampler="sglang", sampler_url="http://127.0.0.1:9",
                           engine_args=("disable_radix_cache=true",), out=tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_the_server_gets_the_runs_lora_settings_and_deterministic_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(None)
    argv = sglang_server.server_argv(cfg, Path("ckpt"), 8123)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--model-path"] == str(Path("ckpt").absolute()) and flag["--port"] == "8123"
    assert flag["--host"] == "127.0.0.1" and flag["--dtype"] == cfg.model.dtype
    assert flag["--max-lora-rank"] == str(cfg.adapter.rank) and flag["--load-format"] == "safetensors"
    assert flag["--mem-fraction-static"] == str(cfg.sampler.gpu_memory_utilization)
    targets = argv[argv.index("--lora-target-modules") + 1:][:len(cfg.adapter.targets)]
    assert targets == list(cfg.adapter.targets)
    assert {"--enable-lora", "--skip-tokenizer-init", "--enable-deterministic-inference"} <= set(argv)
    assert "--disable-radix-cache" not in argv  # served as rollouts are: the cached phases read it
    assert cfg.sampler.enforce_eager and "--disable-cuda-graph" in argv  # eager, as vLLM's enforce_eager
    compiled = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"enforce_eager": False})})
    assert "--disable-cuda-graph" not in sglang_server.server_argv(compiled, Path("c"), 1)
    assert "--enable-deterministic-inference" not in sglang_server.server_argv(cfg, Path("c"), 1, deterministic=False)
    monkeypatch.setenv("LORA_PARITY_SGLANG_ARGS", "--log-level warning")
    assert sglang_server.server_argv(cfg, Path("c"), 1)[-2:] == ["--log-level", "warning"]
    bad = cfg.model_copy(update={"adapter": cfg.adapter.model_copy(update={"targets": ["--api-key=x"]})})
    with pytest.raises(ConfigError, match="not a module name"):
        sglang_server.server_argv(bad, Path("c"), 1)
    assert sglang_server.server_env()["TMPDIR"] != os.environ.get("TMPDIR")


# --- the protocol ------------------------------------------------------------------------------------


def test_prompt_logprobs_follow_the_alignment_rule(stand_in: StandIn, tmp_path: Path) -> None:
    folder, trainer = exported(tmp_path, "adapter-v0")
    sampler = attach(stand_in.url)
    handle = sampler.publish(folder, "lora-parity-1-v0", 1)
    assert handle.name == "lora-parity-1-v0" + sampler.suffix and stand_in.posted("/load_lora_adapter") == [
        {"lora_name": handle.name, "lora_path": str(folder)}]
    scores = sampler.score(SEQS, handle)
    # Entry t is log p(s[t+1] | s[:t+1]): the fake trainer's own scores, exactly (the stand-in serves its model).
    assert scores == trainer.score(SEQS) and [len(r) for r in scores] == [len(s) - 1 for s in SEQS]
    assert sampler.score(SEQS, None) == FakeSampler(config.load(None), None, {}).score(SEQS, None) != scores
    requests = stand_in.posted("/generate")
    assert [r["input_ids"] for r in requests] == SEQS * 2
    assert all(r["return_logprob"] is True and r["logprob_start_len"] == 0
               and r["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0} for r in requests)
    assert [r.get("lora_path") for r in requests] == [handle.name, handle.name, None, None]


def test_a_batch_is_one_request(stand_in: StandIn, tmp_path: Path) -> None:
    cfg = config.load(None)
    cfg = cfg.model_copy(update={"scoring": cfg.scoring.model_copy(update={"batch_size": 2})})
    folder, trainer = exported(tmp_path, "a")
    sampler = attach(stand_in.url, cfg=cfg)
    handle = sampler.publish(folder, "a", 1)
    assert sampler.score(SEQS, handle) == trainer.score(SEQS)
    (request,) = stand_in.posted("/generate")
    assert request["input_ids"] == SEQS and request["lora_path"] == [handle.name, handle.name]


@pytest.mark.parametrize("change, error", [
    (lambda e: e[1:], "expected 8 entries, got 7"),
    (lambda e: [[-1.0, e[0][1], None], *e[1:]], "entry 0 is not null"),
    (lambda e: [e[0], [None, e[1][1], None], *e[2:]], "entry 1 is null"),
    (lambda e: [e[0], *e[2:], e[1]], "misaligned"),
    (lambda e: [e[0], [float("nan"), e[1][1], None], *e[2:]], "not a finite number"),
])
def test_an_answer_that_does_not_line_up_is_a_score_error(stand_in: StandIn, change: Callable[[list[Any]], list[Any]],
                                                          error: str) -> None:
    def altered(h: http.server.BaseHTTPRequestHandler, body: dict[str, Any]) -> bool:
        status, answer = stand_in.answer("POST", "/generate", body)
        answer["meta_info"]["input_token_logprobs"] = change(answer["meta_info"]["input_token_logprobs"])
        return answer_with(status, json.dumps(answer).encode())(h, body)

    stand_in.overrides["/generate"] = altered
    with pytest.raises(ScoreError, match=error):
        attach(stand_in.url).score(SEQS[:1], None)


def test_cached_scoring_asks_for_each_next_token_and_equals_prompt_scoring(stand_in: StandIn, tmp_path: Path) -> None:
    folder, trainer = exported(tmp_path, "a")
    sampler = attach(stand_in.url)
    handle = sampler.publish(folder, "a", 1)
    # The stand-in sums the fake model's terms in another order here: equal to the last bits.
    cached, prompt = sampler.score_cached(SEQS, handle), trainer.score(SEQS)
    assert [len(r) for r in cached] == [len(r) for r in prompt]
    assert all(c == pytest.approx(p, abs=1e-12, rel=0) for c, p in zip(cached, prompt, strict=True))
    requests = sorted(stand_in.posted("/generate"), key=lambda r: (len(r["input_ids"]), r["input_ids"]))
    wanted = sorted(([s[:t + 1], s[t + 1]] for s in SEQS for t in range(len(s) - 1)), key=lambda p: (len(p[0]), p[0]))
    assert [[r["input_ids"], *r["token_ids_logprob"]] for r in requests] == wanted
    assert all(r["logprob_start_len"] == len(r["input_ids"]) - 1 and r["lora_path"] == handle.name for r in requests)
    stand_in.overrides["/generate"] = lambda h, body: answer_with(200, b'{"meta_info": {}}')(h, body)
    with pytest.raises(ScoreError, match="the logprob of token 17 after a 1-token prefix was not returned"):
        sampler.score_cached(SEQS[:1], handle)


def test_generation_is_seeded_per_request_and_its_logprobs_follow_the_rule(stand_in: StandIn, tmp_path: Path) -> None:
    folder, _ = exported(tmp_path, "a")
    sampler = attach(stand_in.url)
    handle = sampler.publish(folder, "a", 1)
    reference = FakeSampler(config.load(None), None, {})
    ref_handle = reference.publish(folder, "a", 1)
    prompts = [[3, 9, 4], [8, 1]]
    sequences, logprobs = sampler.generate(prompts, 6, seed=40, adapter=handle)
    ref_sequences, ref_logprobs = reference.generate(prompts, 6, 40, ref_handle)
    assert sequences == ref_sequences and [len(s) for s in sequences] == [9, 8]  # the same tokens: seeded
    # The same logprobs, by the rule: the prompt's as scored, then each generated token's (to the last bits).
    assert [len(r) for r in logprobs] == [8, 7]
    assert all(g == pytest.approx(r, abs=1e-12, rel=0) for g, r in zip(logprobs, ref_logprobs, strict=True))
    sampling = [r["sampling_params"] for r in stand_in.posted("/generate")]
    assert [s["sampling_seed"] for s in sampling] == [40, 41]
    assert all(s["ignore_eos"] is True and s["temperature"] == 1.0 and s["max_new_tokens"] == 6 for s in sampling)


def test_loads_unloads_and_what_is_left_on_an_attached_server(stand_in: StandIn, tmp_path: Path) -> None:
    v0, _ = exported(tmp_path, "adapter-v0")
    v1, _ = exported(tmp_path, "adapter-v1", seed=4)
    shared = tmp_path / "shared"
    shared.mkdir()
    sampler = attach(stand_in.url, shared_dir=shared)
    first = sampler.publish(v0, "lora-parity-1-v0", 1)
    assert Path(first.path).parent.parent == shared and (Path(first.path) / "adapter_config.json").is_file()
    with pytest.raises(ScoreError, match=r"answered 400: .*already loaded"):  # SGLang keeps no silent old adapter
        sampler.publish(v1, "lora-parity-1-v0", 1)
    again = sampler.publish(v1, "lora-parity-1-v0", 1, inplace=True)  # no in-place reload: unload, then load
    assert [p for m, p, _, _ in stand_in.requests if m == "POST"][-2:] == ["/unload_lora_adapter", "/load_lora_adapter"]
    assert again.name == first.name and stand_in.registry[again.name][1] == str(again.path)
    sampler.publish(v0, "lora-parity-2-v1", 2)
    sampler.retire(AdapterHandle("never-loaded", 9, Path()))  # "does not exist": already retired
    assert len(stand_in.registry) == 2
    sampler.close()
    assert stand_in.registry == {} and not any(shared.iterdir())


def test_error_answers_are_one_line_and_never_hold_the_key(stand_in: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORA_PARITY_TEST_KEY", SECRET)
    stand_in.server_args["api_key"] = SECRET  # /server_info holds it, as SGLang's does

    def echo(h: http.server.BaseHTTPRequestHandler, _: dict[str, Any]) -> bool:
        return answer_with(500, f"Traceback (most recent call last):\n  boom\nauth: {h.headers['Authorization']}\n"
                           .encode())(h, _)

    stand_in.overrides["/generate"] = echo
    sampler = attach(stand_in.url, api_key_env="LORA_PARITY_TEST_KEY")
    with pytest.raises(ScoreError) as e:
        sampler.score(SEQS[:1], None)
    message = str(e.value)
    assert "\n" not in message and "answered 500: Traceback" in message and "Bearer [redacted]" in message
    assert SECRET not in message
    assert all(h.get("Authorization") == f"Bearer {SECRET}" for _, _, h, _ in stand_in.requests)  # it was sent
    info = sampler.info()
    assert info.versions == {"sglang": "0.5.16-standin"} and info.settings["server.attention_backend"] == "fa3"
    assert info.settings["server.enable_deterministic_inference"] is True
    assert SECRET not in info.model_dump_json() and not any("api_key" in k for k in info.settings)
    stand_in.overrides["/load_lora_adapter"] = answer_with(200, b'{"success": false, "error_message": "no room"}')
    with pytest.raises(ScoreError, match=r"success false: .*no room"):
        sampler.publish(Path("x"), "x", 1)


def test_a_silent_server_is_left_at_the_timeout_and_a_trickling_one_at_the_deadline(
        stand_in: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_server, "REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(sglang_server, "REQUEST_DEADLINE_S", 2.0)
    sampler = attach(stand_in.url)

    def silent(h: http.server.BaseHTTPRequestHandler, _: dict[str, Any]) -> bool:
        time.sleep(5)
        return True

    def trickle(h: http.server.BaseHTTPRequestHandler, _: dict[str, Any]) -> bool:
        h.send_response(200)
        h.end_headers()
        try:
            for _ in range(50):
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass
        return True

    for override, error in ((silent, "no answer within 1 s"), (trickle, "no complete answer within 2 s")):
        stand_in.overrides["/generate"] = override
        start = time.perf_counter()
        with pytest.raises(ScoreError, match=error):
            sampler.score(SEQS[:1], None)
        assert time.perf_counter() - start < 4


# --- runs through the stand-in: clean, every fault that applies, the selftest -------------------------


@pytest.mark.parametrize("sync", ["new-id", "inplace"])
def test_an_attached_run_passes_records_the_url_without_credentials_and_leaves_nothing(
        stand_in: StandIn, checkpoint: Path, sync: str, tmp_path: Path) -> None:
    url = stand_in.url.replace("http://", "http://user:pw@") + "/?token=t"
    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=url, sync=sync, per_target=False,
                                 out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.PASS, receipt.error
    assert [p.name for p in receipt.phases][7:13] == ["stale", "stale_cached", "sync", "updated",
                                                   "updated_cached", "fresh"]
    assert {"P.parity.mean", "C.parity.mean"} <= {c.id for c in receipt.checks}
    assert receipt.sampler.backend == "sglang" and receipt.sampler.settings["server"] == f"attached at {stand_in.url}"
    assert {a.weight_version for a in receipt.adapters} == {"default"}  # read at each sync; a LoRA load leaves it
    settings = receipt.sampler.settings  # the lifecycle's settings, read off what the server reported
    assert settings["batch_invariant"] == "on (enable_deterministic_inference: true)"
    assert "cuda_graphs" not in settings and settings["sleep_mode"].startswith("off (")
    assert [r.detail for r in receipt.lifecycle or [] if r.condition == "batch-variant kernels"] == [
        "batch-invariant kernels on (enable_deterministic_inference: true): repeats exact, the deployed kernels "
        "not run"]
    assert any(line.startswith("the engine's weight version did not move across the sync ('default'")
               for line in findings.of_receipt(receipt))
    text = (tmp_path / "r.json").read_text()
    assert "pw" not in text.replace("pw@", "") and "token=t" not in text
    assert stand_in.registry == {}


@pytest.mark.parametrize("fault, sync, verdict, caught", [
    ("stale-folder", "new-id", Verdict.FAIL, "C.parity.mean"),
    ("stale-folder", "inplace", Verdict.FAIL, "C.parity.mean"),
    ("same-name-no-inplace", "new-id", Verdict.FAIL, "C.parity.mean"),
    ("skip-sync", "new-id", Verdict.FAIL, "C.parity.mean"),
])
def test_each_fault_that_applies_fires_through_the_http_client(stand_in: StandIn, checkpoint: Path, fault: str,
                                                               sync: str, verdict: Verdict, caught: str,
                                                               tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, inject=fault, sync=sync,
                                 per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == verdict
    assert {c.id: c.status for c in receipt.checks}[caught] == CheckStatus.FAIL
    if fault == "stale-folder" and sync == "new-id":  # the load of the old path under a new name: 200, a warning
        assert stand_in.warnings and "adapter-v0 is already loaded with name" in stand_in.warnings[0]
    assert stand_in.registry == {}


def test_faults_that_cannot_happen_on_sglang_are_refused(stand_in: StandIn, tmp_path: Path) -> None:
    traits = SGLangSampler.traits
    for fault, sync, why in (("warm-prefix-cache", "new-id", "lora_id minted at every load"),
                             ("reuse-adapter-id", "new-id", "already loaded"),
                             ("no-reload-flag", "inplace", "already loaded"),
                             ("unload-before-score", "new-id", "Reloading evicted adapter"),
                             ("unload-before-score", "tensors", "Reloading evicted adapter")):
        with pytest.raises(ConfigError, match=f"does not apply to sampler 'sglang'.*{why}"):
            execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, inject=fault, sync=sync,
                               out=tmp_path / "r.json"))
        assert fault not in faults_for(sync, traits)
    assert {"stale-folder", "same-name-no-inplace"} <= set(faults_for("new-id", traits))
    served = BackendTraits(served_over_http=True, reads_prefix_cache=True)
    assert {"warm-prefix-cache", "unload-before-score"} <= set(faults_for("new-id", served))
    assert "sgl-project/sglang#13771" in FAULTS["stale-folder"].description
    with pytest.raises(ConfigError, match="needs a sampler that reloads base weights; 'sglang' cannot"):
        execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, sync="merged",
                           out=tmp_path / "r.json"))


def test_selftest_through_the_stand_in_catches_every_fault_that_applies(stand_in: StandIn, checkpoint: Path,
                                                                       tmp_path: Path) -> None:
    result = selftest(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, per_target=False),
                      tmp_path)
    rows = {r.fault: r for r in result.rows}
    assert {"none", "stale-folder", "same-name-no-inplace", "skip-sync", "drop-target", "nan"} <= set(rows)
    assert not {"warm-prefix-cache", "reuse-adapter-id", "unload-before-score"} & set(rows)
    assert result.ok, [(r.fault, r.observed) for r in result.rows if not r.caught]


# --- a server lora-parity starts -------------------------------------------------------------------


def _stand_in_process(monkeypatch: pytest.MonkeyPatch, script: str | None = None) -> list[int]:
    """`sglang.launch_server` replaced by the stand-in as a process (or `script`); returns the pids
    launched, filled as they are."""
    monkeypatch.setattr(sglang_server, "installed", lambda: True)
    monkeypatch.setattr(sglang_server, "START_TIMEOUT_S", 60.0)
    real = sglang_server.launch_server
    pids: list[int] = []

    def argv(cfg: Any, model_dir: Path, port: int, deterministic: bool = True) -> list[str]:
        return [sys.executable, "-c", script] if script else [sys.executable, str(ROOT / "tests" / "sglang_server.py"),
                                                              str(port)]

    def launch(*args: Any, **kwargs: Any) -> Any:
        server = real(*args, **kwargs)
        pids.append(server.pid)
        return server

    monkeypatch.setattr(sglang_server, "server_argv", argv)
    monkeypatch.setattr(sglang_server, "launch_server", launch)
    return pids


def _group_alive(pgid: int) -> bool:
    from lora_parity.util import interrupt

    return interrupt.group_alive(pgid)


def test_a_started_server_is_launched_early_adopted_and_stopped(monkeypatch: pytest.MonkeyPatch, checkpoint: Path,
                                                                tmp_path: Path) -> None:
    pids = _stand_in_process(monkeypatch)
    receipt = execute(RunOptions(trainer="fake", sampler="sglang", per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.PASS, receipt.error
    assert len(pids) == 1 and not _group_alive(pids[0])
    assert receipt.sampler.settings["server"] == "started by lora-parity"
    assert {"sampler.start", "sampler.start_wait"} <= set(receipt.timings)


def test_a_server_that_dies_at_start_is_an_error_naming_sglang_with_its_log(monkeypatch: pytest.MonkeyPatch,
                                                                           checkpoint: Path, tmp_path: Path) -> None:
    pids = _stand_in_process(monkeypatch, "print('CUDA is not available'); raise SystemExit(3)")
    sampler = SGLangSampler(config.load(None), checkpoint, {})
    try:
        with pytest.raises(BackendUnavailableError, match=r"sglang.launch_server on port \d+ exited with code 3") as e:
            sampler.score(SEQS[:1], None)
        assert "CUDA is not available" in str(e.value)
    finally:
        sampler.close()
    assert not _group_alive(pids[0])


def test_plan_and_models_know_sglang() -> None:
    from lora_parity.cli.commands.models import sglang_support
    from lora_parity.run import plan

    tiny = config.load(None)
    text = plan.render(tiny, sampler="sglang")
    assert "--sampler sglang" in text and "SGLang has no CPU build" in text
    assert "the CPU or one GPU" in plan.render(tiny, sampler="vllm")
    glm = config.load("glm-5.3")
    assert "does not run a launch plan" in plan.render(glm, sampler="sglang")
    with pytest.raises(ConfigError, match=r"--sampler vllm \(the plan's sampler; sglang serves from one GPU"):
        plan.preflight(glm, glm.launch.trainer.backend if glm.launch else "megatron", "sglang")
    assert sglang_support(tiny) == "one GPU" and sglang_support(glm).startswith("no")



# --- --sync tensors: the adapter sent in memory --------------------------------------------------------


def test_sync_tensors_sends_the_folders_tensors_with_checksums_and_passes(stand_in: StandIn, checkpoint: Path,
                                                                          tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, sync="tensors",
                                 per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.PASS, receipt.error
    assert receipt.sync_mode == "tensors" and {a.mode for a in receipt.adapters} == {"tensors"}
    # the published versions go as tensors; only X's reference (the trainer's tensors written fresh) is loaded
    # by path, so X compares what the tensors delivered with what the server reads from a folder
    assert [b["lora_name"].split("-")[2] for b in stand_in.posted("/load_lora_adapter")] == ["fresh"]
    bodies = stand_in.posted("/load_lora_adapter_from_tensors")
    assert len(bodies) >= 2 and all(b["config_dict"]["r"] == config.load(None).adapter.rank for b in bodies)
    assert all("expected_checksums" not in b for b in bodies)  # sglang 0.5.16's scheduler dies checking them
    assert stand_in.registry == {}


def test_tensor_payload_is_the_folders_bytes(tmp_path: Path) -> None:
    folder, _ = exported(tmp_path, "v1")
    payload = tensor_payload(folder)
    config_file, tensors = af.read_adapter(folder)
    assert payload["config_dict"] == config_file
    stand_in = StandIn()
    try:  # the server reads back the folder's bytes (checked by sha256, as SGLang's [LORA-CHECK] does)
        checksums = {k: hashlib.sha256(t.data).hexdigest() for k, t in tensors.items()}
        status, _ = stand_in.answer("POST", "/load_lora_adapter_from_tensors",
                                    {"lora_name": "a", **payload, "expected_checksums": checksums})
        assert status == 200 and stand_in.registry["a"][1] == "__tensor__"
        first = next(iter(checksums))
        forged = {**payload, "expected_checksums": {**checksums, first: "0" * 64}}
        status, answer = stand_in.answer("POST", "/load_lora_adapter_from_tensors", {"lora_name": "b", **forged})
        assert status == 500 and first in answer["error_message"] and "b" not in stand_in.registry
    finally:
        stand_in.close()


@pytest.mark.parametrize("fault, verdict, caught", [
    ("skip-sync", Verdict.FAIL, "C.parity.mean"),
    ("stale-folder", Verdict.FAIL, "C.parity.mean"),
    ("wrong-direction", Verdict.FAIL, "C.delta.cosine"),
    ("leak", Verdict.FAIL, "B.withheld"),
])
def test_faults_fire_through_sync_tensors(stand_in: StandIn, checkpoint: Path, fault: str, verdict: Verdict,
                                          caught: str | None, tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, inject=fault,
                                 sync="tensors", per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == verdict, (receipt.error, [c.id for c in receipt.checks if c.status == CheckStatus.FAIL])
    if caught is not None:
        assert {c.id: c.status for c in receipt.checks}[caught] == CheckStatus.FAIL
    assert all("fresh" in b["lora_name"] for b in stand_in.posted("/load_lora_adapter"))
    assert stand_in.registry == {}


def test_sync_tensors_needs_a_sampler_that_loads_tensors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--sync tensors needs a sampler that loads adapters from tensors"):
        execute(RunOptions(trainer="fake", sampler="fake", sync="tensors", out=tmp_path / "r.json"))
    assert {"skip-sync", "stale-folder", "wrong-direction", "drop-target"} <= set(faults_for("tensors",
                                                                                          SGLangSampler.traits))


# --- an adapter SGLang cannot serve; a server a fault killed ---------------------------------------------


def test_unpaired_targets_are_the_ones_sglang_leaves_unstacked() -> None:
    from lora_parity.backends.sglang import ADAPTER_NEEDS
    from lora_parity.models.lora_targets import unpaired_target

    def names(*kinds: str, layer: int = 0) -> list[str]:
        block = {k: "mlp" if k in ("gate_proj", "up_proj", "down_proj") else "self_attn" for k in kinds}
        return [f"base_model.model.model.layers.{layer}.{block[k]}.{k}.lora_{ab}.weight" for k in kinds for ab in "AB"]

    assert unpaired_target(names("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"), ADAPTER_NEEDS) is None
    assert unpaired_target(names("q_proj", "v_proj", "gate_proj"), ADAPTER_NEEDS) is None  # k, up: zero-filled
    assert unpaired_target(names("k_proj", "v_proj"), ADAPTER_NEEDS) == ("base_model.model.model.layers.0.self_attn",
                                                                         "k_proj", "q_proj")
    assert unpaired_target(names("q_proj", "k_proj"), ADAPTER_NEEDS)[1:] == ("q_proj", "v_proj")
    assert unpaired_target(names("up_proj", "down_proj"), ADAPTER_NEEDS)[1:] == ("up_proj", "gate_proj")
    # per layer: one whole layer does not excuse another
    assert unpaired_target(names("q_proj", "v_proj") + names("v_proj", layer=1), ADAPTER_NEEDS)[0].endswith("layers.1"
                                                                                                          ".self_attn")


@pytest.mark.parametrize("sync", ["new-id", "tensors"])
def test_drop_target_is_refused_before_the_server_sees_it(stand_in: StandIn, checkpoint: Path, sync: str,
                                                          tmp_path: Path) -> None:
    from lora_parity.run.selftest import judge

    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url, inject="drop-target",
                                 sync=sync, per_target=False, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.ERROR
    assert "SGLang cannot serve an adapter with k_proj but no q_proj" in (receipt.error or "")
    loads = stand_in.posted("/load_lora_adapter") + stand_in.posted("/load_lora_adapter_from_tensors")
    assert not any("-v0-" in b["lora_name"] or "-v1-" in b["lora_name"] for b in loads)  # never sent
    assert stand_in.unstacked == {} and stand_in.answer("GET", "/health", {})[0] == 200
    targets = list(config.load(None).adapter.targets)
    n = receipt.probes.num_scored_positions
    sglang_says = judge("drop-target", receipt, set(), set(), targets, n, SGLangSampler.traits)
    assert sglang_says.caught and sglang_says.expected == "error: error recorded"
    assert not judge("drop-target", receipt, set(), set(), targets, n, None).caught  # elsewhere it must fail T.*
    # a sampler that needs nothing of the dropped target (q_proj dropped; only up needs gate): the usual check
    assert not judge("drop-target", receipt, set(), set(), targets, n,
                     BackendTraits(adapter_needs=(("up_proj", "gate_proj"),))).caught


def test_an_expected_error_is_caught_by_the_faults_own_error_only(stand_in: StandIn, checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    from lora_parity.run.selftest import judge

    receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=stand_in.url,
                                 inject="nan", per_target=False, out=tmp_path / "r.json")).receipt
    targets = list(config.load(None).adapter.targets)
    n = receipt.probes.num_scored_positions
    assert judge("nan", receipt, set(), set(), targets, n, SGLangSampler.traits).caught
    refused = receipt.model_copy(update={"error": "phase base: SGLang server: /generate: Connection refused"})
    for fault in ("unload-before-score", "nan", "adapter-changed", "drop-target"):
        assert not judge(fault, refused, set(), set(), targets, n, SGLangSampler.traits).caught, fault


def test_the_selftest_starts_again_a_server_a_fault_killed(monkeypatch: pytest.MonkeyPatch, checkpoint: Path,
                                                         tmp_path: Path) -> None:
    from lora_parity.backends import sglang

    pids = _stand_in_process(monkeypatch)
    monkeypatch.setattr(sglang, "require_servable", lambda folder: None)  # as before the refusal: SGLang gets it
    result = selftest(RunOptions(trainer="fake", sampler="sglang", per_target=False), tmp_path,
                      faults=["drop-target", "skip-sync", "nan"])
    rows = {r.fault: r for r in result.rows}
    dropped = rows["drop-target"]
    assert not dropped.caught  # the server's death is not the refusal the selftest expects of sglang
    assert "exited with code 1" in dropped.observed and "Cannot find target module name" in dropped.observed
    assert dropped.observed.startswith("error: phase ") and "(unloading its adapter failed too)" in dropped.observed
    assert dropped.restarted is not None and dropped.restarted.startswith("sglang.launch_server had exited with code 1")
    assert rows["skip-sync"].caught and rows["nan"].caught, [r.observed for r in result.rows]
    assert rows["none"].restarted is None and rows["skip-sync"].restarted is None
    assert len(pids) == 1 and not _group_alive(pids[0])  # the first server is gone ...
    from lora_parity.backends.server_process import _RUNNING
    assert not _RUNNING  # ... and so is the one started again, at the selftest's end


def test_sglang_loads_an_unloaded_adapter_again_when_a_request_names_it(stand_in: StandIn, tmp_path: Path) -> None:
    folder, trainer = exported(tmp_path, "v1")
    sampler = attach(stand_in.url)
    try:
        handle = sampler.publish(folder, "a", 1)
        before = sampler.score(SEQS, handle)
        sampler.retire(handle)
        assert sampler.score(SEQS, handle) == before == trainer.score(SEQS)  # the path, read again: no error
        assert stand_in.warnings[-1] == f"Reloading evicted adapter: {handle.name}"
        tensors = sampler.publish_tensors(folder, "b", 2)
        sampler.retire(tensors)
        with pytest.raises(ScoreError, match="Failed to implicitly load LoRA adapter"):
            sampler.score(SEQS, tensors)
    finally:
        sampler.close()
    assert "unload-before-score" not in faults_for("new-id", SGLangSampler.traits)


def test_server_and_model_info_use_the_current_names_and_fall_back_on_an_older_release(stand_in: StandIn) -> None:
    sampler = attach(stand_in.url)
    try:
        assert sampler.info().settings["server.attention_backend"] == "fa3"
    finally:
        sampler.close()
    gets = [p for m, p, _, _ in stand_in.requests if m == "GET"]
    assert "/model_info" in gets and "/server_info" in gets and not any(p.startswith("/get_") for p in gets)
    older = StandIn()  # a release before /model_info and /server_info: 404 there, the /get_ names answer
    older.overrides = {path: answer_with(404, b'{"detail":"Not Found"}') for path in ("/model_info", "/server_info")}
    try:
        sampler = attach(older.url)
        assert sampler.info().settings["server.attention_backend"] == "fa3"
        sampler.close()
        gets = [p for m, p, _, _ in older.requests if m == "GET"]
        assert gets.index("/get_model_info") > gets.index("/model_info") and "/get_server_info" in gets
    finally:
        older.close()


def test_the_weight_version_is_read_from_model_info_and_a_lora_load_leaves_it(stand_in: StandIn,
                                                                                tmp_path: Path) -> None:
    """Issue 51: SGLang's `weight_version` (`/model_info`, "default" unless `--weight-version` or a weight update
    names one) is recorded; a LoRA load does not move it, which the stand-in keeps as SGLang does."""
    folder, _ = exported(tmp_path, "v1")
    sampler = attach(stand_in.url)
    try:
        before = sampler.weight_version()
        sampler.publish(folder, "a", 1)
        assert before == sampler.weight_version() == "default"
    finally:
        sampler.close()
    quiet = StandIn()  # a server whose /model_info carries no version, then one that refuses the route
    quiet.overrides = {"/model_info": answer_with(200, b'{"model_path": "m"}')}
    try:
        sampler = attach(quiet.url)
        assert sampler.weight_version() is None
        quiet.overrides = {p: answer_with(500, b"{}") for p in ("/model_info", "/get_model_info")}
        assert sampler.weight_version() is None
        sampler.close()
    finally:
        quiet.close()


def test_what_a_server_says_about_itself_is_bounded_finite_and_redacted(checkpoint: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46, cases 3, 4, 9: NaN in `/server_info`, a 1 MiB version string, and a version that echoes the key
    (JSON-escaped, or cut mid-key) keep the receipt whole, verifiable and free of the key."""
    from lora_parity.models.provenance import redact_secrets
    from lora_parity.verdict.verify import verify

    key = "sk-standin/key+with\"quote-0123456789"
    monkeypatch.setenv("SGL_TEST_KEY", key)
    server = StandIn(server_args={"version": "v" * 2**20 + json.dumps(key), "attention_backend": float("nan"),
                                  "mem_fraction_static": float("inf")})
    try:
        receipt = execute(RunOptions(trainer="fake", sampler="sglang", sampler_url=server.url, per_target=False,
                                     api_key_env="SGL_TEST_KEY", out=tmp_path / "r.json")).receipt
    finally:
        server.close()
    assert receipt.verdict == Verdict.PASS, receipt.error
    assert len(receipt.sampler.versions["sglang"]) <= 200
    assert receipt.sampler.settings["server.attention_backend"] == "nan"
    assert receipt.sampler.settings["server.mem_fraction_static"] == "inf"
    text = (tmp_path / "r.json").read_text()
    assert key[:10] not in text and verify(tmp_path / "r.json").receipt.digest == receipt.digest
    # every form a key takes in a server's text, and a body cut inside it
    for form in (key, json.dumps(key)[1:-1], repr(key)[1:-1]):
        assert key[:10] not in redact_secrets(f"echo {form} end", key)
    assert redact_secrets(f"error body: Bearer {key[:20]}", key) == "error body: Bearer [redacted]"
