"""Retrofit training speed: one optimizer step (forward, backward, AdamW) of a retrofitted model against the same
step of its standard source continued, same shape and batch, in one process.

    python benchmarks/bench_retrofit.py               # CPU: d_model 256, 4 layers, 8 heads (4 KV), T 256, B 4
    python benchmarks/bench_retrofit.py --quick       # small sizes, a smoke run

Each retrofit is built by :func:`diffattn.train.retrofit.retrofit_model` from one standard model (a Llama's
layout: RoPE NeoX, GQA) and timed twice: mid-schedule (s = ½: the forward also blends the schedule, V1's per-head
norm computed beside the identity) and past it (s = 1: the plain type). Times are medians of round-robin repeats
(standard, then each retrofit, order rotated), and each ratio is the paired median against the standard step, so
a busy moment on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import interleaved_times, med_ms, paired_ratio, print_table  # noqa: E402

from diffattn.configs.retrofit import RetrofitConfig  # noqa: E402
from diffattn.model.config import ModelConfig  # noqa: E402
from diffattn.model.transformer import TransformerLM  # noqa: E402
from diffattn.train.retrofit import retrofit_model, set_retrofit  # noqa: E402

ARMS = {"diff": RetrofitConfig(to="diff", steps=10), "diff (layers 0,2)": RetrofitConfig(to="diff", steps=10,
                                                                                         layers=[0, 2]),
        "diff_v2": RetrofitConfig(to="diff_v2", steps=10), "gated": RetrofitConfig(to="gated", steps=10)}


def step_fn(model: TransformerLM, x: torch.Tensor, y: torch.Tensor):
    """One optimizer step of ``model`` on (x, y): cross-entropy, backward, AdamW, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    d, t, b, repeats = (64, 64, 2, 2) if args.quick else (256, 256, 4, args.repeats)
    cfg = ModelConfig(attention="standard", vocab_size=512, d_model=d, n_layers=4, n_heads=8, n_kv_heads=4,
                      max_seq_len=t, rope="neox")
    torch.manual_seed(0)
    src = TransformerLM(cfg).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    fns = {"standard": step_fn(src, x, y)}
    for name, rcfg in ARMS.items():
        for s in (0.5, 1.0):
            model, _ = retrofit_model(src, rcfg)
            set_retrofit(model, s)
            fns[f"{name} s={s:g}"] = step_fn(model.train(), x, y)
    times = interleaved_times(fns, repeats, min_time=0.2)
    rows = [[name, f"{med_ms(ts):.1f}",
             "1.00" if name == "standard" else f"{paired_ratio(times, name, 'standard'):.2f}"]
            for name, ts in times.items()]
    print_table(f"training step, d_model {d}, 4 layers, 8 heads (4 KV), B {b}, T {t}, {args.threads} thread(s), "
                f"{repeats} repeats", ["model", "ms/step", "× standard"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
