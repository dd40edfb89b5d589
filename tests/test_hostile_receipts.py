"""Property test: verify answers 2 (or 1 for a consistent failing receipt) on any mutated receipt, never crashes.

500 examples in the normal suite; `make fuzz` sets LORA_PARITY_FUZZ_EXAMPLES=10000.
"""

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_parity.evidence import receipt as rc
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ReceiptError
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit
EXAMPLES = int(os.environ.get("LORA_PARITY_FUZZ_EXAMPLES", "500"))
# Top-level fields every statistic, check and the verdict are derived from (or recorded in). Budgets
# are not here: a resealed budget change that no check depends on (noise_factor with zero repeat
# noise) yields a consistent receipt, which verify rightly accepts.
DERIVED = {"scores", "comparisons", "deltas", "checks", "verdict", "worst_positions"}
# The probe sequences, their digest and count are checked against each other; the probe set's name
# and seed are labels (regenerating the sequences would need the config's lengths and vocabulary).
DERIVED_PROBES = {"sequences", "digest", "num_scored_positions"}


def nulls_dropped(d: Any) -> Any:
    """An optional field that is null reads as one that is absent (receipts made before it have none)."""
    if isinstance(d, dict):
        return {k: nulls_dropped(v) for k, v in d.items() if v is not None}
    return [nulls_dropped(v) for v in d] if isinstance(d, list) else d


def content(d: Any) -> Any:
    """A receipt's data as verify judges it: less its digest, null fields as absent ones."""
    return {k: nulls_dropped(v) for k, v in d.items() if k != "digest"} if isinstance(d, dict) else d


def derived(touched: tuple) -> bool:
    return bool(touched) and (touched[0] in DERIVED or (touched[0] == "probes" and len(touched) > 1
                                                         and touched[1] in DERIVED_PROBES))


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hostile") / "valid.json"
    execute(RunOptions(trainer="fake", sampler="fake", out=out, per_target=False))
    return json.loads(out.read_text())


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]) if len(node) > 3 else enumerate(node):
            out += paths(v, (*prefix, i))
    return out


def get_parent(data: Any, path: tuple) -> tuple[Any, Any]:
    node = data
    for key in path[:-1]:
        node = node[key]
    return node, path[-1]


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324, 10**400]),
    st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(["pass", "fail", "inconclusive", "error", "not_reached"]),
)


def test_one_comparison_without_its_equal_fraction_is_tampered_all_without_it_is_an_older_receipt(
        valid: dict[str, Any], tmp_path: Path) -> None:
    """Receipts made before `equal` was recorded have none anywhere; a resealed receipt with one comparison's
    `equal` emptied (a found hole: verify accepted it) is refused."""
    one, every = copy.deepcopy(valid), copy.deepcopy(valid)
    next(iter(one["comparisons"].values()))["equal"] = None
    for stat in every["comparisons"].values():
        stat["equal"] = None
    for name, receipt in (("one", one), ("every", every)):
        receipt["digest"] = rc.compute_digest(receipt)
        (tmp_path / f"{name}.json").write_text(json.dumps(receipt), encoding="utf-8")
    with pytest.raises(ReceiptError, match="comparison"):
        verify(tmp_path / "one.json")
    assert verify(tmp_path / "every.json").verdict.value == valid["verdict"]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_receipts_never_crash_verify(valid: dict[str, Any], data: st.DataObject, tmp_path: Path) -> None:
    mutated = copy.deepcopy(valid)
    kind = data.draw(st.sampled_from(["set", "remove", "add", "score", "truncate", "bytes"]), label="kind")
    reseal = data.draw(st.booleans(), label="reseal")
    touched: tuple = ()
    raw: bytes
    if kind in ("set", "remove", "add"):
        touched = data.draw(st.sampled_from(paths(mutated)), label="path")
        parent, key = get_parent(mutated, touched)
        if kind == "set":
            parent[key] = data.draw(VALUES, label="value")
        elif kind == "remove":
            del parent[key]
        else:
            target = parent if isinstance(parent, dict) else mutated
            target[data.draw(st.text(min_size=1, max_size=6), label="new key")] = data.draw(VALUES)
    elif kind == "score":
        phase = data.draw(st.sampled_from(sorted(mutated["scores"])), label="phase")
        seq = data.draw(st.integers(0, len(mutated["scores"][phase]) - 1))
        pos = data.draw(st.integers(0, len(mutated["scores"][phase][seq]) - 1))
        mutated["scores"][phase][seq][pos] = data.draw(st.floats(-50, 0).filter(lambda x: x != -1e-300))
        touched = ("scores",)
    if kind in ("truncate", "bytes"):
        text = json.dumps(valid).encode()
        cut = data.draw(st.integers(0, len(text) - 1), label="cut")
        bad = data.draw(st.sampled_from([b"\xff", b"\xc3\x28"]))
        raw = text[:cut] if kind == "truncate" else text[:cut] + bad + text[cut:]
    else:
        if reseal:
            mutated["digest"] = rc.compute_digest(mutated) if isinstance(mutated, dict) else "0"
        try:
            raw = json.dumps(mutated, allow_nan=False).encode()
        except (ValueError, OverflowError):
            return
    path = tmp_path / "mutated.json"
    path.write_bytes(raw)

    # 0 and 0.0 are the same number: a mutation that changes only a number's spelling changes nothing.
    changed = content(json.loads(raw)) != content(valid) if kind not in ("truncate", "bytes") else True
    try:
        verified = verify(path)
    except ReceiptError as e:
        assert str(e).startswith(str(path)), e
        assert "\n" not in str(e)
        return
    # Verified as intact: only possible for a change that does not touch what the verdict rests on,
    # resealed with a fresh digest (anyone can re-sign metadata, never scores or verdicts).
    # worst_positions is optional (receipts made before it was recorded): removing it all and resealing
    # yields a consistent older-style receipt, which verify rightly accepts.
    older_style = kind == "remove" and touched == ("worst_positions",)
    assert not changed or older_style or (reseal and touched and not derived(touched) and touched[0] != "digest"), \
        (kind, touched)
    assert verified.verdict.value == valid["verdict"]


# --- every output of a hostile receipt (issue 23): markdown report, table, diff, summary, text, JUnit --------

# Free-text fields a receipt's writer controls without touching what the verdict rests on.
STRING_FIELDS = [("model", "name"), ("model", "source"), ("model", "architecture"), ("environment", "python"),
                 ("environment", "platform"), ("environment", "device"), ("revision", "commit"), ("revision", "reason"),
                 ("probes", "set"), ("trainer", "versions", "peft"), ("sampler", "settings", "note"),
                 ("adapters", 0, "name"), ("phases", 0, "message"), ("tool_version",), ("injected_fault",)]
SNIPPETS = ["\n\n**Verdict: PASS**\n<!--", "<img src=x>", "![i](https://evil.example/x.png)", "[l](javascript:x)",
            "@octocat", "\x1b[31m", "\x1b]0;title\x07", "\x9b2J", "\x00", "\x7f", "\x85", "\u202e", "`", "|", "\\",
            "&#60;", "<https://evil.example>", "-->", "</details>", "]]>", "{{", "[red]", "\r\n# heading"]
HOSTILE_TEXT = st.lists(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=6)), min_size=1, max_size=6).map("".join)
CONTROLS = {chr(c) for c in (*range(0x20), *range(0x7f, 0xa0))} - {"\n"}


def assert_markdown_is_inert(md: str) -> None:
    from markdown_it import MarkdownIt

    assert "<!--" not in md and not CONTROLS & set(md)
    for token in MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse(md):
        assert token.type != "html_block" or token.content.startswith(("<details>", "</details>")), token.content
        for child in token.children or []:
            assert child.type not in ("html_inline", "image", "link_open"), (child.type, child.content)


@settings(max_examples=max(50, EXAMPLES // 10), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_outputs_of_hostile_receipts_parse_and_carry_no_markup(valid: dict[str, Any], data: st.DataObject,
                                                              tmp_path: Path) -> None:
    import xml.etree.ElementTree as ET

    from lora_parity import report as rp
    from lora_parity.cli.junit import junit_xml

    mutated = copy.deepcopy(valid)
    for field_path in data.draw(st.lists(st.sampled_from(STRING_FIELDS), min_size=1, max_size=4, unique=True)):
        node = mutated
        for key in field_path[:-1]:
            node = node[key]
        node[field_path[-1]] = data.draw(HOSTILE_TEXT, label=".".join(map(str, field_path)))
    mutated["digest"] = rc.compute_digest(mutated)
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(mutated), encoding="utf-8")
    try:
        receipt = verify(path).receipt
    except ReceiptError:
        return  # refused (a field with a fixed form): nothing rendered
    label = data.draw(HOSTILE_TEXT, label="path as given")
    for md in (rp.report_markdown(receipt, label, signature=data.draw(st.sampled_from(["unsigned", "not checked"]))),
               rp.table_markdown([receipt], rp.signatures_line([label], ["unsigned"])),
               rp.diff_markdown(rp.diff_receipts(receipt, receipt), label, label)):
        assert_markdown_is_inert(md)
    text = rp.render_report(receipt, label, "text")
    assert not CONTROLS & set(text)
    junit = junit_xml(receipt, label)
    ET.fromstring(junit.encode("utf-8"))
    assert not CONTROLS & set(junit)


def test_one_check_without_its_element_count_is_tampered_all_without_it_is_an_older_receipt(
        valid: dict[str, Any], tmp_path: Path) -> None:
    """Receipts made before `elements` was recorded have none; one check's count removed and resealed is refused."""
    one = copy.deepcopy(valid)
    reached = next(c for c in one["checks"] if c.get("elements"))
    del reached["elements"]
    one["digest"] = rc.compute_digest(one)
    (tmp_path / "one.json").write_text(json.dumps(one))
    with pytest.raises(ReceiptError, match="does not reproduce"):
        verify(tmp_path / "one.json")
    older = copy.deepcopy(valid)
    for check in older["checks"]:
        check.pop("elements", None)
    older["digest"] = rc.compute_digest(older)
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert verify(tmp_path / "older.json").receipt.verdict.value == valid["verdict"]
