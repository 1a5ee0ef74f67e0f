"""The docs tests' shared fixture: the whole site, built strictly once per session (tests/docs/test_site.py says
what the build checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_pages import mkdocs


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    res = mkdocs("build", "--strict", "--site-dir", str(out))
    assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stderr[-5000:]}"
    return out
