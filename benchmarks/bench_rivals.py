"""The rivals' fast ops against the standard SDPA core, in one run: forward + backward time and peak memory.

    python benchmarks/bench_rivals.py                 # CPU, T in {512, 1024, 2048, 4096}
    python benchmarks/bench_rivals.py --quick         # small sizes, a smoke run

Every op runs causal with H query heads of width d (B = 1 on CPU): the standard core (one SDPA call, H heads),
gated attention (the same call, then σ(gate) on the output), grouped differential attention (H query sub-heads
split 3:1 into signal and noise heads over H/4 KV heads with V of width 2d, as V1's layout: two SDPA calls),
FoX (one SDPA call with the forget bias in two extra Q/K channels, in fp32), twice: as it is, and under
``torch.set_flush_denormal(True)``, since a strongly decaying head drives exp() into fp32 denormals, which a CPU
runs slowly (the forget gates here are σ(N(0, 1)), f ≈ ½ on average: the decay of FoX's initialisation), and
attention sinks (one SDPA call with the sink as one more key: Q/K/V one column wider, padded to a multiple of 8).
Times are medians of round-robin repeats; the ratio is the paired median against the standard core (a slow
moment on a shared machine hits both). Peak memory: on CUDA torch.cuda.max_memory_allocated of one fwd+bwd
above what was allocated before it; on CPU the peak-RSS growth of one fwd+bwd in a fresh subprocess (VmHWM),
beside the size one fp32 (T, T) map per head would have.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import _peak_mb, _synced, fwd_bwd, interleaved_times, med_ms, paired_ratio, print_table  # noqa: E402

from diffattn import functional as AF  # noqa: E402

KINDS = ("std", "gated", "gda", "fox", "fox+ftz", "sink")


def inputs(kind: str, t: int, h: int, d: int, batch: int, device, dtype) -> list[torch.Tensor]:
    """The op's inputs (requires_grad), H query heads of width d."""
    g = torch.Generator().manual_seed(0)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt).requires_grad_()

    if kind == "std":
        return [r(batch, h, t, d) for _ in range(3)]
    if kind == "gated":
        return [r(batch, h, t, d) for _ in range(3)] + [r(batch, h, t, d)]
    if kind == "gda":  # H sub-heads (3:1), H/4 KV heads with K1, K2 of d and V of 2d
        return [r(batch, h, t, d), r(batch, h // 2, t, d), r(batch, h // 4, t, 2 * d),
                torch.tensor(0.5, device=device, requires_grad=True)]
    if kind == "sink":  # one sink logit per head
        return [r(batch, h, t, d) for _ in range(3)] + [r(h, dt=torch.float32)]
    logf = F.logsigmoid(torch.randn(batch, h, t, generator=g)).to(device).requires_grad_()
    return [r(batch, h, t, d) for _ in range(3)] + [logf]


def op(kind: str) -> Callable[..., torch.Tensor]:
    if kind == "std":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kind == "gated":
        return AF.gated_attention
    if kind == "gda":
        return lambda q, k, v, lam: AF.grouped_diff_attention(q, k, v, lam, 3)
    if kind == "sink":
        return AF.sink_attention
    return AF.fox_attention


def _ftz(fn: Callable[[], None]) -> Callable[[], None]:
    def step() -> None:
        prev = torch.set_flush_denormal(True)
        try:
            fn()
        finally:
            if prev:
                torch.set_flush_denormal(False)

    return step


def _cpu_peak_mb(kind: str, t: int, h: int, d: int, threads: int) -> float | None:
    """Peak-RSS growth (MB) of one fwd+bwd in a fresh subprocess, above a baseline taken once the inputs exist."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from bench_rivals import inputs, op
def peak_kb():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
torch.set_num_threads({threads})
torch.set_flush_denormal({kind == "fox+ftz"})
kind = {kind.split("+")[0]!r}
fn = op(kind)
tiny = inputs(kind, 16, {h}, {d}, 1, "cpu", torch.float32)
fn(*tiny).sum().backward()
x = inputs(kind, {t}, {h}, {d}, 1, "cpu", torch.float32)
base = peak_kb()
out = fn(*x)
out.backward(torch.ones_like(out))
print(json.dumps((peak_kb() - base) / 1024))
"""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    return json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None


def _fits(fn: Callable[[], None]) -> bool:
    """One call of ``fn`` on CUDA: False when it runs out of device memory (a materialized rival at long T), so
    the table shows that op as out of memory and times the others."""
    try:
        fn()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def rivals_table(ts: list[int], repeats: int, h: int, d: int, batch: int, device: torch.device,
                 dtype: torch.dtype, threads: int = 1, cpu_peak: bool = True) -> dict:
    """Forward, backward and fwd+bwd ms, the fwd+bwd ratio to the standard core and peak MB, per T and op
    (``cpu_peak`` False: no CPU memory subprocesses, "-")."""
    cuda = device.type == "cuda"
    sync = _synced if cuda else (lambda f: f)
    kinds = [k for k in KINDS if not (cuda and k == "fox+ftz")]  # denormals are a CPU matter
    rows = []
    for t in ts:
        made = {}
        for kind in kinds:
            base = kind.split("+")[0]
            x = inputs(base, t, h, d, batch, device, dtype)
            fwd, both = functools.partial(op(base), *x), fwd_bwd(op(base), x)
            if kind == "fox+ftz":
                fwd, both = _ftz(fwd), _ftz(both)
            if cuda and not _fits(both):
                rows.append([str(t), kind, "-", "-", "-", "out of memory", "-", f"{h * t * t * 4 / 2**20:.0f}"])
                continue
            made[kind] = (sync(fwd), sync(both), both)
        # on CPU every op is interleaved with every other (fair under a noisy machine); on CUDA each op with the
        # standard core alone, the cache emptied between, so one op's large blocks cannot starve the next
        groups = [list(made)] if not cuda else [["std", k] for k in made if k != "std"] or [["std"]]
        for n, group in enumerate(groups):
            times = interleaved_times({f"{k} {part}": made[k][i] for k in group
                                       for i, part in enumerate(("fwd", "fwd+bwd"))}, repeats, warmup=1,
                                      min_time=0.02)
            for kind in group if n == 0 else group[1:]:
                fwd, both = med_ms(times[f"{kind} fwd"]), med_ms(times[f"{kind} fwd+bwd"])
                peak = _peak_mb(made[kind][2], device) if cuda else (
                    _cpu_peak_mb(kind, t, h, d, threads) if cpu_peak else None)
                ratio = "-" if kind == "std" else f"{paired_ratio(times, f'{kind} fwd+bwd', 'std fwd+bwd'):.2f}x"
                rows.append([str(t), kind, f"{fwd:.1f}", f"{both - fwd:.1f}", f"{both:.1f}", ratio,
                             "-" if peak is None else f"{peak:.0f}", f"{h * t * t * 4 / 2**20:.0f}"])
            if cuda:
                torch.cuda.empty_cache()
    return print_table(f"rival ops vs the standard SDPA core, {device.type} {str(dtype).removeprefix('torch.')}, "
                       f"causal, B={batch}, {h} query heads of {d} (GDA: 3:1 over {h // 4} KV heads, V {2 * d})",
                       ["T", "op", "fwd ms", "bwd ms", "fwd+bwd ms", "vs std", "peak MB", "T×T maps MB"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="round-robin repeats (default 5, --quick 2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ts = [128, 256] if args.quick else [512, 1024, 2048, 4096]
    rivals_table(ts, args.repeats or (2 if args.quick else 5), h=8, d=32, batch=1, device=torch.device("cpu"),
                 dtype=torch.float32, threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
