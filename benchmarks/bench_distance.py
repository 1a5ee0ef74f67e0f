"""Benchmark: the fast block-wise DA-Transformer core vs a standard SDPA core of the same shape.

fwd+bwd, fp32, B=1, d_model 512 (8 heads of 64), causal unless --bidirectional, T = 512 … 4096.
Time: the kinds run interleaved, ``--repeats`` times per T, medians reported with the ratio fast / SDPA (the
target is <= 2x at T=2048 on CPU). Memory: every (kind, T) point runs in a fresh subprocess, which reports
its peak RSS during one fwd+bwd minus its RSS after building the inputs (the baseline), so only the op's own
peak is counted; the materialized reference is measured too (it is quadratic in T). ru_maxrss cannot be
reset and the import of torch leaves a transient peak above the later RSS that hides ops smaller than it,
so on Linux the subprocess resets the high-water mark (/proc/self/clear_refs, 5) and reads VmHWM (the
quantity ru_maxrss reports); large allocations are mmapped (MALLOC_MMAP_THRESHOLD_) so freed memory leaves
the RSS. Elsewhere it falls back to plain ru_maxrss differences. The growth exponent
log(mem(T_max) / mem(T_min)) / log(T_max / T_min) is ~1 for linear memory and ~2 for quadratic.

    python benchmarks/bench_distance.py [--ts 512,1024,2048,4096] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from diffattn import functional as AF

H, D = 8, 64


def make_inputs(t: int, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                batch: int = 1):
    """q, k, v (B, H, T, D) in ``dtype`` and the per-head w, v_param (H,) in fp32, all leaves on ``device``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, H, t, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    w = torch.linspace(-0.1, 0.1, H, device=device).requires_grad_()
    vp = torch.zeros(H, device=device).requires_grad_()
    return q, k, v, w, vp


def step(kind: str, inputs, causal: bool, block: int) -> None:
    q, k, v, w, vp = inputs
    if kind in ("fast", "block", "flex"):  # fast: backend auto
        out = AF.distance_attention(q, k, v, w, vp, causal=causal, block_q=block, block_k=block,
                                    backend="auto" if kind == "fast" else kind)
    elif kind == "ref":
        out = AF.distance_attention_ref(q, k, v, w, vp, causal=causal)
    elif kind == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        raise ValueError(kind)
    out.backward(torch.ones_like(out))
    for x in inputs:
        x.grad = None


def backend_table(ts: list[int], repeats: int, device: torch.device, dtype: torch.dtype, kinds: list[str],
                  causal: bool = True, block: int = 256, batch: int = 1) -> dict:
    """DA attention on each of ``kinds`` (flex, block, fast = auto; sdpa = a standard core of the same shape)
    on ``device``: fwd+bwd ms (interleaved medians) and, on CUDA, peak memory of one call; ratios against
    sdpa. Printed and returned as {"title", "header", "rows"}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_attention import _peak_mb, _synced, interleaved_times, med_ms, paired_ratio, print_table

    sync = _synced if device.type == "cuda" else (lambda f: f)
    rows = []
    for t in ts:
        inputs = make_inputs(t, device=device, dtype=dtype, batch=batch)
        fns = {kind: sync(functools.partial(step, kind, inputs, causal, block)) for kind in ["sdpa", *kinds]}
        times = interleaved_times(fns, repeats, warmup=2, min_time=0.02)
        for kind in fns:
            peak = _peak_mb(fns[kind], device)
            rows.append([str(t), kind, f"{med_ms(times[kind]):.2f}",
                         "-" if kind == "sdpa" else f"{paired_ratio(times, kind, 'sdpa'):.2f}x",
                         "-" if peak is None else f"{peak:.0f}"])
    return print_table(f"DA attention fwd+bwd, {device.type} {str(dtype).removeprefix('torch.')}, "
                       f"{'causal' if causal else 'bidirectional'}, B={batch}, {H} heads of {D}, vs a standard "
                       "SDPA core of the same shape  [target DA flex/sdpa <= 1.3x on CUDA]",
                       ["T", "kernel", "fwd+bwd ms", "vs sdpa", "peak MB"], rows)


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise OSError(field)


def mem_point(kind: str, t: int, causal: bool, block: int) -> dict:
    """Run in a fresh process: the op's peak RSS above the inputs' baseline, in MiB."""
    step(kind, make_inputs(16), causal, block)  # warm-up at tiny T: library buffers are not the op's memory
    inputs = make_inputs(t)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS high-water mark to the current RSS
        base = _proc_status_mib("VmRSS")
        step(kind, inputs, causal, block)
        return {"kind": kind, "t": t, "peak_mib": _proc_status_mib("VmHWM") - base, "how": "VmHWM"}
    except OSError:
        base = _maxrss_mib()
        step(kind, inputs, causal, block)
        return {"kind": kind, "t": t, "peak_mib": _maxrss_mib() - base, "how": "ru_maxrss"}


def measure_memory(kind: str, t: int, causal: bool, block: int, threads: int) -> float:
    cmd = [sys.executable, __file__, "--mem-point", kind, str(t), "--block", str(block),
           "--threads", str(threads)]
    if not causal:
        cmd.append("--bidirectional")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ts", default="512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--ref-max-t", type=int, default=4096, help="largest T for the materialized reference")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--mem-point", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    causal = not a.bidirectional
    if a.mem_point:
        print(json.dumps(mem_point(a.mem_point[0], int(a.mem_point[1]), causal, a.block)))
        return 0
    ts = [int(x) for x in a.ts.split(",")]
    print(f"DA core vs SDPA core: fwd+bwd fp32, B=1, {H} heads x {D} (d_model {H * D}), "
          f"{'causal' if causal else 'bidirectional'}, block {a.block}, {torch.get_num_threads()} threads, "
          f"{a.repeats} interleaved repeats (medians)")
    rows = []
    for t in ts:
        inputs = make_inputs(t)
        times: dict[str, list[float]] = {"fast": [], "sdpa": []}
        for kind in times:  # warm-up
            step(kind, inputs, causal, a.block)
        for _ in range(a.repeats):
            for kind in times:
                t0 = time.perf_counter()
                step(kind, inputs, causal, a.block)
                times[kind].append(time.perf_counter() - t0)
        row = {"t": t, **{k: statistics.median(v) for k, v in times.items()}}
        if not a.no_memory:
            for kind in ("fast", "sdpa", "ref"):
                row[f"mem_{kind}"] = (measure_memory(kind, t, causal, a.block, a.threads)
                                      if kind != "ref" or t <= a.ref_max_t else float("nan"))
        rows.append(row)
        ratio = row["fast"] / row["sdpa"]
        print(f"  T={t}: fast {row['fast']:.3f}s  sdpa {row['sdpa']:.3f}s  ratio {ratio:.2f}", flush=True)
    head = "|    T | DA fast (s) | SDPA (s) | ratio |"
    if not a.no_memory:
        head += " peak MiB DA fast | SDPA | DA reference |"
    print("\n" + head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for r in rows:
        line = f"| {r['t']:4d} | {r['fast']:11.3f} | {r['sdpa']:8.3f} | {r['fast'] / r['sdpa']:5.2f} |"
        if not a.no_memory:
            line += f" {r['mem_fast']:16.1f} | {r['mem_sdpa']:.1f} | {r['mem_ref']:.1f} |"
        print(line)
    if not a.no_memory and len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        for kind in ("fast", "sdpa", "ref"):
            a0, a1 = lo[f"mem_{kind}"], hi[f"mem_{kind}"]
            if a0 > 0 and a1 > 0 and not math.isnan(a1):
                expo = math.log(a1 / a0) / math.log(hi["t"] / lo["t"])
                print(f"memory growth exponent {kind}: {expo:.2f} (1 = linear, 2 = quadratic)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
