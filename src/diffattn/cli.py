"""`diffattn <command>`: each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .signals import Terminated, TrainingInterrupted

COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("diffattn.compare", "train DIFF and its matched baseline on a built-in task, evaluate, write a report"),
    "train": ("diffattn.train", "train a model (language model or classifier) from a TOML config"),
    "generate": ("diffattn.generate", "sample text from a checkpoint with the KV cache"),
    "eval": ("diffattn.evaluate",
             "evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization"),
    "info": ("diffattn.checkpoint", "print a checkpoint's config, parameter counts and training state"),
    "convert": ("diffattn.convert",
                "convert a standard-attention Llama (transformers folder) to differential attention, exactly"),
    "heads": ("diffattn.heads", "show each head's distance preference (w, v, f-curve) in a distance-aware model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffattn", description="Differential and distance-aware attention toolkit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Commands that take free-form overrides (``train``: --section.field value) set ``_accepts_extra``.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "_accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._extra = extra
    # the command line as typed, for commands that print the exact command to continue an interrupted run
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(args._run(args) or 0)
    except TrainingInterrupted as e:  # a command that did not handle it itself: still one line, no traceback
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print("terminated", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly, as command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
