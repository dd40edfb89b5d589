"""The weights digest kept between runs (issue 47): read back only for the very same files, recomputed after any
rewrite, never kept where others can write or where a file moved while it was hashed."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from lora_parity.models import checkpoint, digest_cache

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORA_PARITY_CACHE", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model-1.safetensors").write_bytes(b"a" * 1000)
    (ckpt / "model-2.safetensors").write_bytes(b"b" * 10)
    return ckpt


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    reads: list[Path] = []
    real = checkpoint.weights_digest

    def counted(folder: Path) -> str:
        reads.append(folder)
        return real(folder)

    monkeypatch.setattr(digest_cache, "weights_digest", counted)
    return reads


def test_the_second_run_reads_the_record_not_the_weights(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _count_reads(monkeypatch)
    first = digest_cache.known_weights_digest(folder)
    assert first == checkpoint.weights_digest(folder) and len(reads) == 1
    assert digest_cache.known_weights_digest(folder) == first and len(reads) == 1


def test_a_rewrite_of_the_same_size_and_time_is_hashed_again(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _count_reads(monkeypatch)
    first = digest_cache.known_weights_digest(folder)
    path = folder / "model-1.safetensors"
    st = path.stat()
    time.sleep(0.01)
    path.write_bytes(b"c" * 1000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time set back: the change time moves
    second = digest_cache.known_weights_digest(folder)
    assert second != first and second == checkpoint.weights_digest(folder) and len(reads) == 2


def test_a_cache_others_can_write_is_not_used(folder: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    reads = _count_reads(monkeypatch)
    shared = tmp_path / "cache" / digest_cache.FOLDER
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    digest_cache.known_weights_digest(folder)
    digest_cache.known_weights_digest(folder)
    assert len(reads) == 2 and list(shared.iterdir()) == []


def test_a_record_that_is_not_a_digest_is_ignored(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest_cache.known_weights_digest(folder)
    (record,) = (Path(os.environ["LORA_PARITY_CACHE"]) / digest_cache.FOLDER).iterdir()
    record.write_text('{"sha256": "not a digest"}')
    reads = _count_reads(monkeypatch)
    assert digest_cache.known_weights_digest(folder) == checkpoint.weights_digest(folder) and len(reads) == 1


def test_no_record_where_a_file_moved_while_it_was_hashed(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def rewritten_meanwhile(ckpt: Path) -> str:
        (ckpt / "model-2.safetensors").write_bytes(b"d" * 12)
        return hashlib.sha256(b"whatever").hexdigest()

    monkeypatch.setattr(digest_cache, "weights_digest", rewritten_meanwhile)
    digest_cache.known_weights_digest(folder)
    assert list((Path(os.environ["LORA_PARITY_CACHE"]) / digest_cache.FOLDER).iterdir()) == []


def test_no_weights_is_still_the_digest_s_own_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.util.errors import ConfigError

    monkeypatch.setenv("LORA_PARITY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"no \.safetensors weights"):
        digest_cache.known_weights_digest(tmp_path)
