"""Where a run came from, as a receipt records it: the revision under test, the environment, the
command line (credentials removed) and the model's source; and the credentials a receipt must
never hold (`remember_secret`, `redact_secrets`)."""

from __future__ import annotations

import hashlib
import platform
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lora_parity.evidence.receipt import Environment, Revision
from lora_parity.models.config import ModelConfig

REDACTED = "[redacted]"
_SECRETS: set[str] = set()


def git_revision(explicit: str | None, cwd: Path | None = None) -> Revision:
    """--revision if given, else `git rev-parse HEAD` of the working directory, else unknown."""
    if explicit:
        return Revision(commit=explicit, source="flag")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=cwd, timeout=10)
        if head.returncode != 0:
            return Revision(commit="unknown", source="unknown", reason=head.stderr.strip().splitlines()[-1][:200]
                            if head.stderr.strip() else "git rev-parse failed")
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=cwd, timeout=10)
        return Revision(commit=head.stdout.strip(), source="git", dirty=bool(status.stdout.strip()))
    except (OSError, subprocess.SubprocessError) as e:
        return Revision(commit="unknown", source="unknown", reason=f"git not available: {type(e).__name__}")


def environment(device: str) -> Environment:
    """Python, platform, torch (if loaded), the device, and a digest of the host name."""
    torch_version = sys.modules["torch"].__version__ if "torch" in sys.modules else None
    return Environment(
        python=platform.python_version(),
        platform=f"{platform.system()}-{platform.machine()}",
        torch=torch_version,
        device=device,
        hostname_digest=hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12],
    )


def redact_url(url: str) -> str:
    """A service URL without credentials, query or fragment: what a receipt may record."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def redacted_command(command: Sequence[str], *urls: str | None) -> list[str]:
    """The command line, with the service URLs' credentials removed (None: no such URL) and every absolute
    path cut to its last component (`.../NAME`): a receipt travels, the machine's folders stay behind."""
    out = [_without_machine_path(arg) for arg in command]
    for url in filter(None, urls):
        out = [arg.replace(url, redact_url(url)) for arg in out]
    return out


def _without_machine_path(arg: str) -> str:
    option, sep, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    if value.startswith(("/", "~")) and "://" not in value:
        value = f".../{Path(value).name}"
    return option + sep + value


def source(cfg: ModelConfig) -> str:
    """Where the model's weights come from, as receipts and plans name it: `synthetic:NAME`, a local
    folder's name, `gguf:PACKAGE/FILE`, or `hf:ORG/NAME`."""
    if cfg.model.synthetic:
        return f"synthetic:{cfg.name}"
    if cfg.model.path:
        return Path(cfg.model.path).name
    if cfg.model.gguf:
        return f"gguf:{cfg.model.gguf.package}/{cfg.model.gguf.file}"
    return f"hf:{cfg.model.hf_id}"


def remember_secret(value: str | None) -> None:
    """Keep `value` (an API key the run sends) out of every receipt and message (`redact_secrets`):
    a server's error body may echo the Authorization header it was sent."""
    if value and len(value) >= 4:  # shorter is no secret; replacing it would garble every message
        _SECRETS.add(value)


def redact_secrets(text: str, *values: str | None) -> str:
    """`text` with each remembered secret, and each of `values`, replaced by `[redacted]`: as it is, as JSON
    escapes it and as repr() writes it, and a text that ends in a secret's first 8 or more characters (a body cut
    before it reached here) loses that tail too."""
    import json

    for secret in sorted(_SECRETS | {v for v in values if v and len(v) >= 4}, key=len, reverse=True):
        for form in dict.fromkeys((secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1],
                                   repr(secret)[1:-1])):
            text = text.replace(form, REDACTED)
        for cut in range(len(secret) - 1, 7, -1):  # 8 characters at least: shorter tails are ordinary words
            if text.endswith(secret[:cut]):
                text = text[:-cut] + REDACTED
                break
    return text


def scrub_secrets(value: Any) -> Any:
    """`value` (a string, a pydantic model, or lists and dicts of them) with every remembered secret
    redacted in its strings; `value` itself when there is none."""
    if not _SECRETS:
        return value
    if isinstance(value, str):
        return redact_secrets(value)
    if isinstance(value, BaseModel):
        return type(value).model_validate(scrub_secrets(value.model_dump()))
    if isinstance(value, list):
        return [scrub_secrets(v) for v in value]
    if isinstance(value, dict):
        return {k: scrub_secrets(v) for k, v in value.items()}
    return value
