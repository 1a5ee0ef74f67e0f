"""The built site as a reader sees it (marked docs): headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright's Python package, which downloads no browser) opens the home page, a tutorial, an API page and a
results page from a server on this machine, takes a screenshot of each, and checks that each renders: its title,
the navigation, its figures loaded (an API page: its rendered docstrings), no console error, and no request
leaving the machine (every one is refused and counted). Screenshots go to $DIFFATTN_DOCS_SCREENSHOTS when set."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]
# (path, the title's start, what must be on it: "figure" = images that loaded, "api" = rendered docstrings)
PAGES = [
    ("", "diffattn", "figure"),
    ("tutorials/compare/", "Compare DIFF with its baseline", "figure"),
    ("reference/api/model/", "Models and configs", "api"),
    ("results/small-scale/", "DIFF V1 at small scale", "figure"),
]


def browser_or_skip():
    """Playwright's sync API, or a skip naming what is missing; a failure instead under DIFFATTN_REQUIRE_DOCS=1
    (.ci/run's docs step, so that a broken install cannot pass as skipped tests)."""
    missing = None if Path(CHROMIUM).exists() else f"no {CHROMIUM} (Debian's chromium package)"
    try:
        import playwright.sync_api as api
    except ImportError:
        missing = missing or "no playwright (the docs extra)"
    if missing and os.environ.get("DIFFATTN_REQUIRE_DOCS") == "1":
        pytest.fail(f"DIFFATTN_REQUIRE_DOCS=1 but {missing}")
    if missing:
        pytest.skip(missing)
    return api


@pytest.fixture(scope="module")
def served(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def open_pages(urls: list[str], shots: Path, tmp_path: Path, local: str) -> list[dict]:
    """Each URL in a fresh headless Chromium profile: what rendered, the console errors, the requests refused."""
    api = browser_or_skip()
    found = []
    with api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900})
        refused: list[str] = []

        def route(r):
            if r.request.url.startswith(local):
                r.continue_()
            else:
                refused.append(r.request.url)
                r.abort()

        context.route("**/*", route)
        try:
            for i, url in enumerate(urls):
                page = context.new_page()
                errors: list[str] = []
                page.on("console", lambda m, errors=errors: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(url, wait_until="load")
                page.wait_for_load_state("networkidle")
                shot = shots / f"{i}-{url[len(local):].strip('/').replace('/', '-') or 'home'}.png"
                page.screenshot(path=str(shot))
                found.append({
                    "url": url, "title": page.title(), "errors": errors, "shot": shot,
                    "nav": page.locator("nav.md-nav--primary .md-nav__link").count(),
                    "tabs": page.locator(".md-tabs__link").count(),
                    "images": page.eval_on_selector_all(
                        "article img", "els => els.map(e => [e.getAttribute('src'), e.complete, e.naturalWidth])"),
                    "api": page.locator("article .doc-object").count(),
                    "maths": page.locator("article math").count(),
                })
                page.close()
        finally:
            context.close()
    for f in found:
        f["refused"] = list(refused)
    return found


def test_pages_render_in_chromium(served: str, tmp_path: Path) -> None:
    shots = Path(os.environ.get("DIFFATTN_DOCS_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    results = open_pages([served + path for path, _, _ in PAGES], shots, tmp_path, served)
    for (path, title, needs), r in zip(PAGES, results):
        where = f"/{path}: "
        assert r["title"].startswith(title) and "diffattn" in r["title"], where + r["title"]
        assert r["nav"] >= 10 and r["tabs"] >= 5, where + f"navigation: {r['nav']} links, {r['tabs']} tabs"
        assert not r["errors"], where + f"console errors: {r['errors']}"
        assert not r["refused"], where + f"requests leaving the machine: {r['refused'][:5]}"
        if needs == "figure":
            assert r["images"], where + "no figure"
            broken = [src for src, complete, width in r["images"] if not (complete and width > 0)]
            assert not broken, where + f"figures that did not load: {broken}"
        else:
            assert r["api"] >= 3, where + f"{r['api']} documented objects"
        assert r["shot"].stat().st_size > 10_000, where + "an empty screenshot"


def test_equations_render_as_mathml(served: str, tmp_path: Path) -> None:
    """The maths page draws its equations with the browser's MathML (no script fetched, none refused)."""
    results = open_pages([served + "concepts/attention/"], tmp_path, tmp_path, served)
    assert results[0]["maths"] >= 11 and not results[0]["errors"] and not results[0]["refused"]


def test_chromium_is_found_where_the_docs_step_installs_it() -> None:
    """.ci/run's docs step installs Debian's chromium; Playwright is told its path, never to download one."""
    browser_or_skip()
    assert shutil.which("chromium") == CHROMIUM
