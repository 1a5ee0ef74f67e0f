"""The pages marked `<!-- docs-test: vllm -->` (docs/tutorials/serve.md) run as written, with vLLM: the export,
the Python snippet as a script in a new process (vLLM's engine re-imports it), `diffattn serve` in the background,
and the requests to it, curl and the OpenAI client (tests/docs_pages.py runs them; marked vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_pages import DOCS, page_mode, pages, run_page

VLLM_PAGES = [p for p in pages() if page_mode(p) == "vllm"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("page", VLLM_PAGES, ids=[p.relative_to(DOCS).as_posix() for p in VLLM_PAGES])
def test_vllm_page_runs(page: Path, tmp_path: Path, monkeypatch, vllm) -> None:
    run_page(page, tmp_path, monkeypatch, serve=True)
