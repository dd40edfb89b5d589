"""Probe sources (random, text, FILE.jsonl): parsing, line-by-line validation, and the fake-backend run."""

import hashlib
import json
from pathlib import Path

import pytest

from lora_parity.evidence.receipt import ProbeSource, load
from lora_parity.models import config
from lora_parity.run import probes
from lora_parity.util.errors import ConfigError
from lora_parity.verdict.verify import verify

from .conftest import cli

pytestmark = pytest.mark.unit


def _no_tokenizer() -> probes.Tokenize:
    raise AssertionError("a token-id file must not load a tokenizer")


@pytest.mark.parametrize(("ref", "parsed"), [
    ("default", ("random", "default")), ("held-out-x3", ("random", "held-out-x3")), ("random", ("random", "default")),
    ("random:held-out", ("random", "held-out")), ("text", ("text", "default")), ("text:held-out", ("text", "held-out")),
    ("some/dir/p.jsonl", ("file", "some/dir/p.jsonl")),
])
def test_probes_option_is_parsed(ref: str, parsed: tuple[str, str]) -> None:
    assert probes.parse_ref(ref) == parsed


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown probe source 'words'"):
        probes.parse_ref("words:default")


def test_labels_name_the_receipt_file() -> None:
    assert [probes.label(r) for r in ("default", "random:held-out", "text", "text:held-out", "a/b/mine.jsonl")] == \
        ["default", "held-out", "text", "text-held-out", "mine"]


def test_random_source_is_todays_sets_unchanged() -> None:
    spec = config.load(None).probes
    # The digest of the ids the embedded default has always drawn (committed receipts record it).
    assert probes.random_probes(spec, "default", 512).digest == \
        "f35f37f7caddd0d3b367f1c5c9d7f92ac4daa49e5d19e2ada0adfe2f1e7bdbbe"
    x2 = probes.random_probes(spec, "default-x2", 512)
    assert x2.sequences[:2] == probes.random_probes(spec, "default", 512).sequences and len(x2.sequences) == 4
    assert probes.random_probes(spec, "default", 512).source is None
    assert probes.random_probes(spec, "default", 512, record_source=True).source == ProbeSource(kind="random")


def test_text_windows_are_seeded_per_set_and_cut_to_the_lengths() -> None:
    spec = config.load(None).probes
    ids = list(range(1000, 1500))
    source = ProbeSource(kind="text")
    one, again = (probes.text_probes(spec, "default", ids, source) for _ in range(2))
    held = probes.text_probes(spec, "held-out", ids, source)
    assert one == again and one.sequences != held.sequences
    assert [len(s) for s in one.sequences] == [65, 129]
    for s in one.sequences + held.sequences:  # contiguous windows of the text
        assert s == list(range(s[0], s[0] + len(s)))
    with pytest.raises(ConfigError, match="fewer than the longest probe"):
        probes.text_probes(spec, "default", ids[:100], source)


def test_shipped_text_is_small_public_domain_english() -> None:
    text = probes.shipped_text()
    assert 1000 < len(text.encode()) <= 50_000
    assert text.startswith("It is a truth universally acknowledged") and "#" not in text.splitlines()[0]


def test_text_probes_are_refused_for_a_synthetic_checkpoint() -> None:
    cfg = config.load(None)
    with pytest.raises(ConfigError, match="synthetic checkpoint without a tokenizer"):
        probes.make(cfg, "text", lambda: 512)


def test_jsonl_of_token_ids_parses() -> None:
    text = '{"tokens": [1, 2, 3]}\n\n{"tokens": [4, 5]}\n'
    assert probes.parse_jsonl(text, 512, 256, 10, _no_tokenizer) == [[1, 2, 3], [4, 5]]


def test_jsonl_text_lines_use_the_tokenizer() -> None:
    calls = []

    def tokenizer() -> probes.Tokenize:
        calls.append(1)
        return lambda s: [ord(c) for c in s]

    parsed = probes.parse_jsonl('{"text": "abc"}\n{"tokens": [7, 8]}\n', 512, 256, 10, tokenizer)
    assert parsed == [[97, 98, 99], [7, 8]]
    assert calls == [1]


@pytest.mark.parametrize(("body", "message"), [
    ('{"tokens": [1, 2]}\n{"tokens": [1, 512]}\n', "line 2: token id 512 is outside the vocabulary"),
    ('{"tokens": [1, 2]}\n{"tokens": [-1, 2]}\n', "line 2: token id -1 is outside"),
    ('{"tokens": [3]}\n', "line 1: 1 tokens; a probe needs 2 to 8"),
    ('{"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9]}\n', "line 1: 9 tokens; a probe needs 2 to 8"),
    ('{"tokens": [1, 2]}\n\n{"tokens": [1, 2.5]}\n', "line 3: \"tokens\" must be a list of integer ids"),
    ('{"tokens": [true, 2]}\n', "line 1: \"tokens\" must be a list of integer ids"),
    ('{"tokens": [1, 2]\n', "line 1: Expecting"),
    ('[1, 2]\n', "line 1: each line is one object"),
    ('{"tokens": [1, 2], "text": "x"}\n', "line 1: each line is one object"),
    ('{"ids": [1, 2]}\n', "line 1: each line is one object"),
    ('{"text": 5}\n', 'line 1: "text" must be a string'),
    ('{"tokens": [1, 2]}\n' * 4, "line 4: more than 3 sequences"),
    ('\n\n', "no sequences"),
])
def test_every_bad_line_is_named(body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        probes.parse_jsonl(body, 512, 8, 3, _no_tokenizer)


def test_probe_file_records_its_sha256(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [4, 5]}\n{"tokens": [6, 7, 8, 9]}\n')
    p = probes.file_probes(f, 512, 256, 10, lambda: (_no_tokenizer(), "never"))
    assert p.sequences == [[1, 2, 3], [4, 5], [6, 7, 8, 9]] and p.num_scored_positions == 6 and p.set == "mine"
    assert p.source == ProbeSource(kind="file", file_name="mine.jsonl",
                                   file_sha256=hashlib.sha256(f.read_bytes()).hexdigest(), tokenizer=None)


def test_probe_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b'{"tokens": [1, 2]}\n\xff\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        probes.file_probes(f, 512, 256, 10, lambda: (_no_tokenizer(), "never"))


def test_text_line_in_a_file_for_a_synthetic_model_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"tokens": [1, 2]}\n{"text": "hello"}\n')
    with pytest.raises(ConfigError, match=r"line 2: .*synthetic checkpoint without a tokenizer"):
        probes.make(config.load(None), str(f), lambda: 512)


def test_three_line_jsonl_runs_on_the_embedded_default(tmp_path: Path) -> None:
    f = tmp_path / "three.jsonl"
    lines = [[5, 6, 7, 8], [9, 10, 11], [100, 200, 300, 400, 500]]
    f.write_text("".join(json.dumps({"tokens": s}) + "\n" for s in lines))
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--probes", str(f), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    path = Path(json.loads(res.stdout)["receipt"])
    assert path.name.startswith("tiny-qwen3.three__fake__fake__")
    receipt = load(tmp_path / path if not path.is_absolute() else path)[0]
    assert receipt.probes.sequences == lines and receipt.probes.source is not None
    assert receipt.probes.source.kind == "file" and receipt.probes.source.file_name == "three.jsonl"
    assert receipt.breakdown is not None and set(receipt.breakdown) == {"A.trainer_vs_sampler", "C.trainer_vs_sampler"}
    verify(tmp_path / path if not path.is_absolute() else path)


def test_bad_probe_file_exits_2_with_its_line_before_loading(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"tokens": [1, 2]}\n{"tokens": [1, 2]}\n{"tokens": [1, 99999]}\n')
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--probes", str(f), cwd=tmp_path)
    assert res.returncode == 2
    assert "line 3: token id 99999 is outside the vocabulary [0, 512)" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "receipts").exists()


def test_text_probes_on_the_synthetic_default_exit_2_with_one_line(tmp_path: Path) -> None:
    res = cli("run", "--trainer", "fake", "--sampler", "fake", "--probes", "text", cwd=tmp_path)
    assert res.returncode == 2 and "synthetic checkpoint without a tokenizer" in res.stderr
    assert "Traceback" not in res.stderr


def test_random_probes_start_with_the_checkpoints_bos_and_keep_the_rest(tmp_path: Path) -> None:
    from lora_parity.models import synthetic
    from lora_parity.models.checkpoint import bos_token

    spec = config.load(None).probes
    plain = probes.random_probes(spec, "default", 512)
    with_bos = probes.random_probes(spec, "default", 512, bos=7)
    assert [s[0] for s in with_bos.sequences] == [7] * len(plain.sequences)
    assert [s[1:] for s in with_bos.sequences] == [s[1:] for s in plain.sequences]
    assert with_bos.digest != plain.digest

    # A checkpoint by path: its config's bos_token_id, when inside the vocabulary; synthetic: none.
    assert bos_token(config.load(None)) is None
    src = synthetic.materialize(config.load("tiny-qwen3"))
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(src / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    for bos, want in ((3, 3), (None, None), (hf["vocab_size"], None), (True, None)):
        (folder / "config.json").write_text(json.dumps({**hf, "bos_token_id": bos}))
        cfg = config.load(str(folder))
        assert bos_token(cfg) == want, bos
        made = probes.make(cfg, "default", lambda: hf["vocab_size"], lambda cfg=cfg: bos_token(cfg))
        assert all(s[0] == want for s in made.sequences) if want is not None else made.sequences[0][0] != 3
