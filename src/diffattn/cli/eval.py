"""Evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization; classifiers: accuracy, macro-F1.

``diffattn eval CKPT``: the command line of :mod:`diffattn.eval.checkpoint_eval`. CKPT is a run folder, a
checkpoint, a converted model, a save_pretrained folder, or a comparison folder (each model in it, or the one named
by ``--model``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffattn.cli.options import add_checkpoint_choice, model_folder_refused, usage_error
from diffattn.cli.threads import add_threads_argument, torch_threads
from diffattn.eval.measures import DEFAULT_BITS, WHATS
from diffattn.system.atomic_files import atomic_write, printable_text
from diffattn.system.io_errors import EX_IOERR, io_error_line


def parse_what(s: str) -> list[str]:
    items = [w.strip() for w in s.split(",") if w.strip()]
    bad = [w for w in items if w not in WHATS]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"--what: unknown item(s) {bad or s!r}; choose from {','.join(WHATS)}"
        )
    return items


def parse_bits(s: str) -> list[int]:
    try:
        out = [int(b) for b in s.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be comma-separated integers, got {s!r}") from None
    if not out or any(b < 2 or b > 24 for b in out):
        raise argparse.ArgumentTypeError(f"--bits must be integers in [2, 24], got {s!r}")
    return out


_NO_DEFAULT = "%(default).0s"  # the help says what the default is; this keeps "(default: None)" from being added


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_dir", metavar="checkpoint",
                   help="a run folder (diffattn train --out DIR) or its ckpt/ folder, a converted model (diffattn "
                        "convert --out DIR), a save_pretrained folder, or a comparison folder (diffattn compare "
                        "--out DIR: each model in it, or the one named by --model)")
    p.add_argument("--model", metavar="NAME", default=None,
                   help="in a comparison folder, evaluate only this model (its folder name under runs/ or cells/)"
                        + _NO_DEFAULT)
    p.add_argument("--what", type=parse_what, default=None,
                   help="language models, comma-separated: " + ",".join(WHATS) + " (default: all; needle and noise "
                        "need a model trained on the synthetic needle task). A classifier always reports "
                        "accuracy and macro-F1" + _NO_DEFAULT)
    p.add_argument("--data", "--data.path", dest="data", default=None, metavar="FILE",
                   help="what to evaluate on instead of the data recorded in the checkpoint: a language model's "
                        "text or .bin token file (read with its tokenizer; needed for a converted model, which "
                        "records none), or a classifier's .csv/.jsonl file (default: the run's validation split "
                        "and test file)" + _NO_DEFAULT)
    p.add_argument("--bits", type=parse_bits, default=list(DEFAULT_BITS), help="quantization bit widths")
    p.add_argument("--samples", type=int, default=32, help="sequences per (depth, length) needle cell")
    p.add_argument("--batches", type=int, default=None,
                   help="batches for perplexity (default: a run on its own data reads its training evaluations' "
                        "sample, train.eval_batches batches; else 8)" + _NO_DEFAULT)
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per batch for perplexity, outliers and quantization (default: a run on its "
                        "own data, its training evaluations' rows; else 16)" + _NO_DEFAULT)
    p.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="tokens per window of a language model's data (default: the run's training length; a "
                        "model that records none, such as a converted one, gets the longest window up to its "
                        "context that a CPU evaluates in about a minute)" + _NO_DEFAULT)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the needle evaluation sequences and of the outlier batch (perplexity always "
                        "reads the same batches, drawn with a fixed seed)")
    add_checkpoint_choice(p, "evaluate")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of tables")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the results as JSON to this file (its folder must exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (without it: refused)")
    add_threads_argument(p)


def run(args: argparse.Namespace) -> int:
    """``diffattn eval`` on ``--threads`` torch threads."""
    if (refused := model_folder_refused(args.checkpoint_dir)) is not None:  # before torch is imported
        return refused
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import CheckpointError
    from diffattn.checkpoint.output_guard import OutputError, check_output_file
    from diffattn.checkpoint.run_folder import pick_checkpoint
    from diffattn.eval.checkpoint_eval import EvalError, EvalOptions, eval_targets, evaluate_targets

    # validate everything first: the arguments, the checkpoint(s) and the output file, before any evaluation
    if args.data is not None and not Path(args.data).exists():
        return usage_error(f"--data file {args.data!r} does not exist")
    sizes = (args.batches, args.batch_size, getattr(args, "seq_len", None))
    if args.samples < 1 or any(v is not None and v < 1 for v in sizes):
        return usage_error("--samples, --batches, --batch-size and --seq-len must be >= 1")
    try:
        targets = [(name, pick_checkpoint(d, getattr(args, "checkpoint", "last")))
                   for name, d in eval_targets(args.checkpoint_dir, getattr(args, "model", None))]
        if args.out:
            for _, d in targets:
                check_output_file(args.out, overwrite=getattr(args, "overwrite", False), what="eval",
                                  inside_forbidden=d)
    except (EvalError, CheckpointError, OutputError) as e:
        return usage_error(str(e))
    opts = EvalOptions(what=args.what, data=args.data, bits=args.bits, samples=args.samples, batches=args.batches,
                       batch_size=args.batch_size, seq_len=getattr(args, "seq_len", None), seed=args.seed)
    try:
        results, texts = evaluate_targets(targets, opts)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError and EvalError are ValueErrors
        return usage_error(str(e))
    text = json.dumps(results, indent=2)
    if args.json:
        print(text)
    else:  # names and paths a checkpoint recorded are in the tables: shown escaped
        print(printable_text("\n\n".join(texts)))
    if args.out:
        try:
            atomic_write(args.out, text + "\n")  # a failed write leaves no partial file to block the rerun
        except OSError as e:
            print(io_error_line(e, kept=f"the results printed above (no partial {args.out} is left)",
                                then="run the same command again"), file=sys.stderr)
            return EX_IOERR
    return 0
