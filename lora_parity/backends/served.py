"""What the samplers served over HTTP (`vllm-server`, `sglang`) do alike: check the attach options
before anything loads (`check_options`, `check_reachable`), copy each adapter folder where an attached
server can read it (`shared_dir`), and on close leave nothing behind (unload what this sampler loaded on
an attached server, remove the copies, stop a server it started)."""

from __future__ import annotations

import math
import os
import shutil
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lora_parity.backends import bounded_http, vllm_routes
from lora_parity.backends.base import AdapterHandle, PreflightOptions
from lora_parity.backends.vllm_options import returns_routes
from lora_parity.evidence.receipt import BackendInfo
from lora_parity.models.config import ModelConfig
from lora_parity.models.provenance import redact_secrets, redact_url
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError, ScoreError
from lora_parity.util.escape import one_line

if TYPE_CHECKING:
    from lora_parity.backends.server_process import ServerProcess


EXITED_WAIT_S = 15.0
"""How long a failed call waits to learn whether the server it went to is exiting (sglang 0.5.16 takes
5 s from its scheduler's death to its exit)."""
EXITED_LINES, EXITED_LINE_CHARS = 6, 300
"""How much of a dead server's log its sampler's error quotes: the last lines, each cut to so many characters."""
PREFLIGHT_TIMEOUT_S = 5.0
"""How long an attached server's `/health` may take to answer at preflight."""


SERVER_TEXT_CHARS = 200
"""The most of one string a server returns (a version, an argument) that a receipt keeps."""


def server_text(value: object, api_key: str | None = None) -> str:
    """A string a server returned, as a receipt keeps it: secrets redacted first, then one line of at most
    `SERVER_TEXT_CHARS` (a 64 MiB version string once made the run's own receipt unverifiable)."""
    return one_line(redact_secrets(str(value), api_key))[:SERVER_TEXT_CHARS]


def server_value(value: object, api_key: str | None = None) -> str | int | float | bool | None:
    """A scalar a server returned, as a receipt keeps it: a finite number or a bool as it is, a non-finite one as
    text (NaN in a receipt would make it invalid JSON), a string as `server_text`."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return server_text(value, api_key)


@runtime_checkable
class SettlingSampler(Protocol):
    """A sampler whose way of reading its prefix cache is settled while it scores, after its `info` was taken:
    vllm-server's at its first cached score (by blocks or per position, `vllm_server_cached`), both vLLM samplers'
    count of block requests that read fewer cached tokens than their block."""

    def cached_scoring(self) -> str:
        """The receipt's `sampler.settings.cached_scoring` as it stands now."""
        ...


@runtime_checkable
class SettlingTrainer(Protocol):
    """A trainer whose way of running its forwards is settled while it runs, after its `info` was taken: the HF
    trainer's forwards replayed from CUDA graphs or not (`hf_graphs`)."""

    def settled_settings(self) -> dict[str, str]:
        """Settings to add to (or replace in) the receipt's `trainer.settings`, as they stand now."""
        ...


def settled(backend: object, info: BackendInfo) -> BackendInfo:
    """`info` with what a `SettlingSampler` settled while it scored (its `cached_scoring()`), or a `SettlingTrainer`
    while it ran; others' as it is."""
    if isinstance(backend, SettlingTrainer):
        return info.model_copy(update={"settings": {**info.settings, **backend.settled_settings()}})
    if not isinstance(backend, SettlingSampler) or "cached_scoring" not in info.settings:
        return info
    return info.model_copy(update={"settings": {**info.settings, "cached_scoring": backend.cached_scoring()}})


def check_options(opts: PreflightOptions) -> None:
    """--api-key-env names a set variable; --shared-dir is an existing folder. Raises `ConfigError`."""
    if opts.api_key_env and not os.environ.get(opts.api_key_env):
        raise ConfigError(f"--api-key-env {opts.api_key_env}: that environment variable is not set")
    key = os.environ.get(opts.api_key_env) if opts.api_key_env else None
    if key is not None and (key != key.strip() or any(not c.isprintable() or c.isspace() for c in key)):
        # A pasted key often ends in a newline: the HTTP client would refuse the header and quote the key back.
        raise ConfigError(f"--api-key-env {opts.api_key_env}: the key holds whitespace or control characters "
                          "(a trailing newline?); refusing to send it")
    if opts.shared_dir is not None and not Path(opts.shared_dir).is_dir():
        raise ConfigError(f"--shared-dir {opts.shared_dir}: not an existing folder")


def check_reachable(url: str, engine: str) -> None:
    """`url` is http(s) and its `/health` answers below 400 within `PREFLIGHT_TIMEOUT_S`; `engine` names
    the server in the error ('vLLM server'). Raises `ConfigError`."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(f"--sampler-url {redact_url(url)!r} is not an http(s) URL")
    try:
        answer = bounded_http.request(redact_url(url) + "/health", timeout_s=PREFLIGHT_TIMEOUT_S,
                                      deadline_s=PREFLIGHT_TIMEOUT_S)
    except bounded_http.HTTPCallError as e:
        raise ConfigError(f"cannot reach the {engine} at {redact_url(url)}: {e}") from None
    if answer.status >= 400:
        raise ConfigError(f"{engine} at {redact_url(url)}: /health answered {answer.status}")


class ServedAdapters:
    """Mixed into a served sampler, before `SamplerBackend`; the sampler sets the three attributes and
    defines `retire`."""

    server: ServerProcess | None
    """The server this sampler started (None: attached by URL)."""
    shared_dir: Path | None
    """Folder the attached server can read; adapters are copied there."""
    loaded: set[str]
    """The adapter names this sampler has loaded and not unloaded."""

    def retire(self, handle: AdapterHandle) -> None:
        raise NotImplementedError

    def revive(self) -> str | None:
        """Start again a server this sampler started that has exited since (`ServerProcess.restart`):
        it then holds no adapter. Returns what was done, or None where the server runs or is the user's
        (attached by URL: never started here)."""
        server = self.server
        code = self._exit_code() if server is not None and server.healthy_at is not None else None
        if server is None or code is None:
            return None
        server.restart()
        self.loaded.clear()
        return f"{server.name} had exited with code {code}; started again"

    def exited(self, what: str) -> str:
        """`what` (a call's transport error), with the exit code and the log's last lines where the server
        this sampler started has exited: the cause, not only the refused connection."""
        server, code = self.server, self._exit_code()
        if server is None or code is None:
            return what
        tail = " | ".join(line.strip()[:EXITED_LINE_CHARS] for line in server.log_tail(EXITED_LINES).splitlines()
                          if line.strip())
        return f"{what} ({server.name} exited with code {code}; last lines of its log: {tail})"

    def _exit_code(self) -> int | None:
        """The exit code of the server this sampler started, where it no longer answers and has exited
        (waiting `EXITED_WAIT_S` for that: SGLang takes seconds to exit once its scheduler died); else None."""
        server = self.server
        if server is None or server.proc is None or server.healthy():
            return None
        return server.returncode(EXITED_WAIT_S)

    def _served_path(self, directory: Path) -> Path:
        """Where the server reads the adapter in `directory`: a copy in `shared_dir`, else the folder."""
        if self.shared_dir is None:
            return Path(directory)
        target = self.shared_dir / Path(directory).name
        shutil.copytree(directory, target, dirs_exist_ok=True)
        return target

    def close(self) -> None:
        """Unload what this sampler left on an attached server; stop a started one."""
        if self.server is None:
            for name in sorted(self.loaded):
                try:
                    self.retire(AdapterHandle(name, 0, Path()))
                except ScoreError:
                    break
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
        if self.server is not None:
            self.server.stop()
            self.server = None


ROUTES_FLAG = "--enable-return-routed-experts"
"""The server flag (vLLM 0.26 and SGLang 0.5.16 alike) that makes each scoring request return its routed experts."""


def route_setup(cfg: ModelConfig, model_dir: Path | None, started_here: str | None,
                ask: Callable[[], Any] | None) -> tuple[str | None, dict[str, Any], list[int]]:
    """A served sampler's route replay (docs/moe.md): (why it returns no routes, None where it does; the checkpoint's
    config.json; its MoE layers). `started_here`: why a server started here cannot ('' where it can); `ask`: for an
    attached server, one two-token request, answering its routes or None."""
    config = Path(model_dir) / "config.json" if model_dir is not None else None
    if config is None or not config.is_file() or not returns_routes(cfg, str(model_dir)):
        return "no MoE checkpoint folder here to read the routed layers from", {}, []
    if started_here:
        return started_here, {}, []
    try:
        fields = safe_read.read_json(config)
        layers = vllm_routes.moe_layers(fields)
    except (KeyError, TypeError, ValueError):
        return "the checkpoint's config.json does not give its layers as numbers", {}, []
    if ask is not None:
        try:
            answer = ask()
        except (ScoreError, KeyError, IndexError, TypeError, AttributeError) as e:
            return f"the attached server did not answer a request for routed experts ({one_line(str(e))[:200]})", {}, []
        if answer is None:
            return f"the attached server returns no routed experts (started without {ROUTES_FLAG})", {}, []
    return None, fields, layers

