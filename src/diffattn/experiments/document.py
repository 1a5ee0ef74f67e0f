"""A report document: a list of blocks rendered both as Markdown and as a self-contained HTML page (images
embedded as base64), by :func:`to_markdown` and :func:`to_html`.

Blocks: ``("h", level, text)``, ``("p", text)``, ``("table", header, rows)``, ``("img", filename, caption)``,
``("pre", text)``, ``("list", [item, ...])``. Text in "p" and "list" blocks may use ``**bold**``.

A name that comes from a file or folder (a data file named ``<img src=x onerror=alert(2)>.txt``) goes into a
block's text through :func:`name`: both renderings then show it as it is, as text, never as markup; in code
(``pre``, :func:`code`) it is shown as it is too, with control characters escaped.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from diffattn.system.atomic_files import printable

_NAME = re.compile("\x02(.*?)\x03", re.S)  # a name's marks: control characters, which printable() escapes in it
_MD_PUNCT = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character may be backslash-escaped


def name(text: object) -> str:
    """``text`` (a name from a file or folder) marked for :func:`to_markdown` / :func:`to_html`, which show it as
    text: its Markdown and HTML characters escaped, its control characters too (:func:`printable`)."""
    return "\x02" + printable(text) + "\x03"


def code(text: object) -> str:
    """Inline code (Markdown's backticks) showing ``text`` as it is: delimited by more backticks than it
    holds in a row, so that none of it can end the span; control characters escaped."""
    text = printable(text)
    ticks = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    return f"{ticks} {text} {ticks}"


def _names(text: str, named: Callable[[str], str], rest: Callable[[str], str] = lambda s: s) -> str:
    parts = _NAME.split(text)  # even: our own text, odd: names
    return "".join(named(p) if i % 2 else rest(p) for i, p in enumerate(parts))


def _md(text: str, rest: Callable[[str], str] = lambda s: s) -> str:
    return _names(text, lambda s: _MD_PUNCT.sub(r"\\\1", s), rest)


def _md_cell(x) -> str:
    return _md(str(x), lambda s: s.replace("|", "\\|"))


def markdown_table(header: Sequence, rows: Sequence[Sequence]) -> str:
    """A Markdown table (``|`` in a cell escaped)."""
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows])


def to_markdown(blocks: Sequence[tuple]) -> str:
    out: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + _md(b[2]))
        elif kind == "p":
            out.append(_md(b[1]))
        elif kind == "table":
            out.append(markdown_table(b[1], b[2]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
        elif kind == "pre":
            out.append("```\n" + _names(b[1], str).rstrip("\n") + "\n```")
        elif kind == "list":
            out.extend(f"- {_md(item)}" for item in b[1])
        else:
            raise ValueError(f"unknown report block {kind!r}")
        out.append("")
    return "\n".join(out)


def _html(text: str) -> str:
    """Escaped HTML of a text, names included (their ``*`` as an entity, so that no name can start bold)."""
    return _names(text, lambda s: html.escape(s).replace("*", "&#42;"), html.escape)


def _inline(text: str) -> str:
    """Escaped HTML of a paragraph, with Markdown's ``**bold**`` as <strong>."""
    parts = _html(text).split("**")
    return "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))


def to_html(blocks: Sequence[tuple], folder: Path, title: str) -> str:
    """Self-contained HTML: every image is read from ``folder`` and embedded as a base64 data URI."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}"
        "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:right}th{background:#f3f3f3}"
        "td:first-child,th:first-child{text-align:left}"
        "img{max-width:100%}pre{background:#f6f6f6;padding:0.8em;overflow-x:auto}</style></head><body>",
    ]
    for b in blocks:
        kind = b[0]
        if kind == "h":
            parts.append(f"<h{b[1]}>{_html(b[2])}</h{b[1]}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "list":
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_html(str(h))}</th>" for h in b[1])
            body = "".join(
                "<tr>" + "".join(f"<td>{_html(str(c))}</td>" for c in r) + "</tr>" for r in b[2]
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode((folder / b[1]).read_bytes()).decode("ascii")
            parts.append(
                f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(b[2])}'>"
                f"<figcaption>{html.escape(b[2])}</figcaption></figure>"
            )
        elif kind == "pre":
            parts.append(f"<pre>{html.escape(_names(b[1], str))}</pre>")
        else:
            raise ValueError(f"unknown report block {kind!r}")
    parts.append("</body></html>")
    return "\n".join(parts)
