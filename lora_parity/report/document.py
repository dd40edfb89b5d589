"""A tiny document model (headings, paragraphs, bullets, tables, images, collapsed sections) and
its renderers: GitHub markdown, plain text and HTML. The JSON renderings are plain data built by the
report and the diff themselves. Number formatting shared by every rendering lives here too.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lora_parity.util import escape
from lora_parity.util.errors import ConfigError


def check_format(fmt: str, allowed: Sequence[str]) -> str:
    """`fmt` if it is one of `allowed`, else a `ConfigError` naming them."""
    if fmt not in allowed:
        raise ConfigError(f"unknown format {fmt!r}; choose from {', '.join(allowed)}")
    return fmt


# --- numbers ---------------------------------------------------------------------------------------


def fmt_num(x: float | None) -> str:
    """Three significant digits; '—' for a missing value."""
    if x is None:
        return "—"
    return "0" if x == 0 else f"{x:.3g}"


def fmt_signed(x: float) -> str:
    """Three significant digits with a sign."""
    return "0" if x == 0 else f"{x:+.3g}"


def fmt_budget(x: float | str | dict[str, Any]) -> str:
    """A budget or setting as written in the config ('0.0001', '1e-06'); a string (the budget profile) as is;
    a group of budgets (c_relative, a_triangulation) as '{factor 2, floor 0.02}'."""
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k} {fmt_budget(v)}" for k, v in x.items() if v is not None) + "}"
    return x if isinstance(x, str) else f"{x:g}"


def clip(text: str, limit: int = 100) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- blocks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heading:
    """A section title; level 2 is the document's title."""

    text: str
    level: int = 3


@dataclass(frozen=True)
class Para:
    """Text with `**bold**` and `code` markup (receipt strings only ever go into code spans)."""

    text: str


@dataclass(frozen=True)
class Bullets:
    """A bulleted list; items carry the same markup as `Para`."""

    items: list[str]


@dataclass(frozen=True)
class Table:
    """Plain-text cells; the markdown renderer escapes them."""

    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Image:
    """An image link with its alt text."""

    alt: str
    link: str


@dataclass(frozen=True)
class Details:
    """Collapsed in markdown, a plain section in text."""

    summary: str
    blocks: list[Block]


Block = Heading | Para | Bullets | Table | Image | Details


def code(text: object) -> str:
    """A string from a receipt as an inline code span: one line, no backticks (`escape.code`)."""
    return escape.code(text)


# --- markdown --------------------------------------------------------------------------------------


def _md_link(link: str) -> str:
    return escape.one_line(link).replace(" ", "%20").replace("(", "%28").replace(")", "%29").replace("<", "%3C")


def _md_table(table: Table) -> str:
    cell = escape.markdown
    lines = ["| " + " | ".join(cell(h) for h in table.header) + " |", "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def _md_block(b: Block) -> str:
    if isinstance(b, Heading):
        return f"{'#' * b.level} {escape.markdown(b.text)}"
    if isinstance(b, Para):
        return escape.markdown_markup(b.text)
    if isinstance(b, Bullets):
        return "\n".join(f"- {escape.markdown_markup(item)}" for item in b.items)
    if isinstance(b, Table):
        return _md_table(b)
    if isinstance(b, Image):
        return f"![{escape.markdown(b.alt)}]({_md_link(b.link)})"
    # An HTML block: its summary is HTML, not markdown.
    return f"<details><summary>{escape.html(b.summary)}</summary>\n\n{render_markdown(b.blocks)}\n</details>"


def render_markdown(blocks: Sequence[Block]) -> str:
    """GitHub-flavoured markdown; every string passes through `lora_parity.util.escape`."""
    return "\n\n".join(_md_block(b) for b in blocks) + "\n"


# --- plain text ------------------------------------------------------------------------------------


def _plain(text: str) -> str:
    return escape.one_line(text.replace("**", "").replace("`", ""))


def _text_table(table: Table) -> str:
    rows = [[escape.one_line(c) for c in r] for r in (table.header, *table.rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(table.header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _text_block(b: Block) -> str:
    if isinstance(b, Heading):
        text = escape.one_line(b.text)
        return f"{text}\n{('=' if b.level <= 2 else '-') * len(text)}"
    if isinstance(b, Para):
        return _plain(b.text)
    if isinstance(b, Bullets):
        return "\n".join(f"- {_plain(item)}" for item in b.items)
    if isinstance(b, Table):
        return _text_table(b)
    if isinstance(b, Image):
        return f"plot: {escape.one_line(b.alt)}: {escape.one_line(b.link)}"
    return render_text([Heading(b.summary, 4), *b.blocks]).rstrip("\n")


def render_text(blocks: Sequence[Block]) -> str:
    """Plain text with aligned columns, for a terminal or a log."""
    return "\n\n".join(_text_block(b) for b in blocks) + "\n"


# --- HTML ------------------------------------------------------------------------------------------

_HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px;"
    "text-align:left;vertical-align:top}th{background:#f3f3f3}code{background:#f3f3f3;padding:0 3px}"
    "img{max-width:100%;display:block;margin:0.5em 0}details{margin:1em 0}"
)


def _html_inline(text: str) -> str:
    """`Para` markup as HTML: everything escaped, then `code` spans and **bold**."""
    parts = html.escape(escape.one_line(text), quote=False).split("`")
    out = [f"<code>{p}</code>" if i % 2 else re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", p)
           for i, p in enumerate(parts)]
    return "".join(out)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{escape.html(h)}</th>" for h in table.header)
    rows = "".join("<tr>" + "".join(f"<td>{escape.html(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _html_block(b: Block) -> str:
    if isinstance(b, Heading):
        return f"<h{b.level}>{escape.html(b.text)}</h{b.level}>"
    if isinstance(b, Para):
        return f"<p>{_html_inline(b.text)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        return _html_table(b)
    if isinstance(b, Image):
        return f'<img alt="{escape.html(b.alt)}" src="{escape.html(b.link)}">'
    inner = "\n".join(_html_block(x) for x in b.blocks)
    return f"<details><summary>{escape.html(b.summary)}</summary>\n{inner}\n</details>"


def render_html(blocks: Sequence[Block], title: str) -> str:
    """One self-contained HTML page (inline style; images are whatever their links say, e.g. data: URIs)."""
    body = "\n".join(_html_block(b) for b in blocks)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape.html(title)}</title>'
            f"<style>{_HTML_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")
