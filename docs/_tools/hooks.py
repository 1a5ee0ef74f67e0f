"""MkDocs hooks (mkdocs.yml `hooks:`): what the site generates and what it checks at build time.

- The nav: an entry ending in `?` is a page another change is adding (listed where it will be, dropped until its
  file exists); an entry with `*` lists every matching page the nav does not name elsewhere (a new results folder
  or how-to shows up without an edit here).
- Generated pages: `<!-- generated: cli -->` becomes the CLI reference (diffattn.cli.main's own parsers),
  `<!-- generated: config -->` the config fields (the dataclasses); ARCHITECTURE.md and CHANGELOG.md are pages.
- Maths: LaTeX to MathML at build time (maths.py), so no script is fetched to draw it.
- Checks (a warning, which `mkdocs build --strict` turns into a failed build): every registered attention type has
  its section in concepts/attention.md; every figure names the command that made it.
"""

from __future__ import annotations

import glob
import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).parent))
import maths  # noqa: E402
import reference  # noqa: E402

log = logging.getLogger("mkdocs.hooks.diffattn")
REPO = Path(__file__).resolve().parents[2]
GENERATED = {"cli": reference.cli_markdown, "config": reference.config_markdown,
             "attention-api": reference.attention_api_markdown, "functional-api": reference.functional_api_markdown}
MARKER = re.compile(r"<!--\s*generated:\s*([\w-]+)\s*-->")
# Pages made from files outside docs/ (never copied: read at each build)
FROM_REPO = {"development/architecture.md": "ARCHITECTURE.md", "development/changelog.md": "CHANGELOG.md"}
CONCEPTS = "concepts/attention.md"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)[^)]*\)")
COMMAND = re.compile(r"`(diffattn|python|torchrun) [^`]+`|^(diffattn|python) ", re.M)
_maths: dict[str, dict[str, str]] = {}


# ---------------------------------------------------------------------------------------------------- the nav
def _listed(nav) -> set[str]:
    out: set[str] = set()
    for item in nav or []:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out |= _listed(value)
        elif isinstance(value, str):
            out.add(value.rstrip("?"))
    return out


def _expand(nav, docs: Path, listed: set[str]) -> list:
    out = []
    for item in nav:
        title, value = next(iter(item.items())) if isinstance(item, dict) else (None, item)
        if isinstance(value, list):
            out.append({title: _expand(value, docs, listed)})
        elif isinstance(value, str) and value.endswith("?"):
            if (docs / value[:-1]).is_file():
                out.append({title: value[:-1]} if title else value[:-1])
        elif isinstance(value, str) and "*" in value:
            for match in sorted(glob.glob(value, root_dir=docs)):
                if match not in listed:
                    out.append(match)
                    listed.add(match)
        else:
            out.append(item)
    return out


def on_config(config):
    config.nav = _expand(config.nav, Path(config.docs_dir), _listed(config.nav))
    return config


# ------------------------------------------------------------------------------------------ generated pages
def on_files(files, config):
    for uri, source in FROM_REPO.items():
        files.append(File.generated(config, uri, content=(REPO / source).read_text(encoding="utf-8")))
    return files


def _from_repo(markdown: str) -> str:
    """ARCHITECTURE.md and CHANGELOG.md as pages: their links into docs/ and to the repository's files rewritten
    for the site (a file outside docs/ is named as code, not linked)."""
    markdown = re.sub(r"\]\(docs/([^)]*)\)", r"](../\1)", markdown)
    return re.sub(r"\[([^\]]+)\]\((?!https?://|\.\./|#)([^)]+)\)", r"\1 (`\2`)", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if uri in FROM_REPO:
        markdown = _from_repo(markdown)
    markdown = MARKER.sub(lambda m: GENERATED[m.group(1)](), markdown)
    if uri == CONCEPTS:
        check_concepts(markdown)
    check_figures(uri, markdown)
    markdown, found = maths.to_placeholders(markdown)
    _maths[uri] = found
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    return maths.restore(html, _maths.pop(page.file.src_uri, {}))


# ------------------------------------------------------------------------------------------------- checks
def check_concepts(markdown: str) -> None:
    """A new attention type cannot be missing from the concepts: each registered name has a heading."""
    from diffattn.attention.registry import ATTENTION

    headings = "\n".join(ln for ln in markdown.splitlines() if ln.startswith("#"))
    for name in sorted(ATTENTION):
        if f"`{name}`" not in headings:
            log.warning(f"{CONCEPTS}: no section for the registered attention type `{name}` "
                        f"(a heading naming `{name}`, with its maths)")


def check_figures(uri: str, markdown: str) -> None:
    """Each figure names the command that produced it: in its own paragraph or the ones after it, up to the next
    heading or the next group of figures; a study's own report.md names it in its closing "How it was run"
    block."""
    text = maths.CODE.sub(lambda m: m.group(0).replace("![", "!\u200b["), markdown)  # no figure inside code
    paragraphs = re.split(r"\n\s*\n", text)
    generated_report = "## How it was run" in markdown and COMMAND.search(markdown.split("## How it was run")[-1])
    for i, para in enumerate(paragraphs):
        for image in IMAGE.findall(para):
            near, caption = [para], False  # its paragraph, then the ones after it up to the next heading or the
            for nxt in paragraphs[i + 1:]:  # next figure after a caption
                if nxt.lstrip().startswith("#") or IMAGE.search(nxt) and caption:
                    break
                caption = caption or not IMAGE.search(nxt)
                near.append(nxt)
            if not (COMMAND.search("\n".join(near)) or generated_report):
                log.warning(f"{uri}: the figure {image} names no command that produced it (say it in its "
                            "paragraph or the ones after it, before the next heading: `diffattn ...` or `python ...`)")
