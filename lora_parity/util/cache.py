"""The project's own cache folder (`cache_root`: built checkpoints, torch's compile cache) and the
bound that keeps the compile cache from growing without end (`prune`).

torch's compile cache holds compiled code that torch loads back, so it lives only in a folder of
this user's that no one else can write (`private_folder`); any other is not used.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

CACHE_ENV = "LORA_PARITY_CACHE"
COMPILE_CACHE_MB_ENV = "LORA_PARITY_COMPILE_CACHE_MB"
DEFAULT_COMPILE_CACHE_MB = 1024
"""About seven CPU runs' worth (a run adds up to 150 MB); past the bound the entries written longest
ago go first, down to three quarters of it."""


def cache_root() -> Path:
    """`LORA_PARITY_CACHE`, else ~/.cache/lora-parity."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lora-parity"


def compile_cache_bound() -> int:
    """The compile cache's bound in bytes: `LORA_PARITY_COMPILE_CACHE_MB` (0 turns the cache off:
    every run then compiles into its scratch folder), else `DEFAULT_COMPILE_CACHE_MB`. A value that is
    not a whole number of megabytes keeps the default."""
    raw = os.environ.get(COMPILE_CACHE_MB_ENV, "").strip()
    megabytes = int(raw) if raw.isdigit() else DEFAULT_COMPILE_CACHE_MB
    return megabytes * 1024 * 1024


def private_folder(path: Path) -> bool:
    """Make `path` (mode 0700) where it is missing; whether it is a real folder (not a link) owned by
    this user that neither its group nor others can write."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _entries(folder: Path) -> list[tuple[float, int, Path]]:
    """(newest mtime, size in bytes, path) of each entry two levels down (torch's cache keeps one
    folder per kind: fxgraph, triton, aotautograd, ...; below it one entry per compiled graph or
    kernel), and of loose files one level down."""
    found = []
    for kind in _scan(folder):
        if kind.is_dir(follow_symlinks=False):
            found += [_measure(Path(e.path)) for e in _scan(Path(kind.path))]
        else:
            found.append(_measure(Path(kind.path)))
    return found


def _scan(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def _measure(path: Path) -> tuple[float, int, Path]:
    newest, size = 0.0, 0
    try:
        st = path.lstat()
    except OSError:
        return newest, size, path
    if not stat.S_ISDIR(st.st_mode):
        return st.st_mtime, st.st_size, path
    # A folder: the bytes of its files, as old as the newest of them (its own mtime changes with any entry).
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                fst = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest, size = max(newest, fst.st_mtime), size + fst.st_size
    return newest or st.st_mtime, size, path


def prune(folder: Path, bound: int) -> int:
    """Remove the entries of `folder` written longest ago until it holds at most three quarters of
    `bound` bytes, where it holds more than `bound`; return the bytes removed."""
    entries = _entries(folder)
    total = sum(size for _, size, _ in entries)
    if total <= bound:
        return 0
    removed = 0
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total - removed <= bound * 3 // 4:
            break
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed += size
    return removed
