"""Whether V1's fused Triton kernel (:mod:`diffattn.ops.triton_diff`) can run here and take a call: triton is
optional, so this never imports it unless asked, and a broken install leaves the SDPA path working."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch
from torch import Tensor

from diffattn.ops import backends


# The availability checks are constants to torch.compile (evaluated once while tracing, no graph break).
@backends.assume_constant_result
def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (the kernel on CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@backends.assume_constant_result
def installed() -> bool:
    """Whether triton is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def _import_ok() -> bool:
    if not installed():
        return False
    try:
        importlib.import_module("diffattn.ops.triton_diff")
    except Exception:  # a broken triton install: the SDPA path still works
        return False
    return True


@backends.assume_constant_result
def importable() -> bool:
    """Whether the kernel's module imports (a broken triton install does not)."""
    return _import_ok()


def unsupported(q: Tensor, lam: Tensor | float, attn_mask: Tensor | None, offset: int | Tensor) -> str | None:
    """Why the fused Triton kernel cannot take this call, or None when it can."""
    if not installed():
        return "triton is not installed (pip install triton)"
    if attn_mask is not None:
        return "it takes no attn_mask (only causal / non-causal with an int offset)"
    if not isinstance(offset, int):
        return f"it takes an int offset, got {type(offset).__name__}"
    if isinstance(lam, Tensor) and lam.numel() != 1:
        return f"it takes a scalar λ, got shape {tuple(lam.shape)}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it supports fp32/bf16/fp16, got {q.dtype}"
    if q.shape[-2] == 0 or q.numel() == 0:
        return "the input is empty"
    if not q.is_cuda and not interpret_requested():
        return (f"it needs a CUDA device, got {q.device.type} (on CPU it runs only under Triton's interpreter, "
                f"TRITON_INTERPRET=1, for tests)")
    return None


def available(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (its registry entry's ``available``), or None."""
    if not importable():
        return "triton is not installed or does not import (pip install triton)"
    if device.type != "cuda" and not interpret_requested():
        return f"the Triton kernel needs a CUDA device, got {device.type} (or TRITON_INTERPRET=1, for tests)"
    return None
