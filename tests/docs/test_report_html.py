"""The report.html that `compare` and `study` write, in headless Chromium (marked docs): it renders (a title and
its headings), every image loads, there is no console error, and nothing in it reaches the network: the page
opens from disk, every request it makes is recorded, and any that is not to the file itself (or a data: URL, an
inlined figure) is refused and fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import run_main
from docs_pages import SHRINK_STUDY, TEXT
from test_browser import CHROMIUM, FLAGS, browser_or_skip

pytestmark = pytest.mark.docs


def open_report(report: Path, tmp_path: Path) -> dict:
    api = browser_or_skip()
    with api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900})
        requests: list[str] = []
        context.route("**/*", lambda r: r.abort() if r.request.url.startswith(("http", "ws")) else r.continue_())
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report.as_uri(), wait_until="load")
            page.screenshot(path=str(tmp_path / f"{report.parent.name}.png"), full_page=True)
            found = {
                "title": page.title(), "errors": errors,
                "headings": page.locator("h1, h2").count(),
                "images": page.eval_on_selector_all(
                    "img", "els => els.map(e => [e.getAttribute('src').slice(0, 40), e.complete, e.naturalWidth])"),
                "requests": [u for u in requests if u != report.as_uri() and not u.startswith("data:")],
            }
        finally:
            context.close()
    return found


def check(found: dict, least_images: int) -> None:
    assert found["title"] and found["headings"] >= 2, found
    assert not found["errors"], f"console errors: {found['errors']}"
    assert not found["requests"], f"the report reached for: {found['requests'][:5]}"
    assert len(found["images"]) >= least_images, found["images"]
    broken = [src for src, complete, width in found["images"] if not (complete and width > 0)]
    assert not broken, f"images that did not load: {broken}"


def test_the_compare_report_renders_offline(tmp_path: Path) -> None:
    res = run_main("compare", "--quick", "--out", tmp_path / "compare")
    assert res.returncode == 0, res.stderr[-3000:]
    check(open_report(tmp_path / "compare" / "report.html", tmp_path), least_images=5)


def test_the_study_report_renders_offline(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text(TEXT, encoding="utf-8")
    res = run_main("study", text, "--quick", *SHRINK_STUDY, "--out", tmp_path / "study")
    assert res.returncode == 0, res.stderr[-3000:]
    check(open_report(tmp_path / "study" / "report.html", tmp_path), least_images=2)
