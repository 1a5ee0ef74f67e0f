"""Attention-core benchmarks on CPU: differential attention's overhead over standard SDPA, in one run.

    python benchmarks/bench_attention.py            # T in {512, 1024, 2048, 4096}; memory up to 8192
    python benchmarks/bench_attention.py --quick    # small sizes, a smoke run

Every measurement alternates the candidate with its baseline (round-robin, several repeats) and reports the
median of the per-repeat time ratios, so a slow moment on a shared machine hits both sides alike.
Tables (see benchmarks/README.md for what each ratio means):
  (a) V1 core (diff_attention, h diff-heads of width d, V 2d) vs a standard SDPA core with 2h heads of
      width d (target <= 1.6x; the FLOP ratio is 1.5x). The shipped diff_attention zero-pads Q/K to 2d and
      makes one fused call (2x nominal FLOPs); the alternatives: one call with V of width 2d ("1call", 1.5x
      FLOPs, but CPU SDPA runs it on its math path) and two calls on the V halves ("splitV", 2x FLOPs);
  (b) V2 core vs one standard SDPA call with the same shapes (2h query heads; target <= 1.1x), and vs a
      standard core with h query heads (V2 does twice the attention work by design);
  (c) fast vs reference V1 core: time and peak memory; peak RSS of the fast op up to T=8192 in a fresh
      subprocess per point (VmHWM), with the size the N×N fp32 maps would have;
  (d) CUDA only (skipped, with a note, where there is none): bf16 fwd+bwd at T=2k..16k of the fused Triton V1
      kernel (diff_attention backend="triton") and of the SDPA V1 path vs a standard SDPA core with 2h heads
      of width d (target triton <= 1.6x), and distance-aware attention on FlexAttention
      (distance_attention backend="flex", 2h heads of d) vs the same standard core (target <= 1.3x).

    python benchmarks/bench_attention.py --only gpu   # table (d) alone
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffattn import functional as AF

THREADS = 2


# ------------------------------------------------------------------------------------------ timing helpers
def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                      min_time: float = 0.05) -> dict[str, list[float]]:
    """Seconds per call for every fn, measured round-robin: repeat r runs each fn once (order rotated).

    A call is looped until it has run ``min_time`` seconds, so tiny sizes are not dominated by timer noise.
    """
    names = list(fns)
    loops = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        t0 = time.perf_counter()
        fns[name]()
        loops[name] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-9)))
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(loops[name]):
                fns[name]()
            out[name].append((time.perf_counter() - t0) / loops[name])
    return out


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over repeats of time[num] / time[den] (each repeat ran both back to back)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def med_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> dict:
    """Print a right-aligned table; returns it as {"title", "header", "rows"} (for gpu_suite.py's reports)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return {"title": title, "header": header, "rows": rows}


# ------------------------------------------------------------------------------------------ workloads
def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A closure running fn(*inputs) forward + backward (grads of every input are recomputed each call)."""
    grad = None

    def step() -> None:
        nonlocal grad
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    return step


def v1_inputs(t: int, h: int, d: int, hkv: int | None = None) -> list[torch.Tensor]:
    hkv = hkv or h
    r = lambda *s: torch.randn(*s, requires_grad=True)
    lam = torch.tensor(0.5, requires_grad=True)
    return [r(1, 2 * h, t, d), r(1, 2 * hkv, t, d), r(1, hkv, t, 2 * d), lam]


def v1_one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """V1 in one SDPA call with V of width 2d (1.5x FLOPs; MHA layout). On CPU SDPA has no fused kernel for
    unequal widths and runs its math path (materialized maps)."""
    b, h2, t, d = q.shape
    o = F.scaled_dot_product_attention(q, k, v.repeat_interleave(2, dim=1), is_causal=True)
    o = o.view(b, h2 // 2, 2, t, 2 * d)
    return o[:, :, 0] - lam * o[:, :, 1]


def v1_split_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """V1 as the official flash code does it: value halves of width d, so each SDPA call has equal q/k/v
    widths (QKᵀ is computed twice per sub-head). Same layout, same result as AF.diff_attention (MHA case)."""
    b, h2, t, d = q.shape
    v1, v2 = (x.repeat_interleave(2, dim=1) for x in v.chunk(2, dim=-1))
    o = torch.cat([F.scaled_dot_product_attention(q, k, vh, is_causal=True) for vh in (v1, v2)], dim=-1)
    o = o.view(b, h2 // 2, 2, t, 2 * d)
    return o[:, :, 0] - lam * o[:, :, 1]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


# ----------------------------------------------------------------------------------------------- tables
def table_v1(ts: list[int], repeats: int, h: int, d: int) -> dict:
    rows = []
    for t in ts:
        v1 = v1_inputs(t, h, d)
        std = [torch.randn(1, 2 * h, t, d, requires_grad=True) for _ in range(3)]
        for alt in (v1_split_v, v1_one_call):
            check = (alt(*v1) - AF.diff_attention(*v1)).abs().max().item()
            assert check < 1e-4, f"{alt.__name__} disagrees with diff_attention ({check})"
        times = interleaved_times({
            "std": fwd_bwd(sdpa, std),
            "v1": fwd_bwd(AF.diff_attention, v1),
            "one": fwd_bwd(v1_one_call, v1),
            "split": fwd_bwd(v1_split_v, v1),
        }, repeats)
        rows.append([str(t), f"{med_ms(times['std']):.1f}", f"{med_ms(times['v1']):.1f}",
                     f"{med_ms(times['one']):.1f}", f"{med_ms(times['split']):.1f}",
                     f"{paired_ratio(times, 'v1', 'std'):.2f}x", f"{paired_ratio(times, 'one', 'std'):.2f}x",
                     f"{paired_ratio(times, 'split', 'std'):.2f}x"])
    return print_table(f"(a) V1 core fwd+bwd, fp32, causal, B=1: {h} diff-heads (q/k {d}, v {2 * d}) vs standard "
                f"SDPA {2 * h} heads of {d}  [target V1/std <= 1.6x; FLOP ratio 1.5x]",
                ["T", "std ms", "V1(pad) ms", "1call ms", "splitV ms", "V1/std", "1call/std", "splitV/std"], rows)


def table_v2(ts: list[int], repeats: int, h: int, d: int) -> dict:
    rows = []
    for t in ts:
        r = lambda *s: torch.randn(*s, requires_grad=True)
        q2, k, v = r(1, 2 * h, t, d), r(1, h, t, d), r(1, h, t, d)
        lam = r(1, h, t)
        q1 = r(1, h, t, d)
        times = interleaved_times({
            "std_same": fwd_bwd(sdpa, [q2, k, v]),
            "v2": fwd_bwd(AF.diff_v2_attention, [q2, k, v, lam]),
            "std_h": fwd_bwd(sdpa, [q1, k, v]),
        }, repeats)
        rows.append([str(t), f"{med_ms(times['std_h']):.1f}", f"{med_ms(times['std_same']):.1f}",
                     f"{med_ms(times['v2']):.1f}", f"{paired_ratio(times, 'v2', 'std_same'):.2f}x",
                     f"{paired_ratio(times, 'v2', 'std_h'):.2f}x"])
    return print_table(f"(b) V2 core fwd+bwd, fp32, causal, B=1: {2 * h} query heads of {d} over {h} KV heads  "
                f"[target V2/std(2h) <= 1.1x]",
                ["T", f"std({h}q) ms", f"std({2 * h}q) ms", "V2 ms", f"V2/std({2 * h}q)", f"V2/std({h}q)"],
                rows)


def table_ref(ts: list[int], repeats: int, h: int, d: int) -> dict:
    rows = []
    for t in ts:
        v1 = v1_inputs(t, h, d)
        times = interleaved_times({
            "fast": fwd_bwd(AF.diff_attention, v1),
            "ref": fwd_bwd(AF.diff_attention_ref, v1),
        }, max(3, repeats // 2))
        rows.append([str(t), f"{med_ms(times['fast']):.1f}", f"{med_ms(times['ref']):.1f}",
                     f"{paired_ratio(times, 'ref', 'fast'):.2f}x"])
    return print_table(f"(c1) V1 fwd+bwd, fast vs reference (materialized maps), {h} diff-heads of {d}",
                ["T", "fast ms", "ref ms", "ref/fast"], rows)


def _measure_peak(kind: str, t: int, h: int, d: int) -> dict:
    """In a fresh subprocess: peak-RSS growth (MB) of one call over a baseline taken once the inputs exist."""
    code = f"""
import json, resource, torch

def peak_kb():
    # VmHWM: this process's own resident high-water mark. ru_maxrss is not usable here: Linux carries the
    # parent's maxrss over fork/exec, so a big parent hides the child's growth.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

from diffattn import functional as AF
torch.set_num_threads({THREADS})
torch.manual_seed(0)
t, h, d = {t}, {h}, {d}
q, k = torch.randn(1, 2 * h, t, d), torch.randn(1, 2 * h, t, d)
v, lam = torch.randn(1, h, t, 2 * d), torch.tensor(0.5)
grad_mode = {kind!r}.endswith('train')
if grad_mode:
    for x in (q, k, v, lam):
        x.requires_grad_(True)
fn = AF.diff_attention if {kind!r}.startswith('fast') else AF.diff_attention_ref
# warm up the kernels on a tiny input so one-off allocations are not charged to the call
tiny = [x[..., :8, :].detach().clone().requires_grad_(grad_mode) for x in (q, k, v)]
o = fn(*tiny, lam)
if grad_mode:
    o.sum().backward()
del o, tiny
base = peak_kb()
with torch.set_grad_enabled(grad_mode):
    out = fn(q, k, v, lam)
    if grad_mode:
        out.backward(torch.ones_like(out))
peak = peak_kb()
print(json.dumps({{"delta_mb": (peak - base) / 1024, "out_mb": out.numel() * 4 / 2**20}}))
"""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"rc {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def table_memory(ts: list[int], ref_max_t: int, h: int, d: int) -> dict:
    rows = []
    for t in ts:
        row = [str(t)]
        for kind in ("fast_infer", "fast_train"):
            m = _measure_peak(kind, t, h, d)
            row += ["err" if "error" in m else f"{m['delta_mb']:.1f}",
                    "-" if "error" in m else f"{1024 * m['delta_mb'] / t:.2f}"]
        if t <= ref_max_t:
            m = _measure_peak("ref_infer", t, h, d)
            row.append("err" if "error" in m else f"{m['delta_mb']:.1f}")
        else:
            row.append("skipped")
        nn_map = 2 * h * t * t * 4 / 2**20  # one fp32 (T, T) map per query sub-head
        row.append(f"{nn_map:.0f}")
        rows.append(row)
    return print_table(f"(c2) peak RSS growth of one V1 call (fresh subprocess per point), {h} diff-heads of {d}, "
                "fp32; MB/1k tok = MB per 1024 tokens (constant = linear growth)",
                ["T", "fast fwd MB", "MB/1k tok", "fast fwd+bwd MB", "MB/1k tok", "ref fwd MB",
                 "N×N maps MB"], rows)


def _synced(fn: Callable[[], None]) -> Callable[[], None]:
    def step() -> None:
        fn()
        torch.cuda.synchronize()

    return step


def _peak_mb(fn: Callable[[], None], device: torch.device) -> float | None:
    """Peak CUDA memory one call allocates above what was allocated before it (MB); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def core_table(ts: list[int], repeats: int, h: int, d: int, batch: int, device: torch.device,
               dtype: torch.dtype, kinds: dict[str, str]) -> dict:
    """V1 core against the standard SDPA core (2h heads of d; FlashAttention where SDPA picks it), causal:
    forward, backward (= fwd+bwd − fwd) in ms and peak memory of one fwd+bwd, per T and per ``kinds``
    ({label: diff_attention backend}). Ratios are paired medians against the standard core."""
    sync = _synced if device.type == "cuda" else (lambda f: f)
    rows = []
    for t in ts:
        r = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
        std = [r(batch, 2 * h, t, d) for _ in range(3)]
        v1 = [r(batch, 2 * h, t, d), r(batch, 2 * h, t, d), r(batch, h, t, 2 * d),
              torch.tensor(0.5, device=device, requires_grad=True)]
        fns = {"std": (sdpa, std)}
        fns.update({label: (functools.partial(AF.diff_attention, backend=b), v1) for label, b in kinds.items()})
        timed = {}
        for label, (fn, inputs) in fns.items():
            timed[f"{label} fwd"] = sync(functools.partial(fn, *inputs))
            timed[f"{label} fwd+bwd"] = sync(fwd_bwd(fn, inputs))
        times = interleaved_times(timed, repeats, warmup=2, min_time=0.02)
        for label, (fn, inputs) in fns.items():
            fwd, both = med_ms(times[f"{label} fwd"]), med_ms(times[f"{label} fwd+bwd"])
            peak = _peak_mb(fwd_bwd(fn, inputs), device)
            rows.append([str(t), label, f"{fwd:.2f}", f"{both - fwd:.2f}", f"{both:.2f}",
                         "-" if label == "std" else f"{paired_ratio(times, f'{label} fwd+bwd', 'std fwd+bwd'):.2f}x",
                         "-" if peak is None else f"{peak:.0f}"])
    return print_table(f"V1 core vs standard SDPA core, {device.type} {str(dtype).removeprefix('torch.')}, causal, "
                       f"B={batch}: {h} diff-heads (q/k {d}, v {2 * d}) vs {2 * h} heads of {d}  "
                       "[target V1/std <= 1.6x]",
                       ["T", "kernel", "fwd ms", "bwd ms", "fwd+bwd ms", "vs std (fwd+bwd)", "peak MB"], rows)


def table_gpu(ts: list[int], repeats: int, h: int, d: int, batch: int) -> None:
    """(d): the CUDA paths (Triton V1 kernel, FlexAttention DA) against standard SDPA, bf16, causal."""
    title = "(d) CUDA, bf16 fwd+bwd, causal"
    if not torch.cuda.is_available():
        print(f"\n{title}: skipped, no CUDA device (the Triton kernel and FlexAttention rows need a GPU)")
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for t in ts:
        r = lambda *s: torch.randn(*s, device=dev, dtype=dt, requires_grad=True)
        v1 = [r(batch, 2 * h, t, d), r(batch, 2 * h, t, d), r(batch, h, t, 2 * d),
              torch.tensor(0.5, device=dev, requires_grad=True)]
        std = [r(batch, 2 * h, t, d) for _ in range(3)]
        da = [*(x.detach().clone().requires_grad_() for x in std),
              torch.linspace(0.0, 0.2, 2 * h, device=dev, requires_grad=True),
              torch.zeros(2 * h, device=dev, requires_grad=True)]
        tri = lambda *x: AF.diff_attention(*x, backend="triton")
        sdp = lambda *x: AF.diff_attention(*x, backend="sdpa")
        flex = lambda *x: AF.distance_attention(*x, backend="flex")
        err = "-"  # the reference materializes (B, 2h, T, T) fp32 maps: checked only where they fit
        if t <= 4096:
            with torch.no_grad():
                ref = AF.diff_attention_ref(*(x.float() for x in v1))
                err = f"{(tri(*v1).float() - ref).abs().max().item():.1e}"
            del ref
        times = interleaved_times({
            "std": _synced(fwd_bwd(sdpa, std)),
            "tri": _synced(fwd_bwd(tri, v1)),
            "sdpa": _synced(fwd_bwd(sdp, v1)),
            "flex": _synced(fwd_bwd(flex, da)),
        }, repeats, warmup=2)
        rows.append([str(t), f"{med_ms(times['std']):.2f}", f"{med_ms(times['tri']):.2f}",
                     f"{med_ms(times['sdpa']):.2f}", f"{med_ms(times['flex']):.2f}",
                     f"{paired_ratio(times, 'tri', 'std'):.2f}x", f"{paired_ratio(times, 'sdpa', 'std'):.2f}x",
                     f"{paired_ratio(times, 'flex', 'std'):.2f}x", err])
    print_table(f"{title}, B={batch}: {h} diff-heads (q/k {d}, v {2 * d}) vs standard SDPA {2 * h} heads of {d}; "
                f"DA flex with {2 * h} heads of {d}  [targets: triton/std <= 1.6x, DA flex/std <= 1.3x]",
                ["T", "std ms", "triton ms", "V1 sdpa ms", "DA flex ms", "triton/std", "V1 sdpa/std",
                 "DA flex/std", "triton max|Δ| fwd"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--repeats", type=int, default=None,
                   help="round-robin repeats per size (default 7, quick 3)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64,
                   help="q/k width d of a V1 sub-head (V1 value width 2d)")
    p.add_argument("--only", choices=["a", "b", "c", "mem", "gpu"], default=None, help="run one table")
    p.add_argument("--gpu-batch", type=int, default=4, help="batch size of table (d)")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    d = args.head_dim
    h = args.d_model // (2 * d)  # V1 diff-heads; the baseline has 2h heads of width d (same d_model)
    repeats = args.repeats or (3 if args.quick else 7)
    ts = [128, 256] if args.quick else [512, 1024, 2048, 4096]
    mem_ts = [256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, d_model {args.d_model}, "
          f"repeats {repeats}; ratios = median over repeats of paired time ratios")
    if args.only in (None, "a"):
        table_v1(ts, repeats, h, d)
    if args.only in (None, "b"):
        table_v2(ts, repeats, 2 * h, d)
    if args.only in (None, "c"):
        table_ref(ts[:3] if not args.quick else ts, repeats, h, d)
    if args.only in (None, "c", "mem"):
        table_memory(mem_ts, 1024 if args.quick else 2048, h, d)
    if args.only in (None, "gpu"):
        table_gpu([512, 1024] if args.quick else [2048, 4096, 8192, 16384], repeats, h, d, args.gpu_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
