"""What an attached server says lands in receipts only bounded, finite, on one line and without the key, and the
output writer writes a regular file or nothing (issue 46: hostile JSON, NaN, huge strings, echoed keys in every
form, whatever sits at an output path). `make fuzz` runs it with many examples."""

import json
import math
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_parity.backends import served
from lora_parity.backends.sglang import SERVER_ARGS_RECORDED, SGLangSampler
from lora_parity.models.provenance import redact_secrets, remember_secret

pytestmark = pytest.mark.unit
EXAMPLES = int(os.environ.get("LORA_PARITY_FUZZ_EXAMPLES", "300"))
KEY = "sk-fuzz-0123456789abcdef"
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=3000))


def _echoes(key: str) -> st.SearchStrategy[str]:
    """The key as a server could echo it: raw, JSON-escaped, repr-escaped, or a body cut inside it."""
    forms = [key, json.dumps(key)[1:-1], repr(key)[1:-1]]
    return st.one_of(st.sampled_from(forms), st.integers(8, len(key) - 1).map(lambda n: key[:n]))


@settings(max_examples=EXAMPLES, deadline=None)
@given(before=st.text(max_size=200), echo=_echoes(KEY), after=st.text(max_size=200), cut=st.booleans())
def test_an_echoed_key_never_survives_redaction(before: str, echo: str, after: str, cut: bool) -> None:
    text = before + echo + ("" if cut or len(echo) < len(KEY) else after)
    assert KEY[:8] not in served.server_text(text, KEY) or KEY[:8] in before + after
    assert KEY not in redact_secrets(text, KEY)


@settings(max_examples=EXAMPLES, deadline=None)
@given(value=SCALARS)
def test_a_server_scalar_is_finite_bounded_and_json_safe(value: Any) -> None:
    kept = served.server_value(value, KEY)
    json.dumps(kept, allow_nan=False)  # never NaN or Infinity in a receipt
    if isinstance(kept, str):
        assert len(kept) <= served.SERVER_TEXT_CHARS and "\n" not in kept
    if isinstance(value, float) and math.isfinite(value):
        assert kept == value


@settings(max_examples=EXAMPLES, deadline=None)
@given(answer=st.one_of(st.dictionaries(st.sampled_from([*SERVER_ARGS_RECORDED, "version", "api_key", "x"]),
                                        SCALARS, max_size=8),
                        st.lists(SCALARS, max_size=3), SCALARS))
def test_server_info_of_any_shape_becomes_recordable_settings(answer: Any) -> None:
    remember_secret(KEY)
    sampler = SGLangSampler.__new__(SGLangSampler)  # only what `_recorded_server_args` reads
    sampler._server_info, sampler.api_key = None, KEY
    sampler._info = lambda name: answer  # type: ignore[method-assign]
    recorded = sampler._recorded_server_args()
    text = json.dumps(recorded, allow_nan=False)
    assert len(recorded["version"]) <= served.SERVER_TEXT_CHARS and KEY not in text
    assert set(recorded["args"]) <= set(SERVER_ARGS_RECORDED)  # never the server's api_key field


@settings(max_examples=max(20, EXAMPLES // 10), deadline=None)
@given(kind=st.sampled_from(["none", "file", "link", "dangling", "fifo", "folder"]), data=st.binary(max_size=4096))
def test_the_output_writer_writes_a_regular_file_or_nothing(kind: str, data: bytes) -> None:
    """`util.safe_write`: whatever sits at the path, the result is the data in a regular file, or a ConfigError
    with what was there untouched; no temporary is left behind."""
    import tempfile
    from pathlib import Path

    from lora_parity.util import safe_write
    from lora_parity.util.errors import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path, other = folder / "out", folder / "other"
        other.write_bytes(b"keep")
        {"none": lambda: None, "file": lambda: path.write_bytes(b"old"), "link": lambda: path.symlink_to(other),
         "dangling": lambda: path.symlink_to(folder / "nowhere"), "fifo": lambda: os.mkfifo(path),
         "folder": lambda: path.mkdir()}[kind]()
        try:
            safe_write.write_atomic(path, data)
        except ConfigError:
            assert kind in ("link", "dangling", "fifo", "folder") and other.read_bytes() == b"keep"
            assert not (folder / "nowhere").exists()
        else:
            assert kind in ("none", "file") and path.read_bytes() == data and not path.is_symlink()
        assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
