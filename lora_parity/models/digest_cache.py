"""The checkpoint's weights digest kept between runs, under its files' identity (issue 47: SmolLM2's 270 MB were read
and hashed again by every run, about half a second on the GPU machine).

A record is the sha256 of `checkpoint.weights_digest`, filed under a key made of the folder and, for each
safetensors file, its name, size, inode, device, modification and change times (nanoseconds), as git's index
keys its own file digests. Rewriting a file's bytes changes its change time (which no tool sets back), replacing
it changes its inode: either makes a new key, and the digest is computed again. A record is written only where
no file's identity moved while it was hashed, atomically, in the project's cache folder where this user alone can
write (`cache.private_folder`); elsewhere, or for a record that is not a digest, the digest is computed as before.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from lora_parity.models.checkpoint import weights_digest
from lora_parity.util import cache, safe_read, safe_write
from lora_parity.util.errors import ConfigError

FOLDER = "weights-digests"
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _identity(folder: Path) -> list[object]:
    out: list[object] = [str(folder.resolve())]
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        out.append([path.name, st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _read(record: Path) -> str | None:
    try:
        with safe_read.open_regular(record) as fh:
            value = json.loads(fh.read(1024)).get("sha256")
    except (ConfigError, OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and _DIGEST.fullmatch(value) else None


def known_weights_digest(folder: Path) -> str:
    """`checkpoint.weights_digest(folder)`, from the record of an earlier run where the files are the same ones."""
    folder = Path(folder)
    records = cache.cache_root() / FOLDER
    try:
        before = _identity(folder)
    except OSError:
        return weights_digest(folder)  # its own error says what is missing
    if not cache.private_folder(records):
        return weights_digest(folder)
    record = records / f"{hashlib.sha256(json.dumps(before).encode()).hexdigest()}.json"
    known = _read(record)
    if known is not None:
        return known
    digest = weights_digest(folder)
    try:
        if _identity(folder) == before:  # no file moved while it was read
            safe_write.write_atomic(record, json.dumps({"sha256": digest}))
    except (ConfigError, OSError):
        pass  # the record only saves time
    return digest
