"""Training memory on CPU: activation checkpointing's saving and cost, and the planner against measured peaks.

    python benchmarks/bench_memory.py --out docs/results/scale/memory.json      # both parts (~15 min)
    python benchmarks/bench_memory.py --part ac                                 # the checkpointing target only
    python benchmarks/bench_memory.py --part plan --quick                       # small shapes (smoke)

(ac) A 12-layer, d_model-768 DIFF model (6 diff-heads of 64, vocab 32000) at seq_len 2048, batch 1, fp32: the
     peak resident memory of a training step (forward, loss, backward, clipping, AdamW) under each
     ``activation_checkpointing`` mode, each in a fresh process, and the step time of each mode measured
     round-robin in one process (mode A, B, C, A, B, C, ...: a busy moment on a shared machine hits all
     alike; the ratio is the median of the per-round ratios). Target: "full" cuts the peak by >= 50% for
     <= 40% more step time.
(plan) The planner (:mod:`diffattn.train.plan`, fused_optimizer=False as on CPU) against the measured peak at
     several shapes and modes: the step's peak above the resident state (weights + AdamW state) and the whole
     peak above the process's memory before the model existed. Target: within 25% of every measured peak.

Memory is the process's high-water mark (VmHWM, reset through /proc/self/clear_refs before the measured step),
with glibc's mmap threshold fixed at 64 KiB so that freed tensors return to the OS and the resident size
follows the live tensors (by default glibc raises the threshold as large blocks are freed and keeps them). The
first step (which allocates AdamW's state) is a warm-up; the second is measured. Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from diffattn.configs.run_config import TrainConfig
from diffattn.model.blocks import set_activation_checkpointing
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.loss import cross_entropy
from diffattn.train.optim import make_optimizer
from diffattn.train.plan import plan

MB = 2**20
AC_SHAPE = dict(d_model=768, n_layers=12, n_heads=6, vocab_size=32000, seq_len=2048, batch=1, attention="diff")
PLAN_SHAPES = [  # (label, shape): the checkpointing target's shape in each mode, and three others
    ("12L-768 T2048", AC_SHAPE),
    ("6L-512 T1024 B2 std", dict(d_model=512, n_layers=6, n_heads=8, vocab_size=8192, seq_len=1024, batch=2,
                                 attention="standard")),
    ("4L-1024 T512 B4", dict(d_model=1024, n_layers=4, n_heads=8, vocab_size=32000, seq_len=512, batch=4,
                             attention="diff")),
    ("8L-512 T4096", dict(d_model=512, n_layers=8, n_heads=4, vocab_size=4096, seq_len=4096, batch=1,
                          attention="diff")),
]
QUICK_SHAPES = [("2L-128 T256", dict(d_model=128, n_layers=2, n_heads=2, vocab_size=512, seq_len=256, batch=2,
                                     attention="diff"))]


def _status(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _config(shape: dict) -> ModelConfig:
    return ModelConfig(vocab_size=shape["vocab_size"], d_model=shape["d_model"], n_layers=shape["n_layers"],
                       n_heads=shape["n_heads"], attention=shape["attention"], max_seq_len=shape["seq_len"])


def _step(model, opt, ids) -> None:
    loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:]) / ids[:, 1:].numel()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _load_libraries(shape: dict, mode: str) -> None:
    """One step of a tiny model of the same kind: the code a first step imports (torch._dynamo, sympy, triton:
    ~150 MB, since diffattn imports lazily) is then resident before the baseline is read, not counted as the
    model's."""
    tiny = TransformerLM(_config({**shape, "d_model": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 64,
                                  "seq_len": 16, "batch": 1}))
    set_activation_checkpointing(tiny, mode)
    tiny.train()
    _step(tiny, make_optimizer(tiny, TrainConfig()), torch.randint(0, 64, (1, 17)))


def child_memory(shape: dict, mode: str) -> dict:
    """In a fresh process: the peak of one training step (the second) above the resident state and above
    the memory before the model was built."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD (see the module docstring)
    _load_libraries(shape, mode)
    torch.manual_seed(0)
    before = _status("VmRSS")
    model = TransformerLM(_config(shape))
    set_activation_checkpointing(model, mode)
    model.train()
    opt = make_optimizer(model, TrainConfig())
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq_len"] + 1))
    _step(model, opt, ids)
    state = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    _step(model, opt, ids)
    peak = _status("VmHWM")
    return {"state_mb": (state - before) / MB, "step_mb": (peak - state) / MB, "total_mb": (peak - before) / MB}


def child_timing(shape: dict, modes: list[str], rounds: int) -> dict:
    """Step seconds of each mode, round-robin on one model in one process."""
    torch.manual_seed(0)
    model = TransformerLM(_config(shape)).train()
    opt = make_optimizer(model, TrainConfig())
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq_len"] + 1))
    _step(model, opt, ids)  # warm-up: AdamW state, kernels
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:  # the order rotates each round
            set_activation_checkpointing(model, m)
            t0 = time.perf_counter()
            _step(model, opt, ids)
            times[m].append(time.perf_counter() - t0)
    return times


def _child(kind: str, **kw) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps({"kind": kind, **kw})], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"child {kind} {kw} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def predict(shape: dict, mode: str) -> dict:
    p = plan(_config(shape), batch_size=shape["batch"], seq_len=shape["seq_len"], world=1,
             activation_checkpointing=mode, dtype="float32", fused_optimizer=False)
    m = p.layouts["ddp"]
    return {"step_mb": (m.peak - m.state) / MB, "total_mb": m.peak / MB, "state_mb": m.state / MB}


def part_ac(rounds: int, shape: dict) -> dict:
    modes = ["none", "full", "selective"]
    mem = {m: _child("memory", shape=shape, mode=m) for m in modes}
    # the same at batch 2 (memory only): activations grow, the weights and AdamW state do not
    b2 = {m: _child("memory", shape={**shape, "batch": 2 * shape["batch"]}, mode=m) for m in modes}
    times = _child("timing", shape=shape, modes=modes, rounds=rounds)
    rows = {}
    for m in modes:
        ratio = statistics.median(a / b for a, b in zip(times[m], times["none"]))
        rows[m] = {**mem[m], "step_s": statistics.median(times[m]), "time_ratio": ratio,
                   "total_ratio": mem[m]["total_mb"] / mem["none"]["total_mb"],
                   "step_ratio": mem[m]["step_mb"] / mem["none"]["step_mb"]}
    full = rows["full"]
    return {"shape": shape, "rounds": rounds, "times": times, "rows": rows, "double_batch": b2,
            "target": {"memory_cut": 1 - full["total_ratio"], "extra_time": full["time_ratio"] - 1,
                       "met": 1 - full["total_ratio"] >= 0.5 and full["time_ratio"] - 1 <= 0.4}}


def part_plan(shapes: list, modes: list[str]) -> list[dict]:
    rows = []
    for label, shape in shapes:
        for m in modes:
            got, want = _child("memory", shape=shape, mode=m), predict(shape, m)
            rows.append({"shape": label, "mode": m, "measured": got, "planned": want,
                         "err_step": want["step_mb"] / got["step_mb"] - 1,
                         "err_total": want["total_mb"] / got["total_mb"] - 1})
            print(f"{label:<22} {m:<9} step {got['step_mb']:8.0f} MB planned {want['step_mb']:8.0f} "
                  f"({rows[-1]['err_step']:+.0%}); total {got['total_mb']:8.0f} planned {want['total_mb']:8.0f} "
                  f"({rows[-1]['err_total']:+.0%})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ac", "plan", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="small shapes, one round (a smoke run)")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds of the checkpointing part")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        spec = json.loads(args.child)
        kind = spec.pop("kind")
        print(json.dumps(child_memory(**spec) if kind == "memory" else child_timing(**spec)))
        return 0
    if not sys.platform.startswith("linux"):
        print("error: this benchmark reads /proc (Linux)", file=sys.stderr)
        return 2
    res: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                            f"{args.threads} threads", "command": " ".join(["python", *sys.argv])}

    def save() -> None:  # after each part, so that a run stopped in the second keeps the first
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    if args.part in ("ac", "all"):
        shape = QUICK_SHAPES[0][1] if args.quick else AC_SHAPE
        res["ac"] = ac = part_ac(1 if args.quick else args.rounds, shape)
        print("mode       total MB   ×none   step MB   ×none   step s   ×none")
        for m, r in ac["rows"].items():
            print(f"{m:<9} {r['total_mb']:9.0f} {r['total_ratio']:7.2f} {r['step_mb']:9.0f} {r['step_ratio']:7.2f} "
                  f"{r['step_s']:8.2f} {r['time_ratio']:7.2f}")
        b2 = ac["double_batch"]
        print(f"batch {2 * shape['batch']}: total MB " + ", ".join(f"{m} {r['total_mb']:.0f}" for m, r in b2.items())
              + f" (full: {1 - b2['full']['total_mb'] / b2['none']['total_mb']:.0%} less)")
        t = ac["target"]
        print(f"target (full: >= 50% less peak, <= 40% more time): {t['memory_cut']:.0%} less, "
              f"{t['extra_time']:+.0%} time: {'met' if t['met'] else 'MISSED'}", flush=True)
        save()
    if args.part in ("plan", "all"):
        res["plan"] = part_plan(QUICK_SHAPES if args.quick else PLAN_SHAPES,
                                ["none", "full", "selective"])
        worst = max(abs(r["err_total"]) for r in res["plan"])
        print(f"planner: worst error on the whole peak {worst:.0%} (target <= 25%)")
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
