"""Check this machine for diffattn: library versions, the device, each attention backend, what auto picks.

    diffattn doctor [--device cuda] [--dtype bfloat16]

Each backend is timed (forward + backward) on the self-check's small case; on CUDA the fast kernels (Triton,
FlexAttention) run their self-check against the safe paths. Exit 0 when every backend ``auto`` picks runs,
1 when one does not, 2 for bad input (an unknown device or dtype, an invalid DIFFATTN_BACKEND).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import torch

from diffattn.ops import backends

PACKAGES = ("torch", "triton", "transformers", "datasets", "tensorboard")
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="device to check (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the backend checks (default: bfloat16 on cuda, float32 elsewhere)")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """{package: version or "not installed"}, plus python, diffattn and CUDA (torch's build)."""
    out = {"python": platform.python_version(), "diffattn": _version("diffattn")}
    out.update({name: _version(name) for name in PACKAGES})
    out["cuda"] = torch.version.cuda or "none (CPU build of torch)"
    return out


def _device_line(device: torch.device) -> str:
    threads = f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{device} {p.name} (compute {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB), "
                f"{threads}")
    cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA device"
    return f"{device} ({platform.processor() or platform.machine()}; {cuda}), {threads}"


def backend_status(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per backend: name, available (or why not), self-check verdict, ms of a small fwd+bwd."""
    rows = []
    for kernel in list(backends._KERNELS.values()):
        for name, fast in ((kernel.safe, False), (kernel.name, True)):
            why = kernel.available(device) if fast else None
            row = {"backend": name, "available": why is None, "why": why, "check": "safe path", "ms": None}
            if fast:
                if why is not None:
                    row["check"] = "skipped (unavailable)"
                elif device.type in backends.CHECK_DEVICE_TYPES and dtype in backends.CHECKED_DTYPES:
                    res = backends.self_check(name, device, dtype)
                    row["check"] = "passed" if res.ok else f"failed: {res.error}"
                else:
                    row["check"] = f"skipped (auto does not use it on {device.type})"
            if why is None:
                try:
                    row["ms"] = 1e3 * backends.time_backend(name, device, dtype)
                except Exception as e:  # a backend that cannot run here: shown, not fatal
                    row["time_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        forced = backends.env_backend()
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, ver in versions().items():
        print(f"{name:13s} {ver}")
    print(f"{'device':13s} {_device_line(device)}")
    print(f"{backends.ENV_VAR} {forced if os.environ.get(backends.ENV_VAR) else 'unset (auto)'}")
    print(f"\nbackends ({str(dtype).removeprefix('torch.')}, small causal case, forward + backward):")
    rows = backend_status(device, dtype)
    for r in rows:
        avail = "available" if r["available"] else f"unavailable: {r['why']}"
        ms = f"{r['ms']:.2f} ms" if r["ms"] is not None else r.get("time_error", "not timed")
        print(f"  {r['backend']:7s} {avail}; self-check {r['check']}; {ms}")
    try:
        picks = backends.describe(device, dtype)
    except ValueError as e:  # a forced backend that cannot run here
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print("\nauto picks: " + ", ".join(f"{a} {b}" for a, b in picks.items()))
    timed = {r["backend"]: r for r in rows}
    broken = sorted({b for b in picks.values() if timed.get(b, {}).get("ms") is None and b in timed})
    if broken:
        print(f"problem: {', '.join(broken)} (picked by auto) did not run here", file=sys.stderr)
        return 1
    print("ok: every backend auto picks runs here")
    return 0
