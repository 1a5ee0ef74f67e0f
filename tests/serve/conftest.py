"""The serving tests' ``vllm`` fixture: vLLM imported once per session, or a skip naming why (not installed, a
version outside the supported range, or an install that does not import; a failure instead under
``DIFFATTN_REQUIRE_VLLM=1``). Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one import of vLLM for the whole run, a few seconds per engine after."""

from __future__ import annotations

import os

import pytest

from diffattn.interop.vllm import version_problem


@pytest.fixture(scope="session")
def vllm():
    """vLLM, imported once; skipped (with the reason) when it is missing, outside the supported range, or
    does not import."""
    problem = version_problem()
    if problem is not None:
        unavailable(problem)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process: one import of vLLM
    try:
        import vllm as module  # optional (the serve extra) and slow to import (~20 s)
    except Exception as e:  # a broken install (e.g. PyPI's torchvision beside the CPU torch) is a skip reason too
        unavailable(f"vLLM does not import: {str(e).splitlines()[0][:200]}")
    return module


def unavailable(why: str) -> None:
    """Skip, or fail where vLLM must be there (``DIFFATTN_REQUIRE_VLLM=1``: .ci/run's serving step, so that a
    broken install cannot pass as skipped tests)."""
    if os.environ.get("DIFFATTN_REQUIRE_VLLM") == "1":
        pytest.fail(f"DIFFATTN_REQUIRE_VLLM=1 but {why}")
    pytest.skip(why)
