"""Check this machine for diffattn: library versions, the device, each attention backend, what auto picks, and
each registered attention variant.

    diffattn doctor [--device cuda] [--dtype bfloat16]

The checks are :mod:`diffattn.train.machine_check`'s. ``auto`` picks a fast kernel only where the measured dispatch
table (:mod:`diffattn.ops.backends`) has a row for this device's capability and dtype; doctor prints the row it
follows for each kernel family, or "no measurement for sm_XX/dtype: safe path".

Each backend is timed (forward + backward) on the self-check's
small case; on CUDA the fast kernels (Triton, FlexAttention) run their self-check against the safe paths. Each
variant in the attention registry (a new variant's file included, with nothing else to edit) trains one step of a
one-layer model here. Exit 0 when every backend ``auto`` picks and every variant runs, 1 when one does not, 2 for
bad input (an unknown device or dtype, an invalid DIFFATTN_BACKEND).
"""

from __future__ import annotations

import argparse
import os
import sys

from diffattn.system.atomic_files import printable

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="device to check (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the backend checks (default: bfloat16 on cuda, float32 elsewhere)")


def run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    import torch

    # (the library, as above)
    from diffattn.ops import backends
    from diffattn.train.machine_check import backend_status, device_line, variant_status, versions

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        forced = backends.env_backend()
    except (RuntimeError, ValueError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    for name, ver in versions().items():
        print(f"{name:13s} {ver}")
    print(f"{'device':13s} {device_line(device)}")
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
    print(f"why (the measured dispatch table, {backends.DISPATCH_FILE.name}):")
    for family in backends.families():
        print(f"  {family}: {backends.explain(family, device, dtype)}")
    variants = variant_status(device, dtype, picks)
    print("\nattention variants (one training step of a one-layer model; the op auto runs):")
    for v in variants:
        done = f"{v['ms']:.2f} ms" if v["ms"] is not None else f"failed: {v['error']}"
        print(f"  {v['attention']:14s} {v['label']:12s} {v['op']:6s} {done}")
    timed = {r["backend"]: r for r in rows}
    broken = sorted({b for b in picks.values() if timed.get(b, {}).get("ms") is None and b in timed})
    if broken:
        print(f"problem: {', '.join(broken)} (picked by auto) did not run here", file=sys.stderr)
        return 1
    failed = [v["attention"] for v in variants if v["ms"] is None]
    if failed:
        print(f"problem: attention variant(s) {', '.join(failed)} did not run here", file=sys.stderr)
        return 1
    print("ok: every backend auto picks and every attention variant runs here")
    return 0
