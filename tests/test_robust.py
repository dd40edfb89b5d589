"""Issue 18, the remaining rows: signals, refused-at-preflight input, safe loading, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lora_parity.backends.megatron.layout import Shape
from lora_parity.backends.vllm_options import engine_options, serve_command
from lora_parity.models import config
from lora_parity.run.runner import RunOptions, prepare
from lora_parity.util import interrupt, scratch
from lora_parity.util.errors import ConfigError

from .conftest import ROOT, cli

unit = pytest.mark.unit

# A run on the fake backends that, at its third sampler scoring (phase `zero`), starts a child process
# (standing in for an engine or a rank process), writes its pid, and sends itself a signal.
DRIVER = """
import os, signal, subprocess, sys
from lora_parity.backends import fake
from lora_parity.cli import main
sig, out, pidfile = sys.argv[1:4]
calls = [0]
original = fake.FakeSampler.score
def score(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:
        child = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open(pidfile, "w").write(str(child.pid))
        os.kill(os.getpid(), getattr(signal, sig))
    return original(self, *args, **kwargs)
fake.FakeSampler.score = score
sys.argv = ["lora-parity", "run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--out", out]
main()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


@unit
@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_mid_run_leaves_a_verifying_receipt_and_nothing_else(sig: str, code: int, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out, pidfile = tmp_path / "r.json", tmp_path / "child.pid"
    proc = subprocess.run([sys.executable, "-c", DRIVER, sig, str(out), str(pidfile)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, timeout=120)
    assert proc.returncode == code, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"interrupted by {sig} in phase zero" in errors[0] and str(out) in errors[0]
    assert "Traceback" not in proc.stderr
    verified = cli("verify", str(out))
    assert verified.returncode == 1, verified.stdout + verified.stderr
    data = json.loads(out.read_text())
    assert data["verdict"] == "error" and data["error"] == f"interrupted by {sig} in phase zero"
    assert [(p["name"], p["status"]) for p in data["phases"]][-1] == ("zero", "error")
    assert list(tmp.iterdir()) == []  # no work dir, no scratch folder
    assert not _alive(int(pidfile.read_text()))  # the child process was ended


@unit
def test_end_children_ends_grandchildren_too() -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 300 & wait"])
    time.sleep(0.3)
    ended = interrupt.end_children(grace=2.0)
    assert parent.pid in ended and len(ended) >= 2
    assert all(not _alive(p) for p in ended)
    parent.wait(timeout=5)


# A server in a session of its own that ignores SIGTERM and forks a worker once the interrupt has
# begun (after end_children read the process tree), as vLLM's API server may fork its engine core.
LATE_FORKER = """
import os, signal, subprocess, sys, time
os.setsid()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(float(sys.argv[1]))
worker = subprocess.Popen(["sleep", "300"])
open(sys.argv[2], "w").write(str(worker.pid))
time.sleep(300)
"""


@unit
def test_end_children_ends_a_servers_group_with_what_it_forked_late(tmp_path: Path) -> None:
    pidfile = tmp_path / "worker.pid"
    server = subprocess.Popen([sys.executable, "-c", LATE_FORKER, "0.8", str(pidfile)])
    time.sleep(0.5)  # in its own group now; the worker is not forked yet
    assert os.getpgid(server.pid) == server.pid and not pidfile.exists()
    ended = interrupt.end_children(grace=1.5)
    assert server.pid in ended and pidfile.exists()
    worker = int(pidfile.read_text())
    assert worker not in ended  # forked after the tree was read: ended through the group
    assert not interrupt.group_alive(server.pid) and not _alive(worker)
    server.wait(timeout=5)


EXIT_FAST = """
import os, sys, types
sys.modules["torch"] = types.ModuleType("torch")  # what a run has imported when it exits fast
from lora_parity.backends.server_process import ServerProcess, free_port
from lora_parity.cli.app import _exit_fast
server = ServerProcess(["sleep", "300"], dict(os.environ), free_port(), 10.0)
server.launch()
print(server.pid, flush=True)
_exit_fast(3)
"""


@unit
def test_the_fast_exit_stops_a_server_still_running() -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_FAST], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 3, done.stderr
    assert not interrupt.group_alive(int(done.stdout.split()[0]))


@unit
def test_crash_at_typo_is_refused_naming_the_phases(tmp_path: Path) -> None:
    start = time.monotonic()
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--inject", "crash-at=sycn", "--out",
            str(tmp_path / "r.json"))
    assert r.returncode == 2 and time.monotonic() - start < 15
    assert r.stderr.count("\n") == 1 and "no phase 'sycn'" in r.stderr
    for phase in ("base", "zero", "sync", "updated", "target.q_proj"):
        assert phase in r.stderr
    assert not (tmp_path / "r.json").exists()


@unit
def test_crash_at_a_real_phase_still_runs() -> None:
    plan = prepare(RunOptions(trainer="fake", sampler="fake", inject="crash-at=target.v_proj"))
    assert plan.opts.inject == "crash-at=target.v_proj"


@unit
@pytest.mark.parametrize("probes", ["default-x100000000", "default-x200"])
def test_huge_probe_sets_refused_at_preflight(probes: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"probes\.max_sequences"):
        prepare(RunOptions(trainer="fake", sampler="fake", probes=probes))
    assert time.monotonic() - start < 5
    prepare(RunOptions(trainer="fake", sampler="fake", probes="default-x10"))  # benchmarks' size still runs


def _write(tmp_path: Path, data: dict[str, object]) -> Path:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@unit
def test_probe_longer_than_max_model_len_refused_at_preflight(tmp_path: Path) -> None:
    data = config.load("tiny-qwen3").model_dump(mode="json", exclude_none=True)
    data["sampler"]["max_model_len"] = 100  # the probes are 65 and 129 tokens
    with pytest.raises(ConfigError, match=r"probe length 129 is above sampler\.max_model_len 100"):
        prepare(RunOptions(model=str(_write(tmp_path, data)), trainer="fake", sampler="fake"))


def _pickled_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512}))
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    return folder


@unit
def test_yaml_path_to_pickled_weights_refused_at_preflight(tmp_path: Path) -> None:
    data = config.load("tiny-qwen3").model_dump(mode="json", exclude_none=True)
    data["model"] = {"path": str(_pickled_folder(tmp_path / "ckpt")), "dtype": "float32"}
    with pytest.raises(ConfigError, match=r"no \.safetensors weights \(found pytorch_model.bin\)"):
        prepare(RunOptions(model=str(_write(tmp_path, data)), trainer="hf", sampler="hf"))


@unit
def test_hub_snapshot_with_pickled_weights_refused_at_preflight(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    _pickled_folder(hub / "models--org--m" / "snapshots" / "abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    data = config.load("tiny-qwen3").model_dump(mode="json", exclude_none=True)
    data["model"] = {"hf_id": "org/m", "dtype": "float32"}
    with pytest.raises(ConfigError, match="pickled"):
        prepare(RunOptions(model=str(_write(tmp_path, data)), trainer="hf", sampler="hf"))


@unit
def test_vllm_is_told_to_load_safetensors_only() -> None:
    assert engine_options(config.load("tiny-qwen3"), "m", cuda=False)["load_format"] == "safetensors"


@unit
def test_a_fixed_gpu_kv_cache_reaches_vllm_and_its_serve_line() -> None:
    cfg = config.load("tiny-qwen3")
    assert "kv_cache_memory_bytes" not in engine_options(cfg, "m", cuda=True)
    fixed = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"gpu_kv_cache_gib": 1.5})})
    options = engine_options(fixed, "m", cuda=True)
    assert options["kv_cache_memory_bytes"] == 1610612736
    assert "--kv-cache-memory-bytes 1610612736" in serve_command(options)
    assert "kv_cache_memory_bytes" not in engine_options(fixed, "m", cuda=False)  # the CPU build sizes its own


@unit
def test_the_adapters_dtype_on_the_engine_is_the_users_to_set() -> None:
    """sampler.lora_dtype reaches vLLM in process, its serve line and the server's argv; unset, vLLM decides."""
    from pathlib import Path

    from lora_parity.backends.vllm_server import server_argv

    cfg = config.load("tiny-qwen3")
    assert "lora_dtype" not in engine_options(cfg, "m", cuda=True)
    fp32 = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"lora_dtype": "float32"})})
    options = engine_options(fp32, "m", cuda=True)
    assert options["lora_dtype"] == "float32" and "--lora-dtype float32" in serve_command(options)
    argv = server_argv(fp32, Path("ckpt"), 8123, cuda=True)
    assert argv[argv.index("--lora-dtype") + 1] == "float32"
    assert "--lora-dtype" not in server_argv(cfg, Path("ckpt"), 8123, cuda=True)


@unit
def test_served_sampler_takes_the_configs_gpu_share() -> None:
    """On CUDA the server gets the config's GPU memory share, KV cache and tensor parallelism, as the in-process
    engine does (without them it asks for vLLM's default 0.9 of a GPU the trainer shares); a user's engine_args
    still win; on the CPU none of them is passed."""
    from pathlib import Path

    from lora_parity.backends.vllm_server import server_argv

    cfg = config.load("tiny-qwen3")
    shared = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={
        "gpu_memory_utilization": 0.06, "gpu_kv_cache_gib": 0.5, "tensor_parallel_size": 2})})
    argv = server_argv(shared, Path("ckpt"), 8123, cuda=True)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.06"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(2**29)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    mine = shared.model_copy(update={"sampler": shared.sampler.model_copy(update={
        "engine_args": {"gpu_memory_utilization": 0.3}})})
    argv = server_argv(mine, Path("ckpt"), 8123, cuda=True)
    assert argv.count("--gpu-memory-utilization") == 1 and argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"
    cpu = server_argv(shared, Path("ckpt"), 8123, cuda=False)
    assert not {"--gpu-memory-utilization", "--kv-cache-memory-bytes", "--tensor-parallel-size"} & set(cpu)


@unit
def test_megatron_shapes_refused_before_loading() -> None:
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    Shape.from_hf(hf, 2)
    with pytest.raises(ConfigError, match="--tp 3 does not divide KV heads"):
        Shape.from_hf(hf, 3)
    with pytest.raises(ConfigError, match="lacks hidden_size, intermediate_size, num_hidden_layers"):
        Shape.from_hf({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512}, 1)


@pytest.mark.megatron
def test_megatron_tp3_refused_at_preflight_in_a_second(tmp_path: Path) -> None:
    start = time.monotonic()
    r = cli("run", "--trainer", "megatron", "--tp", "3", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and "--tp 3 does not divide" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "r.json").exists() and time.monotonic() - start < 60


@unit
def test_scratch_folders_removed() -> None:
    a, b = scratch.folder("lora-parity-t-"), scratch.folder("lora-parity-t-")
    (a / "f").write_text("x")
    scratch.remove_all()
    assert not a.exists() and not b.exists()


def _left_behind(tmp: Path) -> list[str]:
    """What a run left in its temp dir, less torch's compile cache (kept across runs on purpose)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


@pytest.mark.cpu_e2e
def test_real_run_sigterm_after_zero_leaves_nothing(tmp_path: Path) -> None:
    """The acceptance check's last case, on the real backends: SIGTERM once phase `zero` is done."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out, log = tmp_path / "r.json", tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lora_parity", "run", "--out", str(out)], stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 300
    while "ok zero" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, log.read_text()
    assert cli("verify", str(out)).returncode == 1
    assert "interrupted by SIGTERM" in json.loads(out.read_text())["error"]
    assert _left_behind(tmp) == []  # no lora-parity-*, no vllm_dist_*
    assert interrupt.descendants(proc.pid) == []


@pytest.mark.cpu_e2e
def test_real_run_leaves_no_temp_files(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = cli("run", "--no-per-target", "--out", str(tmp_path / "r.json"), env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert _left_behind(tmp) == []


@unit
def test_trust_remote_code_from_a_config_needs_the_flag(tmp_path: Path) -> None:
    data = config.load("tiny-qwen3").model_dump(mode="json", exclude_none=True)
    data["model"]["trust_remote_code"] = True
    path = str(_write(tmp_path, data))
    with pytest.raises(ConfigError, match="pass --trust-remote-code"):
        prepare(RunOptions(model=path, trainer="fake", sampler="fake"))
    allowed = prepare(RunOptions(model=path, trainer="fake", sampler="fake", trust_remote_code=True))
    assert allowed.cfg.model.trust_remote_code
    r = cli("run", "--model", path, "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--trust-remote-code" in r.stderr


@unit
def test_packages_listed_in_pyproject_are_every_package() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / "lora_parity").rglob("__init__.py")}
    assert listed == found | {"lora_parity.configs"}


@unit
def test_configs_ship_in_the_wheel_and_never_come_from_the_working_directory(tmp_path: Path) -> None:
    """Build the wheel, install it into a folder, and run from another directory whose ./configs holds a
    config of the same name that turns on remote code: the packaged config is the one used."""
    import shutil

    wheels, site, cwd, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere", tmp_path / "src"
    for part in ("lora_parity", "configs"):  # a copy: the build writes build/ and egg-info beside its source
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(src)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              *map(str, wheels.glob("*.whl"))], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    (cwd / "configs").mkdir(parents=True)
    hostile = (ROOT / "configs" / "tiny-qwen3.yaml").read_text().replace("dtype: float32", "dtype: float32\n"
                                                                          "  trust_remote_code: true", 1)
    (cwd / "configs" / "tiny-qwen3.yaml").write_text(hostile)
    env = {k: v for k, v in os.environ.items() if k not in ("LORA_PARITY_CONFIGS",)}
    env["PYTHONPATH"] = str(site)
    probe = ("import lora_parity.models.config as c; cfg = c.load('tiny-qwen3'); "
             "print(c.__file__, c.configs_dir(), cfg.model.trust_remote_code)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    module, where, trusted = r.stdout.split()
    assert module.startswith(str(site)) and where == str(site / "lora_parity" / "configs") and trusted == "False"
    models = subprocess.run([sys.executable, "-m", "lora_parity", "run", "--model", "tiny-qwen3", "--trainer", "fake",
                             "--sampler", "fake", "--out", str(tmp_path / "r.json")], capture_output=True, text=True,
                            cwd=cwd, env=env, timeout=120)
    assert models.returncode == 0, models.stderr


# --- verify --rerun ---------------------------------------------------------------------------------

def _parse(name: str, args: list[str]) -> dict[str, object]:
    """The CLI's parser of a recorded command line, as `verify --rerun` hands it to `rerun`."""
    import typer

    from lora_parity.cli.app import app
    from lora_parity.cli.commands.receipts import command_parser

    parse: Callable[[str, list[str]], dict[str, object]] = command_parser(typer.main.get_command(app))
    return parse(name, args)


PARSE = _parse

@pytest.fixture(scope="module")
def fake_receipt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rerun") / "r.json"
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--probes", "held-out", "--seed", "3", "--no-per-target",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


@unit
def test_rerun_reproduces_a_cpu_fp32_receipt_bit_for_bit(fake_receipt: Path) -> None:
    r = cli("verify", "--rerun", str(fake_receipt))
    assert r.returncode == 0, r.stderr
    assert "rerun reproduces every score" in r.stdout and "bit for bit" in r.stdout and "ran " in r.stdout


@unit
def test_rerun_names_the_first_differing_phase_and_position(fake_receipt: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import fake
    from lora_parity.cli.rerun import options_for, rerun
    from lora_parity.verdict.verify import verify

    receipt = verify(fake_receipt).receipt
    opts = options_for(receipt, PARSE)
    assert (opts.probes, opts.seed, opts.per_target, opts.trainer) == ("held-out", 3, False, "fake")
    original = fake.FakeSampler.score

    def off_by_a_little(self: object, sequences: list[list[int]], adapter: object) -> list[list[float]]:
        scores = original(self, sequences, adapter)  # type: ignore[arg-type]
        return [[x + (1e-9 if (s, t) == (1, 4) and adapter is not None else 0.0) for t, x in enumerate(seq)]
                for s, seq in enumerate(scores)]

    monkeypatch.setattr(fake.FakeSampler, "score", off_by_a_little)
    result = rerun(receipt, PARSE)
    assert result.code == 1 and "phase zero, sequence 1, position 4" in result.message


@unit
def test_a_rerun_that_cannot_run_here_says_why_and_exits_2(fake_receipt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46, case 10: a rerun that stops (a GPU receipt on a CPU machine, a sampler that cannot start) is
    "cannot rerun here" with its cause, exit 2, not "rerun differs" (exit 1)."""
    from lora_parity.backends import fake
    from lora_parity.cli.rerun import rerun
    from lora_parity.util.errors import BackendUnavailableError
    from lora_parity.verdict.verify import verify

    def no_engine(self: object, *args: object, **kwargs: object) -> None:
        raise BackendUnavailableError("fake: no CUDA device on this machine")

    monkeypatch.setattr(fake.FakeSampler, "__init__", no_engine)
    result = rerun(verify(fake_receipt).receipt, PARSE)
    assert result.code == 2 and result.message.startswith("cannot rerun here: the rerun stopped:"), result.message
    assert "no CUDA device" in result.message


@unit
def test_rerun_refuses_when_the_config_changed(fake_receipt: Path, tmp_path: Path) -> None:
    from lora_parity.evidence import receipt as rc

    data = json.loads(fake_receipt.read_text())
    data["model"]["config_digest"] = "0" * 64
    data["digest"] = rc.compute_digest(data)
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    assert cli("verify", str(changed)).returncode == 0  # intact
    r = cli("verify", "--rerun", str(changed))
    assert r.returncode == 2 and "cannot rerun" in r.stderr and "digest changed" in r.stderr
