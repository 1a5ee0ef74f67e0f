"""Print a checkpoint's model config, parameter counts, training state and last metrics.

``diffattn info PATH``: reads any folder diffattn writes (a run folder, its ckpt/, a convert output, a study cell,
a save_pretrained folder) with :func:`diffattn.checkpoint.model_folders.open_model_folder`.
"""

from __future__ import annotations

import argparse
import json
import sys

from diffattn.cli.options import model_folder_refused, usage_error
from diffattn.system.atomic_files import printable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", help="a run folder (diffattn train --out DIR) or its ckpt/, a converted model (diffattn convert "
                           "--out DIR) or a save_pretrained folder"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    if (refused := model_folder_refused(args.checkpoint)) is not None:  # before torch is imported
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import CheckpointError, num_classes
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.model.parts import COMPONENTS, param_counts
    from diffattn.model.shapes import weights_mismatch

    try:
        checkpoint = open_model_folder(args.checkpoint)
    except CheckpointError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    shapes = {k: tuple(t.shape) for k, t in checkpoint.state_dict.items()}
    why = weights_mismatch(checkpoint.model_config, shapes, task=checkpoint.task,
                           num_classes=num_classes(checkpoint.run_config))
    if why:  # any other command would fail to build it: say so, and how they differ
        return usage_error(f"{checkpoint.path}: its config and its weights disagree: {why}")
    counts = param_counts(checkpoint.state_dict, checkpoint.tied)
    # internals of exact resume (and a copy of [train]) are not worth printing
    hidden = {"history", "rng_meta", "train_config", "scaler"}
    ts = {k: v for k, v in checkpoint.train_state.items() if k not in hidden and v is not None}
    hist = checkpoint.train_state.get("history", [])
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(checkpoint.path),
                    "run_config": checkpoint.run_config.to_dict(),
                    "params": counts,
                    "tied": checkpoint.tied,
                    "train_state": ts,
                    "last_metrics": hist[-1] if hist else None,
                },
                indent=1,
            )
        )
        return 0
    print(f"checkpoint: {printable(checkpoint.path)}")
    print(f"task: {checkpoint.task}")
    for section, values in checkpoint.run_config.to_dict().items():  # the sections the checkpoint records
        if not isinstance(values, dict) or not values or section == "study" or (section == "classify") != (
                checkpoint.task == "classify"):  # a language model's [classify] is not printed
            continue
        print(f"[{section}]")
        for k, v in values.items():
            print(f"  {printable(k)} = {printable(repr(v))}")
    print("parameters:")
    for c in COMPONENTS:  # always show the four parts every model has; the others only when present
        if counts[c] or c in ("embeddings", "attention", "ffn", "norms"):
            print(f"  {c:<16} {counts[c]:>14,}")
    for alias, src in checkpoint.tied.items():
        print(f"  {alias} tied to {src} (counted once)")
    print(f"  {'total':<16} {counts['total']:>14,}")
    if checkpoint.tokenizer is not None:
        tk = checkpoint.tokenizer
        kind = tk.get("kind", "?") if isinstance(tk, dict) else type(tk).__name__
        vocab = getattr(tk, "vocab_size", None) or checkpoint.model_config.vocab_size
        print(f"tokenizer: {printable(kind)}, vocab {vocab}")
    print("training state:" if ts else "training state: none recorded")
    for k, v in ts.items():
        print(f"  {printable(k)} = {printable(repr(v))}")
    if hist:  # every string read from the checkpoint is printed escaped: none drives the terminal
        print(f"  last metrics: {printable(hist[-1])}")
    return 0
