"""Shared test fixtures: every test starts from the same RNG state, so failures reproduce."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject): a worker per core, at most 4, since several tests start processes of about 1 GB."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config: pytest.Config) -> None:
    # Under xdist each worker shares the cores with the others: torch's own threads take their share only (the
    # OpenMP threads of two workers that each take every core spin against each other).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `docs` tests (every page run, the site built strictly, the pages in headless Chromium) need the docs
    extra and Chromium and take minutes: they run when asked for (`-m docs`, .ci/run's docs step), and are skipped,
    saying how to run them, in the core suite."""
    if "docs" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="a docs test: python -m pytest -m docs (the docs extra; .ci/run's docs step)")
    for item in items:
        if item.get_closest_marker("docs") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    # Autouse so a test's random inputs do not depend on which tests ran before it.
    torch.manual_seed(0)


def tiny_config(**overrides):
    """A ModelConfig small enough for 2 CPU cores (d_model 32, 2 layers, vocab 50)."""
    from diffattn.model.config import ModelConfig

    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, attention="diff")
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture
def make_config():
    """Factory fixture: ``make_config(attention="standard", n_heads=4)`` -> a tiny ModelConfig."""
    return tiny_config


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: tiny models gain nothing from two, and on a shared 2-core machine
    OpenMP threads spinning on each other made such tests several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
