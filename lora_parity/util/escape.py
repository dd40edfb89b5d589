"""The one escaping layer: every string a receipt (or a config, a server, an error) brings passes here
before it reaches markdown, a terminal or XML.

A receipt may come from someone the reader does not trust, so its strings are data, never markup:

- `one_line`: no terminal escape sequence, control, bidi-override or lone-surrogate character, and
  whitespace collapsed to single spaces (no line a receipt could start). Every other function builds on it.
- `markdown`: plain text in GitHub markdown (a heading, a table cell, alt text): markdown's inline
  punctuation backslash-escaped, a `<` or `&` that could open a tag or an entity as an entity (no raw
  HTML, no comment, no image, no link), a zero-width space inside a bare `https://` or `www.` (no autolink),
  and a zero-width joiner after `@`, so a name never mentions anyone.
- `code`: a string inside markup as an inline code span (one line, no backtick, no `<` that reads as a
  tag to a scanner of the raw text); plain text and HTML renderers show the same characters.
- `terminal`: text for a terminal, lines kept; `rich`: one line inside rich markup, `[markup]` escaped.
- `html`: text or an attribute value in HTML, entities escaped.
- `xml`: text or an attribute value that XML 1.0 accepts (ElementTree escapes `<`, `&` and quotes).
"""

from __future__ import annotations

import html as _html
import re

from rich.markup import escape as _rich_escape

# ESC sequences (CSI with parameters, OSC up to its terminator, and two-character ones) and C1's CSI.
_SEQUENCES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]|\x9b[0-?]*[ -/]*[@-~]")
# C0 and C1 controls, DEL, lone surrogates, bidi overrides and isolates (Trojan Source), non-characters.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ufffe\uffff]")
_WHITESPACE_CONTROLS = "\t\n\r\x0b\x0c"
REPLACEMENT = "\ufffd"
"""What an unsafe character becomes: visible, so a reader sees that something was there."""
# Markdown's inline punctuation; `_` only where it could open or close emphasis (not inside a word, so
# check ids stay readable in the raw text).
_MD_PUNCTUATION = re.compile(r"([\\`*\[\]|~#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_BOLD = re.compile(r"\\\*\\\*(.+?)\\\*\\\*")
_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # a `<` that could open a tag, a comment or an autolink
_ENTITY_START = re.compile(r"&(?=[#A-Za-z])")
ZWJ = "\u200d"
ZWSP = "\u200b"
_AUTOLINK = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*:)(//)|\b(www)(\.)")
"""What GitHub links in plain text: a scheme's `://` and a `www.`."""


def _scrub(text: object, keep: str) -> str:
    def replace(m: re.Match[str]) -> str:
        ch = m.group()
        return ch if ch in keep else " " if ch in _WHITESPACE_CONTROLS else REPLACEMENT

    return _UNSAFE.sub(replace, _SEQUENCES.sub("", str(text)))


def one_line(text: object) -> str:
    """`text` as one line of printable characters (see the module docstring)."""
    return " ".join(_scrub(text, "").split())


def terminal(text: object) -> str:
    """`text` safe to print on a terminal: escape sequences dropped, controls but newline and tab replaced."""
    return _scrub(text, "\n\t")


def rich(text: object) -> str:
    """One line for a rich console, table cell or title: as `terminal`, every control (newline too)
    replaced, spacing kept (padding stays aligned), and rich markup escaped."""
    return _rich_escape(_scrub(text, ""))


def _markdown(line: str) -> str:
    escaped = _TAG_START.sub("&lt;", _ENTITY_START.sub("&amp;", _MD_PUNCTUATION.sub(r"\\\1", line)))
    # GitHub links a bare `https://...` or `www....` in plain text: a zero-width space breaks the pattern.
    escaped = _AUTOLINK.sub(lambda m: (m.group(1) or m.group(3)) + ZWSP + (m.group(2) or m.group(4)), escaped)
    return escaped.replace("@", "@" + ZWJ)


def markdown(text: object) -> str:
    """Plain text as GitHub markdown that renders exactly as the text (see the module docstring)."""
    return _markdown(one_line(text))


def markdown_markup(text: str) -> str:
    """The report's inline markup (`code` spans and `**bold**`) as markdown: code spans re-guarded,
    everything else escaped but the bold, so a string that missed `code` still renders as plain text."""
    parts = one_line(text).split("`")
    return "".join(code(p) if i % 2 else _BOLD.sub(r"**\1**", _markdown(p)) for i, p in enumerate(parts))


def code(text: object) -> str:
    """A string inside markup as an inline code span: one line, backticks as quotes, and a zero-width
    space after a `<` that would open a tag or comment (`<!--`), so even the raw text holds none."""
    return "`" + _TAG_START.sub("<" + ZWSP, one_line(text).replace("`", "'")) + "`"


def xml(text: object) -> str:
    """Text or an attribute value that XML 1.0 accepts: one line, no control character."""
    return one_line(text)


def html(text: object) -> str:
    """Text or an attribute value in HTML: one line, `<`, `>`, `&` and quotes as entities."""
    return _html.escape(one_line(text))
