"""The site builds strictly and offline (marked docs: the docs extra). `mkdocs build --strict` is the test: a
broken link or anchor, a page outside the nav, an attention type missing from the concepts or a figure that
names no command fails it (docs/_tools/hooks.py), and bad input of each kind is shown to fail a build. The
built pages fetch nothing from elsewhere: no font, script, stylesheet or image off the site."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_pages import DOCS, REPO, mkdocs

pytestmark = pytest.mark.docs
yaml = pytest.importorskip("yaml")
pytest.importorskip("mkdocs")


def test_the_site_builds_strictly(site: Path) -> None:
    for page in ("index.html", "quickstart/index.html", "tutorials/train/index.html", "reference/cli/index.html",
                 "reference/config/index.html", "reference/api/model/index.html", "results/small-scale/index.html",
                 "development/architecture/index.html"):
        assert (site / page).is_file(), page


# Attributes through which a page loads something; a link to read elsewhere (<a href>) is not a load.
LOADS = re.compile(r"<(?:script|link|img|iframe|source|video|audio|embed)\b[^>]*?\b(?:src|href)=[\"']([^\"']+)",
                   re.I)
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)|@import\s+['\"]([^'\"]+)", re.I)


def test_nothing_is_fetched_from_elsewhere(site: Path) -> None:
    """Every resource a built page loads is on the site itself: no theme font, CDN script or remote image."""
    external = []
    for page in site.rglob("*.html"):
        for url in LOADS.findall(page.read_text(encoding="utf-8")):
            if re.match(r"(https?:)?//", url):
                external.append(f"{page.relative_to(site)}: {url}")
    for css in site.rglob("*.css"):
        for groups in CSS_URL.findall(css.read_text(encoding="utf-8")):
            url = next(u for u in groups if u)
            if re.match(r"(https?:)?//", url):
                external.append(f"{css.relative_to(site)}: {url}")
    assert not external, "the site loads from elsewhere:\n" + "\n".join(external[:20])


def test_the_cli_reference_is_the_parsers(site: Path) -> None:
    """Generated from diffattn.cli.main: every command and every option of it is on the page (but those the
    parser hides from --help: the internal ones a command passes to the processes it starts)."""
    import argparse

    from diffattn.cli.main import COMMANDS, build_parser

    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name in COMMANDS:
        assert f'id="{name}"' in page, name
        for action in sub[name]._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                assert flag in page, f"diffattn {name} {flag}"


def test_the_config_reference_has_every_field_and_default(site: Path) -> None:
    import dataclasses
    import html

    from diffattn.configs.run_config import SECTIONS

    page = html.unescape((site / "reference" / "config" / "index.html").read_text(encoding="utf-8"))
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.init:
                assert f"{section}.{f.name}" in page, f"{section}.{f.name}"
    assert "'interleaved'" in page and "1e-05" in page  # ModelConfig.rope and norm_eps, as the dataclass has them


def test_equations_are_mathml(site: Path) -> None:
    page = (site / "concepts" / "attention" / "index.html").read_text(encoding="utf-8")
    assert page.count("<math") >= 11 and "$$" not in page


# ------------------------------------------------------------------------------------------------- bad input
def _small_site(tmp_path: Path, pages: dict[str, str], nav: list | None = None) -> Path:
    """A site with our mkdocs.yml's theme, hooks and validation, and only ``pages``."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    for name, text in pages.items():
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text(text, encoding="utf-8")
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"), hooks=[str(DOCS / "_tools" / "hooks.py")],
                  plugins=["search"], nav=nav or list(pages), extra_css=[])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("pages,nav,says", [
    ({"index.md": "# Home\n\n[a page](missing.md)\n"}, None, "missing.md"),
    ({"index.md": "# Home\n\n[an anchor](#nowhere)\n"}, None, "nowhere"),
    ({"index.md": "# Home\n", "orphan.md": "# No one links here\n"}, ["index.md"], "orphan.md"),
    ({"index.md": "# Home\n\n![a figure](fig.png)\n\nA figure with no command.\n", "fig.png": "png"}, None,
     "names no command"),
    ({"concepts/attention.md": "# Attention\n\n## Standard (`standard`)\n"}, None, "registered attention type"),
], ids=["broken-link", "missing-anchor", "page-outside-the-nav", "figure-without-command", "attention-type-missing"])
def test_bad_input_fails_the_build(tmp_path: Path, pages: dict, nav: list | None, says: str) -> None:
    folder = _small_site(tmp_path, pages, nav=[p for p in (nav or pages) if p.endswith(".md")])
    res = mkdocs("build", "--strict", "-f", str(folder / "mkdocs.yml"), cwd=folder, timeout=300)
    assert res.returncode != 0, f"a bad site built:\n{res.stderr[-2000:]}"
    assert says in res.stderr, res.stderr[-2000:]


def test_search_finds_words_inside_code_blocks(site: Path) -> None:
    """The search index holds the code blocks, and its separator (mkdocs.yml) splits code at punctuation, so that
    "vllm curl" or "max-model-len" finds the serve page's commands. The separator is a JavaScript regex that is
    also valid Python, split here as the search worker splits the text between tags."""
    import json

    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    sep = re.compile(index["config"]["separator"])
    text = " ".join(d["text"] for d in index["docs"] if d["location"].startswith("tutorials/serve/"))
    assert "<code>curl " in text, "the serve page's code blocks are not in the search index"
    tokens = {t for chunk in re.split(r"<[^>]+>", text) for t in sep.split(chunk) if t}
    assert {"curl", "max", "model", "len", "completions", "interop"} <= tokens, \
        sorted({"curl", "max", "model", "len", "completions", "interop"} - tokens)
