"""Shared test fixtures: every test starts from the same RNG state, so failures reproduce."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading

import pytest
import torch


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject): a worker per core, at most 4, since several tests start processes of about 1 GB."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config: pytest.Config) -> None:
    # diffattn's cache (serve's exports for vLLM): the tests' own, never the user's ~/.cache/diffattn
    os.environ["DIFFATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="diffattn-test-cache-")
    # Under xdist each worker shares the cores with the others: torch's own threads take their share only (the
    # OpenMP threads of two workers that each take every core spin against each other).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker whose tests are done ignores SIGINT. When the controller ends the run it tells each worker
    to stop, and execnet (xdist's transport) sends a worker that has not returned within 5 s a SIGINT of its own
    (``gateway_base._terminate_execution``). On a busy machine a worker's own end (pytest's garbage collections
    over a heap of torch objects) takes that long, and the KeyboardInterrupt then landed in whatever Python code
    was running: most often hypothesis's gc callback (registered by the random-shape tests), which pytest shows
    as a ``PytestUnraisableExceptionWarning`` with a KeyboardInterrupt traceback at the end of a passing run
    (issue 52). Ignored, the worker finishes its end as it would have; execnet still ends it 10 s later."""
    if os.environ.get("PYTEST_XDIST_WORKER") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


ASKED_FOR = {  # marker: why it is skipped unless `-m` names it
    # every page run, the site built strictly, the pages in headless Chromium: the docs extra and Chromium
    "docs": "a docs test: python -m pytest -m docs (the docs extra; .ci/run's docs step)",
    # processes signalled, killed, starved of disk or of peers, a wheel built, a kernel interpreted: minutes of CPU
    "slow": "a slow test: python -m pytest -m slow (.ci/run's slow step)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `docs` and `slow` tests take minutes: they run when asked for (`-m docs`, `-m slow`: .ci/run runs each
    in its own step, or `-m` naming another of the test's markers: the serve step's `-m vllm` runs its slow
    ones), and the core suite skips them, saying how to run them."""
    asked = set(re.findall(r"\w+", config.getoption("markexpr", "") or "")) - {"not", "and", "or"}
    for item in items:
        named = {m.name for m in item.iter_markers()}
        why = next((w for m, w in ASKED_FOR.items() if m in named and not named & asked), None)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


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
