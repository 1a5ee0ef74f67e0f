"""`diffattn <command>`: each command lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int`` (and may set ``DESCRIPTION``, the line its --help opens with;
else its docstring's first line)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

import torch

from diffattn import __version__
from diffattn.train.signals import Terminated, TrainingInterrupted

COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("diffattn.cli.compare",
                "train DIFF and its matched baseline on a built-in task, evaluate, write a report"),
    "train": ("diffattn.cli.train", "train a model (language model or classifier) from a TOML config"),
    "generate": ("diffattn.cli.generate", "sample text from a checkpoint with the KV cache"),
    "eval": ("diffattn.cli.eval",
             "evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization"),
    "info": ("diffattn.cli.info", "print a checkpoint's config, parameter counts and training state"),
    "convert": ("diffattn.cli.convert",
                "convert a standard-attention Llama (transformers folder) to differential attention, exactly"),
    "heads": ("diffattn.cli.heads", "show each head's distance preference (w, v, f-curve) in a distance-aware model"),
    "doctor": ("diffattn.cli.doctor", "check this machine: versions, device, each attention backend, what auto picks"),
    "plan": ("diffattn.cli.plan", "plan a training run's memory and FLOPs per device (DDP, FSDP2), allocating nothing"),
}


_MENTIONS_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, as argparse.ArgumentDefaultsHelpFormatter does, but only when
    the help text does not already speak of its default (many say "default 1000, --quick 12" themselves) and the
    default tells the reader something (not None, False, "" or an empty list). Lists read as typed: a,b,c."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        default = action.default
        if (_MENTIONS_DEFAULT.search(help_) or default is None or default is False or default == ""
                or default is argparse.SUPPRESS or (isinstance(default, (list, tuple)) and not default)):
            return help_
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return help_  # a required positional has no default to show
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        # help strings go through %-formatting: a literal % in the default must survive it
        return f"{help_} (default: {shown.replace('%', '%%')})"


def _version() -> str:
    return f"diffattn {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffattn", description="Differential and distance-aware attention toolkit.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        # A command module may name its own DESCRIPTION where its docstring's first line describes the module
        description = getattr(mod, "DESCRIPTION", None) or (mod.__doc__ or help_).strip().splitlines()[0]
        p = sub.add_parser(name, help=help_, description=description, formatter_class=DefaultsHelpFormatter)
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
