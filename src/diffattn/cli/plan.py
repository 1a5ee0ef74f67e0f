"""Plan a training run's memory and FLOPs before renting the GPUs: parameters by component, FLOPs per token,
the memory per device under DDP and FSDP2, whether it fits, and the largest micro-batch that does.

``diffattn plan --config diff_3b --seq-len 4096 --batch-size 4 --gpus 8 --gpu-memory-gb 80
--activation-checkpointing full``. Nothing is allocated: the model is counted on the meta device and its
activations on fake tensors (:mod:`diffattn.train.plan`).
"""

from __future__ import annotations

import argparse
import json
import sys

from diffattn.configs.packaged import packaged_configs
from diffattn.system.atomic_files import printable

DESCRIPTION = "Plan a training run's memory and FLOPs per device (DDP and FSDP2), without allocating anything."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="a TOML run config or a packaged name (" + ", ".join(packaged_configs()) + ")")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's train.seq_len)")
    p.add_argument("--batch-size", type=int, help="micro-batch per device (default: the config's train.batch_size)")
    p.add_argument("--gpus", type=int, default=1, help="devices (world size)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per device in GiB: say whether it fits and the "
                                                        "largest micro-batch that does")
    p.add_argument("--activation-checkpointing", metavar="{none,full,selective}",
                   help="default: the config's train.activation_checkpointing")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="autocast dtype (default: the "
                                                                                "config's train.dtype)")
    p.add_argument("--vocab-size", type=int, help="vocabulary (default: the config's, else 32000)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.configs.run_config import ConfigError
    from diffattn.train.plan import format_plan, plan_from_config

    try:
        p = plan_from_config(args.config, seq_len=args.seq_len, batch_size=args.batch_size, gpus=args.gpus,
                             gpu_memory_gb=args.gpu_memory_gb, activation_checkpointing=args.activation_checkpointing,
                             dtype=args.dtype, vocab_size=args.vocab_size)
    except (ConfigError, ValueError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p.to_dict(), indent=1, default=float))
        return 0
    print(format_plan(p, args.config))
    return 0
