"""``diffattn train``: train a model (language model or classifier) from a TOML config.

Also run as ``python -m diffattn train ...`` and, for DDP/FSDP2, ``torchrun --nproc_per_node N -m diffattn train ...``.
This module reads the arguments (importing the library only when the command runs: ``--help`` imports no
torch); :mod:`diffattn.train.launch` prepares the run (config, data, checkpoint, run
folder), launches the training loop and says how it ended.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from diffattn.cli.options import model_folder_refused, usage_error
from diffattn.cli.threads import add_threads_argument, torch_threads
from diffattn.configs.field_list import FIELDS
from diffattn.configs.packaged import packaged_configs

if TYPE_CHECKING:  # the library's request type (imported when the command runs)
    from diffattn.train.launch import RunRequest

DESCRIPTION = "Train a model (language model or classifier) from a TOML config."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="run config: a TOML file or a packaged name ("
        + ", ".join(packaged_configs())
        + "); when resuming, the checkpoint's config is used instead",
    )
    p.add_argument(
        "--out",
        help="run folder (checkpoints in OUT/ckpt, metrics.csv, resolved.toml, tb/); default runs/<config name>",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in OUT (OUT may also be OUT/ckpt)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in OUT (default: refuse)")
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the weights, model config and tokenizer of the checkpoint DIR (e.g. a `diffattn "
        "convert` output); a fresh run (step 0, new optimizer); --config is optional (train/data sections)",
    )
    p.add_argument("--task", choices=("lm", "classify"), help="override the config's task")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar or per-step lines (start, eval, checkpoint and final lines remain)")
    add_threads_argument(p)
    p.epilog = fields_epilog()
    p.formatter_class = _with_raw_epilog(p.formatter_class)
    p.set_defaults(_accepts_extra=True)


def fields_epilog(width: int = 100) -> str:
    """The --section.field overrides train takes (:data:`diffattn.configs.field_list.FIELDS`: each field with its
    dataclass default; a --config file's values replace those defaults)."""
    lines = textwrap.wrap("Every field of the run config can be set: --section.field VALUE (or --section.field="
                          "VALUE), e.g. --model.d_model 256 --train.steps 100 --data.path f.txt. The fields, with "
                          "their defaults (a --config file sets its own):", width)
    for name, items in FIELDS.items():
        head = f"  --{name}.  "
        lines += textwrap.wrap(head + ", ".join(items), width, initial_indent="",
                               subsequent_indent=" " * len(head), break_on_hyphens=False)
    return "\n".join(lines)


def _with_raw_epilog(formatter: type) -> type:
    """``formatter`` that prints the epilog's lines as they are (the field list is laid out already)."""

    class Formatter(formatter):
        def _fill_text(self, text: str, width: int, indent: str) -> str:
            return text if "\n" in text else super()._fill_text(text, width, indent)

    return Formatter


def request(args: argparse.Namespace) -> RunRequest:
    """The run the arguments ask for."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.train.launch import RunRequest

    return RunRequest(config=args.config, out=args.out, resume=args.resume, overwrite=args.overwrite,
                      init_from=getattr(args, "init_from", None), task=args.task,
                      overrides=list(getattr(args, "_extra", []) or []), progress=not args.no_progress)


def run(args: argparse.Namespace) -> int:
    """``diffattn train`` on ``--threads`` torch threads (the start line says how many)."""
    if (refused := refused_early(args)) is not None:
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.train.launch import launch

    with torch_threads(getattr(args, "threads", 0)):
        return launch(request(args))


def refused_early(args: argparse.Namespace) -> int | None:
    """2, after a one-line refusal, for the folders the arguments name that cannot be used, told before torch is
    imported (a refusal is quick): an --init-from that holds no model, a --resume of a run folder that does not
    exist. Everything else is the library's to check."""
    if getattr(args, "init_from", None):
        refused = model_folder_refused(args.init_from, "--init-from")
        if refused is not None:
            return refused
    if args.resume and not args.init_from and not args.overwrite:
        out = args.out or (Path("runs") / Path(args.config).stem if isinstance(args.config, str) else None)
        if out is not None and not Path(out).exists():
            return usage_error(f"cannot resume: {out} does not exist, so there is no run to continue (a new run: "
                               f"diffattn train --config CONFIG --out {out})")
    return None


def main(argv: list[str] | None = None) -> int:
    """The ``train`` command on its own (same arguments as ``diffattn train``)."""
    p = argparse.ArgumentParser(prog="diffattn train", description=DESCRIPTION)
    add_arguments(p)
    args, extra = p.parse_known_args(argv)
    args._extra = extra
    return run(args)
