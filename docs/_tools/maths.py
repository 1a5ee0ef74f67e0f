"""LaTeX in the pages, turned into MathML at build time (latex2mathml): browsers draw MathML themselves, so the
site needs no MathJax or KaTeX and fetches nothing to show an equation. ``$$…$$`` is a display equation, ``$…$``
inline (pandoc's rule: no space inside the dollars, no digit after the closing one); code is left alone."""

from __future__ import annotations

import re

from latex2mathml.converter import convert

# Fenced blocks and inline code spans: never read as maths.
CODE = re.compile(r"^(?P<fence>```|~~~)[^\n]*\n.*?^(?P=fence)[ \t]*$|(?P<ticks>`+)(?:.+?)(?P=ticks)", re.M | re.S)
DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
INLINE = re.compile(r"(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\d$])")
TOKEN = "DIFFATTNMATH{}X"


def to_placeholders(markdown: str) -> tuple[str, dict[str, str]]:
    """The page with each equation replaced by a placeholder Markdown leaves alone, and {placeholder: MathML}."""
    found: dict[str, str] = {}

    def keep(html: str) -> str:
        key = TOKEN.format(len(found))
        found[key] = html
        return key

    def display(m: re.Match) -> str:
        return "\n\n" + keep(convert(m.group(1).strip(), display="block")) + "\n\n"

    def inline(m: re.Match) -> str:
        return keep(convert(m.group(1)))

    out, last = [], 0
    for m in CODE.finditer(markdown):
        out.append(INLINE.sub(inline, DISPLAY.sub(display, markdown[last:m.start()])))
        out.append(m.group(0))
        last = m.end()
    out.append(INLINE.sub(inline, DISPLAY.sub(display, markdown[last:])))
    return "".join(out), found


def restore(html: str, found: dict[str, str]) -> str:
    for key, mathml in found.items():
        html = html.replace(f"<p>{key}</p>", f'<div class="math-display">{mathml}</div>').replace(key, mathml)
    return html
