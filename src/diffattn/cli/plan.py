"""Plan a training run's memory and FLOPs before renting the GPUs: parameters by component, FLOPs per token,
the memory per device under DDP and FSDP2, whether it fits, and the largest micro-batch that does.

``diffattn plan --config diff_3b --seq-len 4096 --batch-size 4 --gpus 8 --gpu-memory-gb 80
--activation-checkpointing full``. Nothing is allocated: the model is counted on the meta device and its
activations on fake tensors (:mod:`diffattn.train.plan`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from diffattn.fileio import printable
from diffattn.model.blocks import CHECKPOINTING
from diffattn.model.parts import COMPONENTS
from diffattn.train.config import ConfigError, load_run_config, packaged_configs, resolve_model_config
from diffattn.train.plan import GIB, Plan, gib, humanize, plan

DESCRIPTION = "Plan a training run's memory and FLOPs per device (DDP and FSDP2), without allocating anything."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="a TOML run config or a packaged name (" + ", ".join(packaged_configs()) + ")")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's train.seq_len)")
    p.add_argument("--batch-size", type=int, help="micro-batch per device (default: the config's train.batch_size)")
    p.add_argument("--gpus", type=int, default=1, help="devices (world size)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per device in GiB: say whether it fits and the "
                                                        "largest micro-batch that does")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING,
                   help="default: the config's train.activation_checkpointing")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="autocast dtype (default: the "
                                                                                "config's train.dtype)")
    p.add_argument("--vocab-size", type=int, help="vocabulary (default: the config's, else 32000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


# Beyond these a plan answers nothing a machine could use (torch.distributed counts ranks in 32 bits)
LIMITS = {"gpus": 2**20, "gpu_memory_gb": 2**20, "seq_len": 2**40, "batch_size": 2**40, "vocab_size": 2**40}


def _positive(name: str, v: float | None) -> None:
    if v is None:
        return
    if not (math.isfinite(v) and 0 < v <= LIMITS[name]):
        raise ConfigError(f"--{name.replace('_', '-')} must be positive and finite (at most {LIMITS[name]:,}), got {v}")


def run(args: argparse.Namespace) -> int:
    try:
        for name in ("seq_len", "batch_size", "gpus", "gpu_memory_gb", "vocab_size"):
            _positive(name, getattr(args, name))
        overrides = [f"--train.seq_len={args.seq_len}"] if args.seq_len else []
        cfg = load_run_config(args.config, overrides + ([f"--model.vocab_size={args.vocab_size}"]
                                                        if args.vocab_size is not None else []))
        t, seq = cfg.train, cfg.train.seq_len
        mcfg = resolve_model_config(cfg, None if "vocab_size" in cfg.model_given else 32000)
        mcfg = mcfg.replace(max_seq_len=max(mcfg.max_seq_len, seq))
    except (ConfigError, ValueError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    try:
        p = plan(mcfg, batch_size=args.batch_size or t.batch_size, seq_len=seq, world=args.gpus,
                 gpu_memory_gb=args.gpu_memory_gb, activation_checkpointing=args.activation_checkpointing
                 or t.activation_checkpointing, dtype=args.dtype or t.dtype)
    except (RuntimeError, OverflowError) as e:  # a tensor whose element count overflows 64 bits
        print(f"error: {args.config}: the model is too large to plan on any machine "
              f"({printable(str(e).splitlines()[0])})", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.to_dict(), indent=1, default=float))
        return 0
    print(report(p, args.config))
    return 0


def report(p: Plan, name: str) -> str:
    c = p.config
    lines = [f"{name}: {c.attention}, d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, vocab "
             f"{c.vocab_size}; micro-batch {p.batch_size} × {p.seq_len} tokens, {p.world} device(s), "
             f"{p.dtype}, activation checkpointing {p.mode}", "", "parameters:"]
    for comp in COMPONENTS:
        if p.counts[comp]:
            lines.append(f"  {comp:<12} {p.counts[comp]:>15,}")
    lines.append(f"  {'total':<12} {p.counts['total']:>15,}")
    f = p.flops
    lines += ["", "FLOPs per token (training: forward + backward):",
              f"  matmuls {humanize(f['matmul'])}, attention {humanize(f['attention'])} "
              f"({100 * f['attention'] / f['model']:.1f}%), total {humanize(f['model'])}"
              + (f"; + {humanize(f['recompute'])} recomputed under full checkpointing" if p.mode == "full" else ""),
              "", "memory per device (GiB):",
              f"  {'':<6} {'weights':>8} {'grads':>8} {'AdamW':>8} {'buffers':>8} {'activ.':>8} {'peak':>8}"
              + ("  fits  max micro-batch" if p.budget else "")]
    for par, m in p.layouts.items():
        row = (f"  {par:<6} {gib(m.weights):>8} {gib(m.grads):>8} {gib(m.optimizer):>8} {gib(m.buffers):>8} "
               f"{gib(m.activations):>8} {gib(m.peak):>8}")
        if p.budget:
            row += f"  {'yes' if p.fits(par) else 'no':<5} {p.max_batch[par]}"
        lines.append(row)
    per, outside = p.layouts["ddp"].blocks, p.layouts["ddp"].activations - sum(p.layouts["ddp"].blocks)
    lines.append(f"  activations kept: {gib(per[0])} GiB per block × {len(per)} blocks + {gib(outside)} outside them")
    if p.budget:
        lines.append(f"  budget {p.budget / GIB:g} GiB per device")
    return "\n".join(lines)
