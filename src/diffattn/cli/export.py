"""`diffattn export RUN --to hf --out DIR`: a run as a transformers folder (model, tokenizer, generation config).

The command line of :mod:`diffattn.interop.hf_export`: check --out (never the source, never an unasked
overwrite), read the model, refuse what transformers cannot express (every reason, before writing), write,
optionally read the folder back with transformers and compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffattn.cli.options import add_checkpoint_choice, add_output_folder, model_folder_refused, run_holding_output
from diffattn.system.atomic_files import printable

CHECK_TOL = 1e-4  # fp32 logits; the export is an exact re-layout, so only rounding differs

DESCRIPTION = ("Export a run to a transformers folder that AutoModelForCausalLM and AutoTokenizer load offline "
               "(standard -> LlamaForCausalLM or its family's class, diff -> DiffLlamaForCausalLM, without "
               "trust_remote_code; every other model -> DiffattnForCausalLM, diffattn's own code in the folder, "
               "with trust_remote_code=True), or (--to vllm) to a folder vLLM serves with diffattn's plugin.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="any folder diffattn reads a model from: a run folder (train --out), its ckpt/, "
                               "a save_pretrained or convert output, a compare cell")
    p.add_argument("--to", required=True, choices=("hf", "vllm"),
                   help="the format: hf (transformers: Llama / DiffLlama, or custom code for the other types) or "
                        "vllm (one folder vLLM serves with diffattn's plugin and diffattn loads: every type with a "
                        "vLLM recipe)")
    add_output_folder(
        p,
        "folder to write: a new or empty folder (a non-empty one needs --overwrite; the run "
        "folder, or a folder inside it, is always refused)",
        "write into a non-empty --out, replacing only the files an export writes (config.json, "
        "model.safetensors, tokenizer.json, ...); other files stay")
    add_checkpoint_choice(p, "export")
    p.add_argument("--check", action="store_true",
                   help="read the folder back with transformers and report max |Δlogits| and whether the "
                        "tokenizer gives the same ids")


def run(args: argparse.Namespace) -> int:
    """``diffattn export``, holding --out (as a training run holds its folder) while it writes there."""
    if (refused := model_folder_refused(args.run)) is not None:  # before torch is imported
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.interop.hf_export import HF_FILES
    from diffattn.interop.vllm.export import VLLM_FILES

    return run_holding_output(args.out, "diffattn export", HF_FILES if args.to == "hf" else VLLM_FILES, args.run,
                              lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import CheckpointError
    from diffattn.checkpoint.output_guard import OutputError
    from diffattn.checkpoint.run_folder import best_note
    from diffattn.cli.export_vllm import notes, prepare, run_vllm
    from diffattn.interop.hf_custom import ARCHITECTURE
    from diffattn.interop.hf_export import HF_FILES, check_export, export_hf, export_problems

    if args.to == "vllm":
        return run_vllm(args)
    out = Path(args.out)
    try:  # validate first: nothing is written into a folder that may not be used, or for a model that cannot go
        replaced, checkpoint, model = prepare(args, HF_FILES, export_problems, "to transformers", transformers=True)
    except (ValueError, OSError, CheckpointError, OutputError, ImportError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    step = (checkpoint.train_state or {}).get("step")
    note = best_note(args.run, step) if args.checkpoint == "last" and checkpoint.train_state else None
    if note:
        print(note, file=sys.stderr)  # escaped: it names what the run's best checkpoint records
    kept = export_hf(model, checkpoint.tokenizer, out, provenance={"source": str(args.run), "step": step})
    notes(args, replaced, kept, "AutoTokenizer cannot load it" if checkpoint.tokenizer is None else None)
    arch = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    what = f"layers {', '.join(model.config.layer_attention)}" if model.config.mixed else model.config.attention
    code = " (custom code: load it with trust_remote_code=True)" if arch == ARCHITECTURE else ""
    print(f"wrote {out}: {what} -> {arch}{code}, {model.num_params():,} parameters", file=sys.stderr)
    if args.check:
        res = check_export(model, checkpoint.tokenizer, out)
        line = f"max |Δlogits| vs the run: {res['max_abs_logits']:.3g} ({res['class']}, fp32)"
        if res["tokens"]:
            line += f"; tokenizer: {'same' if res['same_ids'] else 'DIFFERENT'} ids on {res['tokens']} tokens"
        print(line)
        if res["max_abs_logits"] > CHECK_TOL or not res["same_ids"]:
            print(f"error: the exported folder does not reproduce the run (tolerance {CHECK_TOL:g})", file=sys.stderr)
            return 1
    return 0
