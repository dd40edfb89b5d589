"""Multi-node Megatron runs, tested the way one machine can: two torchrun "nodes" (one process each,
a c10d rendezvous on 127.0.0.1, gloo, TP2 across them), started with the commands that
`run --plan` prints, and a node that dies mid-run.

Cost on the 2-core development machine under load from other work (load average 12): about 70 s
for the two-node run (20 s idle), about 55 s for each dead-node case (a frozen node's rank is
declared lost after LORA_PARITY_RANK_TIMEOUT, 10 s here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lora_parity import launch
from lora_parity.backends.megatron import liveness, protocol
from lora_parity.models import config
from lora_parity.run import plan

from .conftest import ROOT, cli


def _has_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


requires_megatron = pytest.mark.skipif(not _has_megatron(), reason="megatron-core (the 'megatron' extra) is absent")

RANK_TIMEOUT = 10
"""LORA_PARITY_RANK_TIMEOUT in these tests: seconds without a heartbeat before a rank is lost."""
PLAN_ARGS = ("run", "--model", "tiny-qwen3", "--trainer", "megatron", "--tp", "2", "--sampler", "hf", "--plan")


# --- Plan and settings (pure) ----------------------------------------------------------------------


def _node_lines(text: str) -> list[str]:
    """The per-node commands of a plan: the text after "node R:" on each such line."""
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("node ")]


@pytest.mark.unit
def test_plan_prints_one_torchrun_command_per_node() -> None:
    text = plan.render(config.load("tiny-qwen3"), "tiny-qwen3", "megatron", 2, "hf")
    commands = [shlex.split(c) for c in _node_lines(text)]
    assert len(commands) == 2
    for rank, argv in enumerate(commands):
        flags = dict(zip(argv[1::2], argv[2::2], strict=False))
        assert argv[0] == "torchrun"
        assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "1" and flags["--node-rank"] == str(rank)
        assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "127.0.0.1:29500"
        assert flags["--local-addr"] == "127.0.0.1"  # rank 0's MASTER_ADDR: gloo then uses loopback
        assert argv[argv.index("-m") + 1:] == ["lora_parity.launch", "run", "--model", "tiny-qwen3", "--trainer",
                                               "megatron", "--sampler", "hf", "--tp", "2"]
    # The one-host torchrun line too; and nothing of it without the Megatron trainer at TP > 1.
    assert "torchrun --nproc-per-node 2 -m lora_parity.launch run" in text
    for trainer, tp in (("megatron", 1), ("hf", 2), ("megatron", None)):
        assert "torchrun" not in plan.render(config.load("tiny-qwen3"), None, trainer, tp)


@pytest.mark.unit
def test_gloo_uses_loopback_only_when_rank_0_is_on_it_and_no_interface_is_named() -> None:
    assert launch.loopback_gloo({"MASTER_ADDR": "127.0.0.1"}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert launch.loopback_gloo({"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth1"}) == {}
    assert launch.loopback_gloo({"MASTER_ADDR": "node0.cluster"}) == {}
    assert launch.loopback_gloo({}) == {}


@pytest.mark.unit
def test_rank_timeout_is_a_positive_number_of_seconds() -> None:
    assert protocol.rank_timeout({}) == protocol.DEFAULT_RANK_TIMEOUT
    assert protocol.rank_timeout({protocol.RANK_TIMEOUT_ENV: " 2.5 "}) == 2.5
    for bad in ("0", "-3", "soon", "nan", "inf"):
        with pytest.raises(protocol.errors.ConfigError, match=protocol.RANK_TIMEOUT_ENV):
            protocol.rank_timeout({protocol.RANK_TIMEOUT_ENV: bad})


@pytest.mark.unit
def test_placement_settings_count_nodes_and_keep_rank_order() -> None:
    settings = liveness.placement_settings([{"node": "0", "host": "aa"}, {"node": "1", "host": "bb"},
                                            {"node": "1", "host": "bb"}])
    assert settings == {"nodes": 2, "rank_nodes": ["0", "1", "1"], "rank_hosts": ["aa", "bb", "bb"]}
    assert liveness.placement({"GROUP_RANK": "3"})["node"] == "3"
    assert liveness.placement({})["node"] == "0"


class _Store:
    """A dict with the TCPStore calls the heartbeats use."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


@pytest.mark.unit
def test_a_rank_whose_heartbeat_stops_is_lost_and_a_beating_one_is_not() -> None:
    store, lost = _Store(), []
    watchdog = liveness.Liveness(store, 0, 3, timeout=1.0, on_lost=lambda ranks, s: lost.append((ranks, s)))
    beating = liveness.Liveness(store, 1, 3, timeout=1.0, on_lost=lambda ranks, s: None)
    beating.start()  # rank 1 beats; rank 2 never does
    watchdog.start()
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [([2], 1.0)]
    assert watchdog.silent_since(time.monotonic() - 0.5) == [2]


@pytest.mark.unit
def test_a_last_beat_seen_only_after_the_failure_does_not_make_a_dead_rank_alive() -> None:
    """Rank 1 beat once and died; the failure came before rank 0's thread read that beat (a loaded
    machine): the beat is from before the failure, so rank 1 is still named lost."""
    class Slow(_Store):
        def get(self, key: str) -> bytes:
            time.sleep(0.3)  # the first read of rank 1's counter ends after the failure
            return super().get(key)

    store = Slow()
    watchdog = liveness.Liveness(store, 0, 2, timeout=2.0, on_lost=lambda ranks, s: None)
    watchdog.interval = 0.1
    store.set(liveness.KEY.format(rank=1), "1")  # its last beat, before it died
    watchdog.start()
    assert watchdog.lost_since_error()[0] == [1]  # the collective failed while that read was under way
    # A rank that keeps beating is not lost.
    store = _Store()
    watchdog = liveness.Liveness(store, 0, 2, timeout=2.0, on_lost=lambda ranks, s: None)
    live = liveness.Liveness(store, 1, 2, timeout=2.0, on_lost=lambda ranks, s: None)
    watchdog.interval = live.interval = 0.1
    live.start()
    watchdog.start()
    assert watchdog.lost_since_error() == ([], 0.0)


# --- Two "nodes" on this machine -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _node_commands() -> list[list[str]]:
    """The plan's per-node commands, as argv: `torchrun` as this interpreter's module (the venv's
    script need not be on PATH) and the rendezvous on a free port instead of 29500; nothing else changed."""
    res = cli(*PLAN_ARGS)
    assert res.returncode == 0, res.stderr
    port = _free_port()
    commands = []
    for line in _node_lines(res.stdout):
        argv = shlex.split(line.replace(plan.DEMO_RDZV, f"127.0.0.1:{port}"))
        assert argv[0] == "torchrun" and f"127.0.0.1:{port}" in argv
        commands.append([sys.executable, "-m", "torch.distributed.run", *argv[1:]])
    assert len(commands) == 2
    return commands


def _wait_listening(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"node 0's rendezvous store never listened on {port}")


class _Nodes:
    """Both nodes' processes (each in its own session), their output files, and their process trees."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.seen: set[int] = set()

    def start(self) -> None:
        env = {**os.environ, protocol.RANK_TIMEOUT_ENV: str(RANK_TIMEOUT),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        for rank, argv in enumerate(_node_commands()):
            if rank == 1:  # node 0 hosts the rendezvous store: it must be up first
                _wait_listening(int(argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1]), 60)
            log = self.tmp_path / f"node{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(argv, cwd=self.tmp_path, env=env, stdin=subprocess.DEVNULL,
                                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def trees(self) -> list[list[int]]:
        """Each node's torchrun agent and every process under it (torchrun starts its workers in
        sessions of their own, so a process group would miss them)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(stat.parent.name))
        trees = []
        for p in self.procs:
            found, todo = [], [p.pid]
            while todo:
                pid = todo.pop()
                found.append(pid)
                todo += children.get(pid, [])
            trees.append(found)
            self.seen.update(found)
        return trees

    def wait_for(self, text: str, seconds: float) -> int:
        """The node whose output shows `text` first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for rank in range(len(self.procs)):
                if text in self.log(rank):
                    return rank
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        raise AssertionError(f"no node printed {text!r}:\n" + "\n".join(self.log(r)[-3000:] for r in (0, 1)))

    def receipt(self) -> Path:
        (path,) = (self.tmp_path / "lora-parity-receipts").glob("*.json")
        return path

    def stop(self) -> None:
        self.trees()
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _verify(path: Path) -> tuple[int, dict[str, Any]]:
    res = cli("verify", str(path), "--json")
    return res.returncode, json.loads(res.stdout)


def _settle(procs: list[subprocess.Popen[bytes]], seconds: float) -> list[int | None]:
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


@pytest.mark.megatron
@requires_megatron
def test_two_nodes_started_as_the_plan_prints_pass_and_record_both(tmp_path: Path) -> None:
    nodes = _Nodes(tmp_path)
    try:
        nodes.start()
        codes = _settle(nodes.procs, 240)
        assert codes == [0, 0], "\n".join(nodes.log(r)[-3000:] for r in (0, 1))
        path = nodes.receipt()
        code, verified = _verify(path)
        assert code == 0 and verified["intact"] and verified["verdict"] == "pass"
        receipt = json.loads(path.read_text())
        settings = receipt["trainer"]["settings"]
        assert settings["processes"] == "torchrun" and settings["tensor_parallel"] == 2
        assert settings["nodes"] == 2 and settings["rank_nodes"] == ["0", "1"]
        # Both "nodes" ran on this machine: the same host digest, which is not the host name itself.
        assert len(set(settings["rank_hosts"])) == 1 and socket.gethostname() not in settings["rank_hosts"]
    finally:
        nodes.stop()


@pytest.mark.megatron
@requires_megatron
@pytest.mark.parametrize(("how", "signum"), [pytest.param("dies", signal.SIGKILL, id="killed"),
                                             pytest.param("freezes", signal.SIGSTOP, id="frozen")])
def test_a_node_that_dies_mid_run_ends_in_an_error_receipt_not_a_hang(tmp_path: Path, how: str,
                                                                      signum: signal.Signals) -> None:
    """SIGKILL: its sockets close and the next collective fails at once. SIGSTOP (a node that hangs,
    or a machine gone without closing its connections): the collective would wait for gloo's
    timeout, so the heartbeats end it after RANK_TIMEOUT."""
    nodes = _Nodes(tmp_path)
    try:
        nodes.start()
        driver = nodes.wait_for("trainer_zero", 180)  # the node torchrun ranked 0 runs the sequence
        trees = nodes.trees()
        for pid in trees[1 - driver]:  # the whole machine: agent and trainer rank
            os.kill(pid, signum)
        stopped = time.monotonic()
        code = _settle([nodes.procs[driver]], RANK_TIMEOUT + 60)[0]
        elapsed = time.monotonic() - stopped
        assert code is not None, "the surviving node hangs:\n" + nodes.log(driver)[-3000:]
        assert code != 0 and elapsed < RANK_TIMEOUT + 45
        receipt = json.loads(nodes.receipt().read_text())
        assert receipt["verdict"] == "error"
        assert "megatron rank 1 (node 1) lost" in receipt["error"], receipt["error"]
        if how == "freezes":
            assert f"no heartbeat for {RANK_TIMEOUT:g} s" in receipt["error"]
        assert [p["status"] for p in receipt["phases"]][-1] == "error"
        code, verified = _verify(nodes.receipt())
        assert code == 1 and verified["intact"] and verified["verdict"] == "error"
        time.sleep(1)
        assert [pid for pid in trees[driver] if _alive(pid)] == [], "orphan processes on the surviving node"
    finally:
        nodes.stop()
