"""A report document: a list of blocks rendered both as Markdown and as a self-contained HTML page (images
embedded as base64), by :func:`to_markdown` and :func:`to_html`.

Blocks: ``("h", level, text)``, ``("p", text)``, ``("table", header, rows)``, ``("img", filename, caption)``,
``("pre", text)``, ``("list", [item, ...])``. Text in "p" and "list" blocks may use ``**bold**``.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path


def _md_cell(x) -> str:
    return str(x).replace("|", "\\|")


def markdown_table(header: Sequence, rows: Sequence[Sequence]) -> str:
    """A Markdown table (``|`` in a cell escaped)."""
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows])


def to_markdown(blocks: Sequence[tuple]) -> str:
    out: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + b[2])
        elif kind == "p":
            out.append(b[1])
        elif kind == "table":
            out.append(markdown_table(b[1], b[2]))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
        elif kind == "pre":
            out.append("```\n" + b[1].rstrip("\n") + "\n```")
        elif kind == "list":
            out.extend(f"- {item}" for item in b[1])
        else:
            raise ValueError(f"unknown report block {kind!r}")
        out.append("")
    return "\n".join(out)


def _inline(text: str) -> str:
    """Escaped HTML of a paragraph, with Markdown's ``**bold**`` as <strong>."""
    parts = html.escape(text).split("**")
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
            parts.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "list":
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(str(h))}</th>" for h in b[1])
            body = "".join(
                "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in b[2]
            )
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode((folder / b[1]).read_bytes()).decode("ascii")
            parts.append(
                f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(b[2])}'>"
                f"<figcaption>{html.escape(b[2])}</figcaption></figure>"
            )
        elif kind == "pre":
            parts.append(f"<pre>{html.escape(b[1])}</pre>")
        else:
            raise ValueError(f"unknown report block {kind!r}")
    parts.append("</body></html>")
    return "\n".join(parts)
