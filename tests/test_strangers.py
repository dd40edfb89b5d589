"""Issue 23, the input side: receipts, configs, adapters, probe files and servers from someone else.
Each test is one case the adversarial pass found at 2e8f8f9 (its number in the issue in the name);
they run on the fake backends, small stand-in HTTP servers and stand-in processes: no model loads."""

from __future__ import annotations

import http.server
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from lora_parity.cli import junit
from lora_parity.evidence import outpath
from lora_parity.evidence import receipt as rc
from lora_parity.evidence.receipt import Verdict
from lora_parity.models import adapter_files as af
from lora_parity.models import config
from lora_parity.run import start_adapter
from lora_parity.run.runner import RunOptions, execute, prepare
from lora_parity.util import cache, scratch
from lora_parity.util.errors import ConfigError, ReceiptError
from lora_parity.util.in_flight import InFlight

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit
SECRET = "tml-stranger-test-key-0123456789"


def reseal(src: Path, dst: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of receipt `src` changed by `change` and sealed again (anyone can do this)."""
    data = json.loads(src.read_text())
    change(data)
    data["digest"] = rc.compute_digest(data)
    dst.write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("strangers") / "pass.json"
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


class Heard:
    """A stand-in HTTP server on 127.0.0.1 that records every request's path and headers; `answer`
    (a function of the handler) answers them (default: 200 `{}`)."""

    def __init__(self, answer: Callable[[http.server.BaseHTTPRequestHandler], None] | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        heard, reply = self.requests, answer or self.ok

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                heard.append((self.path, dict(self.headers)))
                reply(self)

            do_GET = do_POST = _any

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def ok(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        h.wfile.write(b"{}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def heard() -> Iterator[Heard]:
    server = Heard()
    yield server
    server.close()


def tiny_adapter(folder: Path, targets: list[str], *, hidden: int = 128, layers: int = 2, rank: int = 8,
                 base: str = "tiny-qwen3", **config_changes: Any) -> Path:
    """A PEFT adapter folder of rank `rank` on `targets` for a dense model of `hidden` size (tiny-qwen3's
    other shapes), written in plain Python."""
    heads, kv, head_dim, inter = 4, 2, 32, 256
    dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
            "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(layers):
        for kind in targets:
            inputs, outputs = dims.get(kind, (hidden, hidden))
            where = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{kind}"
            tensors[f"{name}.lora_A.weight"] = af.Tensor.from_floats("F32", [rank, inputs], [0.01] * rank * inputs)
            tensors[f"{name}.lora_B.weight"] = af.Tensor.from_floats("F32", [outputs, rank], [0.0] * outputs * rank)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": targets,
           "base_model_name_or_path": base, **config_changes}
    af.write_adapter(folder, cfg, tensors)
    return folder


# --- 1, 2, 16: a receipt is data -------------------------------------------------------------------


def test_01_rerun_never_contacts_a_url_the_receipt_names_nor_sends_the_key(passing: Path, heard: Heard,
                                                                        tmp_path: Path) -> None:
    def tinker(d: dict[str, Any]) -> None:
        d["command"] = ["run", "--trainer", "tinker", "--sampler", "tinker", "--tinker-url", heard.url]
        d["trainer"]["backend"] = d["sampler"]["backend"] = "tinker"
        d.pop("lifecycle")  # derived from the sampler's backend: as a receipt made before the table

    receipt = reseal(passing, tmp_path / "t.json", tinker)
    assert cli("verify", str(receipt)).returncode == 0  # intact: a plain digest proves nothing about its author
    r = cli("verify", "--rerun", str(receipt), env={"TINKER_API_KEY": SECRET})
    assert r.returncode == 2 and "pass the service with --tinker-url" in r.stderr, r.stderr
    assert heard.requests == []  # not even the health check
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_02_rerun_takes_no_trust_flag_and_no_path_from_the_receipt(passing: Path, tmp_path: Path) -> None:
    # A config anywhere on disk that turns on remote code, its digest written into the receipt: the
    # rerun refuses to load it (2e8f8f9 loaded it with --trust-remote-code, as the receipt said).
    evil = tmp_path / "evil.yaml"
    data = yaml.safe_load((config.configs_dir() / "tiny-qwen3.yaml").read_text())
    data["model"]["trust_remote_code"] = True
    evil.write_text(yaml.safe_dump(data))
    digest = config.load(str(evil)).digest()

    def point_at(model: str, command: bool) -> Callable[[dict[str, Any]], None]:
        def change(d: dict[str, Any]) -> None:
            d["model"]["config_digest"] = digest
            d["model"]["name"] = model
            d["command"] = ["run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--model", model,
                            "--trust-remote-code"] if command else []
        return change

    relative = os.path.relpath(evil, ROOT)
    assert relative.startswith("..")
    for model, command in ((str(evil), True), (relative, False)):
        receipt = reseal(passing, tmp_path / "r.json", point_at(model, command))
        r = cli("verify", "--rerun", str(receipt))
        assert r.returncode == 2 and "is not a shipped config" in r.stderr and "--model" in r.stderr, r.stderr
    # The verifier's own --model is used, and still without remote code unless the verifier says so.
    r = cli("verify", "--rerun", str(receipt), "--model", str(evil))
    assert r.returncode == 2 and "pass --trust-remote-code" in r.stderr, r.stderr


def test_02_only_the_allow_list_comes_from_the_recorded_command(passing: Path) -> None:
    import typer

    from lora_parity.cli.app import app
    from lora_parity.cli.commands.receipts import command_parser
    from lora_parity.cli.rerun import VerifierInputs, options_for

    parse = command_parser(typer.main.get_command(app))
    receipt = rc.load(passing)[0].model_copy(update={"command": [
        "run", "--trainer", "fake", "--sampler", "fake", "--trust-remote-code", "--sampler-url", "http://x:1",
        "--api-key-env", "HOME", "--shared-dir", "/", "--adapter", "/etc", "--out", "/etc/passwd", "--force",
        "--tp", "1", "--probes", "held-out", "--no-per-target"]})
    opts = options_for(receipt, parse)
    assert (opts.trust_remote_code, opts.sampler_url, opts.api_key_env, opts.shared_dir, opts.adapter, opts.out,
            opts.force, opts.tinker_url) == (False, None, None, None, None, None, False, None)
    assert (opts.probes, opts.per_target, opts.model) == ("held-out", False,
                                                         str(config.configs_dir() / "tiny-qwen3.yaml"))
    for name in ("../configs/tiny-qwen3", "/etc/passwd", "tiny-qwen3/../../x", "-x"):
        with pytest.raises(ConfigError, match="not a shipped config"):
            options_for(receipt.model_copy(update={"command": [], "model": receipt.model.model_copy(
                update={"name": name})}), parse)
    with pytest.raises(ConfigError, match="are a file"):
        options_for(receipt.model_copy(update={"command": ["run", "--probes", "/dev/zero.jsonl"]}), parse)
    mine = options_for(receipt, parse, VerifierInputs(model="tiny-qwen3", tinker_url="http://mine:1"))
    assert (mine.model, mine.tinker_url) == ("tiny-qwen3", "http://mine:1")


def test_02_rerun_has_no_import_of_the_cli() -> None:
    code = ("import sys, lora_parity.cli.rerun, lora_parity.cli.commands.receipts; "
            "print('lora_parity.cli.app' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
    assert "lora_parity.cli.app" not in (ROOT / "lora_parity" / "cli" / "rerun.py").read_text()


def test_16_rerun_exit_code_follows_the_verdict(tmp_path: Path) -> None:
    failing = tmp_path / "fail.json"
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--inject", "skip-sync",
            "--out", str(failing))
    assert r.returncode == 1, r.stderr
    r = cli("verify", "--rerun", str(failing))
    assert r.returncode == 1 and "rerun reproduces every score" in r.stdout and "verdict fail" in r.stdout, r.stdout
    r = cli("verify", str(failing), "--model", "tiny-qwen3")  # the verifier's inputs go with --rerun only
    assert r.returncode == 2 and "go with --rerun" in r.stderr


def test_rerun_of_a_run_on_a_model_by_path_needs_the_verifiers_model(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text((config.configs_dir() / "tiny-qwen3.yaml").read_text())
    receipt = tmp_path / "r.json"
    assert cli("run", "--trainer", "fake", "--sampler", "fake", "--no-per-target", "--model", str(mine),
               "--out", str(receipt)).returncode == 0
    r = cli("verify", "--rerun", str(receipt))
    assert r.returncode == 2 and "pass the model with --model" in r.stderr
    r = cli("verify", "--rerun", str(receipt), "--model", str(mine))
    assert r.returncode == 0 and "verdict pass" in r.stdout, r.stderr


# --- 3: nothing from an adapter reaches a command line ----------------------------------------------


def test_03_an_option_in_target_modules_is_refused_before_any_server_starts(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import lora_parity.backends.vllm_server as vllm_server

    launched: list[object] = []
    monkeypatch.setattr(vllm_server, "launch_server", lambda *a, **k: launched.append(a))
    ad = tiny_adapter(tmp_path / "ad", ["q_proj", "v_proj"])
    cfg = json.loads((ad / af.CONFIG_FILE).read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", "--host=0.0.0.0", "--lora-target-modules", "q_proj"]
    (ad / af.CONFIG_FILE).write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"target_modules: '--host=0\.0\.0\.0' is not a module name"):
        prepare(RunOptions(trainer="fake", sampler="vllm-server", adapter=ad), launch_early=True)
    assert time.perf_counter() - start < 5 and launched == []
    # The same from a YAML config, and the launch itself checks the names once more.
    with pytest.raises(ValueError, match="is not a module name"):
        config.AdapterSpec(rank=8, alpha=16, targets=["q_proj", "--host=0.0.0.0"])
    base = config.load(None)
    forged = base.model_copy(update={"adapter": config.AdapterSpec.model_construct(
        rank=8, alpha=16.0, targets=["q_proj", "--host=0.0.0.0"])})
    with pytest.raises(ConfigError, match="not a module name"):
        vllm_server.server_argv(forged, Path("-ckpt"), 8000, cuda=False)
    argv = vllm_server.server_argv(base, Path("-ckpt"), 8000, cuda=False)
    assert argv[argv.index("--model") + 1].startswith("/")  # a folder named like an option reads as a path


# --- 5: every file is bounded and regular -----------------------------------------------------------


def test_05_adapter_config_that_is_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    ad = tiny_adapter(tmp_path / "zero", ["q_proj", "v_proj"])
    (ad / af.CONFIG_FILE).unlink()
    (ad / af.CONFIG_FILE).symlink_to("/dev/zero")
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "lora_parity", "run", "--adapter", str(ad), "--out",
                        str(tmp_path / "r.json")], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       preexec_fn=_cap_memory)
    assert r.returncode == 2 and "not a regular file (a character device)" in r.stderr, r.stderr
    assert time.perf_counter() - start < 30 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.json.lock").exists()


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))  # an unbounded read fails, not the machine


@pytest.mark.parametrize("what", ["probes", "model", "config.json"])
def test_05_a_fifo_in_place_of_an_input_file_is_refused_without_hanging(what: str, tmp_path: Path) -> None:
    args = ["run", "--trainer", "fake", "--sampler", "fake", "--out", str(tmp_path / "r.json")]
    if what == "probes":
        os.mkfifo(tmp_path / "p.jsonl")
        args += ["--probes", str(tmp_path / "p.jsonl")]
    elif what == "model":
        os.mkfifo(tmp_path / "m.yaml")
        args += ["--model", str(tmp_path / "m.yaml")]
    else:
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
        os.mkfifo(tmp_path / "ckpt" / "config.json")
        args += ["--model", str(tmp_path / "ckpt")]
    r = subprocess.run([sys.executable, "-m", "lora_parity", *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 2 and "not a regular file (a FIFO)" in r.stderr, r.stderr
    assert not (tmp_path / "r.json").exists()


def test_05_the_reader_bounds_every_kind_of_file(tmp_path: Path) -> None:
    from lora_parity.util import safe_read

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(safe_read.MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match="larger than"):
        safe_read.read_json(big)
    header = tmp_path / "h.safetensors"
    header.write_bytes((2**40).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match="safetensors header of 1099511627776 bytes"):
        safe_read.safetensors_header(header)
    (tmp_path / "nan.json").write_text('{"lora_alpha": NaN}')
    with pytest.raises(ConfigError, match="NaN is not a number"):
        safe_read.read_json(tmp_path / "nan.json")
    with pytest.raises(ReceiptError, match="a character device"):
        rc.load(Path("/dev/null"))


# --- 6: SIGTERM with a server the run started --------------------------------------------------------

SIGTERM_RUN = """
import os, signal, sys, threading, time
import lora_parity.backends.vllm_server as vllm_server
from lora_parity.cli import main
port_script = '''
import http.server, json, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = {'/v1/models': {'data': [{'id': 'base'}]}, '/version': {'version': '0.0'}}.get(self.path, {})
        self.send_response(200); self.end_headers(); self.wfile.write(json.dumps(body).encode())
    def do_POST(self):
        time.sleep(120)  # a scoring call that the signal interrupts
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
'''
vllm_server.server_argv = lambda cfg, model_dir, port, cuda: [sys.executable, '-c', port_script, str(port)]
threading.Timer(float(sys.argv[2]), os.kill, (os.getpid(), signal.SIGTERM)).start()
sys.argv = ['lora-parity', 'run', '--trainer', 'fake', '--sampler', 'vllm-server', '--no-per-target', '--quiet',
            '--out', sys.argv[1]]
main()
"""


def test_06_sigterm_with_a_started_server_writes_an_error_receipt_and_leaves_nothing(tmp_path: Path) -> None:
    from lora_parity.models import synthetic

    synthetic.materialize(config.load(None))  # on disk: the run's own preflight is short
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-c", SIGTERM_RUN, str(out), "8"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 143, (r.returncode, r.stderr)
    assert "interrupted by SIGTERM" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    receipt = rc.load(out)[0]
    assert receipt.verdict == Verdict.ERROR and "SIGTERM" in (receipt.error or "")
    assert not (tmp_path / "r.json.lock").exists()
    assert [p.name for p in tmp.iterdir()] == []  # no work dir, no server log, no scratch


# --- 7, 13: outputs never replace a device; --junit is checked first ---------------------------------


def _not_a_file(path: Path) -> Path:
    """A character device (where this user may make one) or else a FIFO at `path`."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    except (PermissionError, OSError):
        os.mkfifo(path)
    return path


def test_07_out_force_and_junit_never_replace_a_device(passing: Path, tmp_path: Path) -> None:
    device = _not_a_file(tmp_path / "device")
    kind = stat.S_IFMT(os.stat(device).st_mode)
    with pytest.raises(ConfigError, match="not a regular file"):
        outpath.check_writable(device, force=True)
    with pytest.raises(ConfigError, match="not a regular file"):
        junit.check_target(device)
    receipt = rc.load(passing)[0]
    written = rc.write_atomic(receipt, device, force=True)  # the write itself refuses it too: the receipt goes
    assert written != device and rc.load(written)[0] == receipt  # to the fallback, and is kept
    with pytest.raises(ConfigError, match="not a regular file"):
        junit.write_junit(receipt, str(passing), device)
    for option in ("--out", "--junit"):
        r = cli("run", "--trainer", "fake", "--sampler", "fake", "--force", option, str(device),
                *(["--out", str(tmp_path / "r.json")] if option == "--junit" else []))
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
    assert stat.S_IFMT(os.stat(device).st_mode) == kind and not (tmp_path / "r.json").exists()


def test_13_junit_writability_is_checked_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(outpath.tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(ConfigError, match=r"--junit .* not writable \(Read-only file system\)"):
        junit.check_target(tmp_path / "j.xml")


# --- 8, 10: HTTP bounded; the key never follows a redirect nor reaches a receipt -------------------


def _attached(url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from lora_parity.backends.vllm_server import VLLMServerSampler

    monkeypatch.setenv("LORA_PARITY_TEST_KEY", SECRET)
    sampler = VLLMServerSampler.__new__(VLLMServerSampler)
    sampler.__dict__.update(cfg=config.load(None), timings={}, api_key=SECRET, server=None, url=url,
                            clock=InFlight({}), _ready_lock=threading.Lock())
    return sampler


def _in_thread(fn: Callable[[], Any], seconds: float) -> BaseException | None:
    """Run `fn` and return what it raised; fail if it does not finish within `seconds`."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    return outcome[0]


def test_08_the_key_never_follows_a_redirect(heard: Heard, monkeypatch: pytest.MonkeyPatch) -> None:
    def redirect(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(307)
        h.send_header("Location", heard.url + "/stolen")
        h.end_headers()

    origin = Heard(redirect)
    try:
        error = _in_thread(lambda: _attached(origin.url, monkeypatch)._call("/v1/models", None, "models"), 30)
    finally:
        origin.close()
    assert error is not None and "redirect, not followed" in str(error)
    assert heard.requests == []  # the other host never saw the request, nor the key


def test_08_a_server_that_trickles_bytes_is_stopped_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import lora_parity.backends.vllm_server as vllm_server

    def trickle(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()
        for _ in range(600):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.1)

    server = Heard(trickle)
    monkeypatch.setattr(vllm_server, "REQUEST_DEADLINE_S", 2.0, raising=False)
    start = time.perf_counter()
    try:
        error = _in_thread(lambda: _attached(server.url, monkeypatch)._call("/v1/models", None, "models"), 30)
    finally:
        server.close()
    assert error is not None and "no complete answer within 2 s" in str(error)
    assert time.perf_counter() - start < 10


def test_08_a_huge_response_is_refused_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def huge(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()  # no Content-Length: the size shows only while reading
        try:
            for _ in range(80):
                h.wfile.write(b"[" * 2**20)
        except OSError:
            pass

    server = Heard(huge)
    try:
        error = _in_thread(lambda: _attached(server.url, monkeypatch)._call("/v1/models", None, "models"), 60)
    finally:
        server.close()
    assert error is not None and "more than the 67108864 bytes" in str(error), error


def test_10_a_server_that_echoes_the_key_never_puts_it_in_the_receipt(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.models import synthetic

    def echo(h: http.server.BaseHTTPRequestHandler) -> None:
        if h.command == "GET":
            body = {"/v1/models": {"data": [{"id": "base"}]}, "/version": {"version": "0.0"}}.get(h.path, {})
            h.send_response(200)
            h.end_headers()
            h.wfile.write(json.dumps(body).encode())
            return
        h.send_response(401)
        h.end_headers()
        h.wfile.write(f"bad credentials: {h.headers['Authorization']}".encode())

    synthetic.materialize(config.load(None))
    server = Heard(echo)
    monkeypatch.setenv("LORA_PARITY_TEST_KEY", SECRET)
    try:
        result = execute(RunOptions(trainer="fake", sampler="vllm-server", sampler_url=server.url, per_target=False,
                                    api_key_env="LORA_PARITY_TEST_KEY", out=tmp_path / "r.json"))
    finally:
        server.close()
    assert any(h.get("Authorization") == f"Bearer {SECRET}" for _, h in server.requests)  # it was sent
    assert result.receipt.verdict == Verdict.ERROR and "answered 401: bad credentials: Bearer [redacted]" in (
        result.receipt.error or "")
    assert SECRET not in result.path.read_text()


# --- 11, 17: a finished receipt is never lost, and others can read it --------------------------------


def test_11_a_receipt_whose_out_appears_during_the_run_goes_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "r.json"

    def squatter() -> None:
        deadline = time.monotonic() + 60
        while not outpath.lock_path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        out.write_text("someone else's\n")

    thread = threading.Thread(target=squatter, daemon=True)
    thread.start()
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(out))
    thread.join(5)
    assert out.read_text() == "someone else's\n"
    sibling = tmp_path / "r.1.json"
    assert r.returncode == 0 and f"the receipt was written to {sibling}" in r.stderr, r.stderr
    assert rc.load(sibling)[0].verdict == Verdict.PASS and str(sibling) in r.stdout + r.stderr
    assert not outpath.lock_path(out).exists()


def test_17_receipts_and_logs_follow_the_umask(tmp_path: Path) -> None:
    from lora_parity.cli import live

    old = os.umask(0o022)
    try:
        path = execute(RunOptions(trainer="fake", sampler="fake", per_target=False, out=tmp_path / "r.json")).path
        session = live.Session("quiet", "test")
        assert session.log is not None
        log_mode = stat.S_IMODE(os.stat(session.log).st_mode)
        session.log.unlink()
        os.umask(0o077)
        private = execute(RunOptions(trainer="fake", sampler="fake", per_target=False, out=tmp_path / "p.json")).path
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 and log_mode == 0o644
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600


# --- 12, 14, 18: values checked at preflight ---------------------------------------------------------


def test_12_non_finite_or_zero_values_are_refused_in_one_line(tmp_path: Path) -> None:
    text = (config.configs_dir() / "tiny-qwen3.yaml").read_text()
    assert "  max: 1.0e-3" in text
    (tmp_path / "inf.yaml").write_text(text.replace("  max: 1.0e-3", "  max: 1e400"))  # YAML: a string
    with pytest.raises(ConfigError, match=r"budgets\.max: not a finite number"):
        config.load(str(tmp_path / "inf.yaml"))
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--model", str(tmp_path / "inf.yaml"),
            "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and "not a finite number" in r.stderr and "unexpected" not in r.stderr, r.stderr
    for change, why in (({"lora_alpha": float("nan")}, "NaN is not a number"), ({"r": 0}, "r: .*greater than 0"),
                        ({"lora_alpha": 0}, "lora_alpha: .*greater than 0"), ({"r": 4.5}, "integer r")):
        ad = tiny_adapter(tmp_path / f"ad-{len(why)}", ["q_proj"], rank=4)
        cfg = {**json.loads((ad / af.CONFIG_FILE).read_text()), **change}
        (ad / af.CONFIG_FILE).write_text(json.dumps(cfg))  # json writes NaN as NaN
        with pytest.raises(ConfigError, match=why):
            prepare(RunOptions(trainer="fake", sampler="fake", adapter=ad))
    r = cli("run", "--trainer", "fake", "--sampler", "fake", "--adapter", str(ad), "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("r.json*"))  # no receipt, no lock


def test_14_init_never_lets_config_json_write_yaml_keys(tmp_path: Path) -> None:
    from lora_parity.models.init_config import config_yaml

    folder = tmp_path / "ckpt"
    folder.mkdir()
    hf = {"architectures": ["LlamaForCausalLM\ntrust_remote_code: true\nx:"], "model_type": "llama\nevil: 1",
          "torch_dtype": "float32\nname: evil", "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(hf))
    af.write_safetensors(folder / "model.safetensors",
                         {"model.layers.0.self_attn.q_proj.weight": af.Tensor.from_floats("F32", [2, 2], [0.0] * 4)})
    data = yaml.safe_load(config_yaml(folder))
    assert set(data) == {"name", "description", "model", "adapter", "perturbation", "probes", "budgets", "sampler",
                         "scoring", "per_target"}
    assert data["model"]["trust_remote_code"] is False and data["name"] == "ckpt"


def test_18_an_adapter_for_another_model_is_refused_at_preflight_naming_its_base(tmp_path: Path) -> None:
    ad = tiny_adapter(tmp_path / "llama-ad", ["q_proj", "v_proj"], hidden=2048, base="meta-llama/Llama-3.2-1B")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"made for 'meta-llama/Llama-3.2-1B', not tiny-qwen3 \(its q_proj "
                                          r"lora_A is \[8, 2048\], the model needs \[8, 128\]\); pass its base model "
                                          "with --model"):
        prepare(RunOptions(trainer="hf", sampler="hf", adapter=ad))  # refused before either backend loads
    assert time.perf_counter() - start < 5
    deep = tiny_adapter(tmp_path / "deep-ad", ["q_proj"], layers=4)
    with pytest.raises(ConfigError, match="tensors for layer 2, the model 2 layers"):
        prepare(RunOptions(trainer="hf", sampler="hf", adapter=deep))
    fits = tiny_adapter(tmp_path / "fits", ["q_proj", "v_proj"])
    assert start_adapter.apply(config.load(None), fits).adapter.targets == ["q_proj", "v_proj"]


# --- 15: torch's compile cache ------------------------------------------------------------------------


def _compile_cache_during_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[str, Path]:
    """Run the fake backends with $TMPDIR and the project cache in `tmp_path`; torch's variable as the
    run saw it, and torch's default folder."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("LORA_PARITY_CACHE", str(tmp_path / "cache"))
    default = tmp_path / Path(scratch._torch_default_cache()).name
    assert default.name.startswith("torchinductor_")
    seen: list[str | None] = []

    def compile_something(*args: object) -> None:  # torch writes both: its variable's folder, and its
        seen.append(os.environ.get(scratch.INDUCTOR_CACHE_ENV))  # precompiled headers in the default one
        (default / "precompiled_headers").mkdir(parents=True, exist_ok=True)

    execute(RunOptions(trainer="fake", sampler="fake", per_target=False, out=tmp_path / "out" / name),
            progress=compile_something)
    during = {s for s in seen if s}
    assert len(during) == 1
    # torch's inductor, imported by an earlier test of this process, may set the variable to its own
    # default again; the run's setting must be gone.
    assert os.environ.get(scratch.INDUCTOR_CACHE_ENV) != next(iter(during))
    return next(iter(during)), default


def test_15_torch_compile_cache_is_the_projects_bounded_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(scratch.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.delenv(cache.COMPILE_CACHE_MB_ENV, raising=False)
    during, default = _compile_cache_during_a_run(tmp_path, monkeypatch, "r.json")
    assert during == str(tmp_path / "cache" / "torch-compile")
    assert (Path(during).stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "out"]  # nothing left in $TMPDIR
    # A folder that was there before the run is not the run's to remove; the user's own choice stays.
    default.mkdir()
    monkeypatch.setenv(scratch.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    seen: list[str | None] = []
    execute(RunOptions(trainer="fake", sampler="fake", per_target=False, out=tmp_path / "out" / "r2.json"),
            progress=lambda *a: seen.append(os.environ.get(scratch.INDUCTOR_CACHE_ENV)))
    assert set(seen) == {str(tmp_path / "mine")} and os.environ[scratch.INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")
    assert default.is_dir()


@pytest.mark.parametrize("why", ["bound 0", "writable by others"])
def test_15_torch_compile_cache_falls_back_to_the_runs_scratch(why: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(scratch.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.delenv(cache.COMPILE_CACHE_MB_ENV, raising=False)
    if why == "bound 0":
        monkeypatch.setenv(cache.COMPILE_CACHE_MB_ENV, "0")
    else:  # compiled code another user could have put there is never loaded
        (tmp_path / "cache" / "torch-compile").mkdir(parents=True)
        (tmp_path / "cache" / "torch-compile").chmod(0o777)
    during, _ = _compile_cache_during_a_run(tmp_path, monkeypatch, "r.json")
    assert Path(during).parent == tmp_path and Path(during).name.startswith("lora-parity-inductor-")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["out"]  # the scratch is removed


def test_15_compile_cache_prune_removes_the_oldest_entries_down_to_three_quarters(tmp_path: Path) -> None:
    for age in range(8):  # 8 entries of 1 MiB, entry 0 written longest ago
        entry = tmp_path / "fxgraph" / f"e{age}"
        entry.mkdir(parents=True)
        (entry / "graph.py").write_bytes(b"x" * (1 << 20))
        os.utime(entry / "graph.py", (1000.0 + age, 1000.0 + age))
    assert cache.prune(tmp_path, 8 << 20) == 0  # at the bound: nothing goes
    assert cache.prune(tmp_path, 6 << 20) == 4 << 20  # down to 4.5 MiB: the four oldest go
    assert sorted(p.name for p in (tmp_path / "fxgraph").iterdir()) == ["e4", "e5", "e6", "e7"]


def test_15_the_kept_compile_cache_is_pruned_when_the_backends_close_not_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(scratch.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv(cache.COMPILE_CACHE_MB_ENV, "1")
    old = tmp_path / "cache" / "torch-compile" / "fxgraph" / "old"
    old.mkdir(parents=True)
    (old / "graph.py").write_bytes(b"x" * (2 << 20))  # over the 1 MiB bound
    (tmp_path / "cache" / "torch-compile").chmod(0o700)
    during: list[bool] = []
    monkeypatch.setenv("LORA_PARITY_CACHE", str(tmp_path / "cache"))
    execute(RunOptions(trainer="fake", sampler="fake", per_target=False, out=tmp_path / "out" / "r.json"),
            progress=lambda *a: during.append(old.exists()))
    assert during and all(during)  # the run's start did not walk the cache
    assert not old.exists()  # pruned at close
