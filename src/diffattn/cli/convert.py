"""`diffattn convert SRC --to TYPE --out DIR`: read a transformers model of a family diffattn speaks (Llama, Qwen2/2.5,
Qwen3, Mistral, Gemma 3, Phi-3) as it is (`--to standard`), or turn a standard-attention model of any of them into
differential attention.

The command line of :mod:`diffattn.interop.convert`: check --out (never the source, never an unasked overwrite),
load, convert, optionally check the logits, write the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffattn.cli.options import add_output_folder, model_folder_refused, run_holding_output
from diffattn.fileio import printable

DESCRIPTION = ("`diffattn convert SRC --to TYPE --out DIR`: read a transformers Llama, Qwen2/2.5, Qwen3, Mistral, "
               "Gemma 3 or Phi-3 as it is (--to standard), or turn a standard-attention model into another attention "
               "type that computes the same function: any registered type whose file holds a conversion recipe, "
               "such as differential attention (--to with any other name lists them). What each family needs: "
               "docs/howto/families.md; `train --init-from SRC --retrofit.to TYPE` anneals the exact conversion into "
               "a real model of that type: docs/howto/retrofit.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a local transformers folder (config.json, safetensors, tokenizer.json) of a llama, "
                               "qwen2, qwen3, mistral, gemma3_text or phi3 model, or a diffattn checkpoint of a "
                               "standard-attention model")
    p.add_argument("--to", required=True, metavar="TYPE",
                   help="the attention type to convert to: standard (the model as it is, any family) or one with "
                        "a conversion recipe (e.g. diff); a type without one is refused, saying why, and a name that "
                        "is none lists those that have one")
    add_output_folder(
        p,
        "checkpoint folder to write: a new or empty folder (a non-empty one needs --overwrite; "
        "the source folder, or a folder inside it, is always refused)",
        "write into a non-empty --out, replacing only the checkpoint files convert writes "
        "(config.json, manifest.json, model.safetensors, ...); other files stay")
    p.add_argument("--init", default="exact", metavar="{exact,split}",
                   help="exact: computes the source's function; split: parameter-matched (pairs heads), "
                        "not function-preserving")
    p.add_argument("--rope", default="neox", choices=("neox", "interleaved"),
                   help="our RoPE layout for a transformers source (both exact)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new λ vectors and symmetry-breaking noise")
    p.add_argument("--format", default="checkpoint", choices=("checkpoint", "hub"),
                   help="checkpoint: a training checkpoint folder (train --init-from, eval, generate read it); "
                        "hub: a save_pretrained folder (model.safetensors, config.json, model card, tokenizer)")
    p.add_argument("--check", action="store_true",
                   help="(exact) also report max |Δlogits| against the source on random ids (in fp32: the source as "
                        "read and, for a transformers folder with transformers installed, transformers' own model)")


def run(args: argparse.Namespace) -> int:
    """``diffattn convert``, holding --out (as a training run holds its folder) while it writes there."""
    if (refused := model_folder_refused(args.src)) is not None:  # before torch is imported
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.output_guard import CHECKPOINT_FILES
    from diffattn.interop.convert import pretrained_files

    return run_holding_output(args.out, "diffattn convert", pretrained_files() + CHECKPOINT_FILES, args.src,
                              lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import MANIFEST, CheckpointError
    from diffattn.checkpoint.output_guard import CHECKPOINT_FILES, OutputError, check_output_dir
    from diffattn.checkpoint.run_folder import LATEST
    from diffattn.configs.run_config import RunConfig
    from diffattn.interop.convert import (
        check_request,
        convert,
        load_source,
        pretrained_files,
        source_checks,
        transformers_checks,
        write_checkpoint_into,
        write_pretrained_into,
    )

    try:  # before anything is read or written: a type without a recipe says why
        check_request(args.to, args.init)
    except ValueError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:  # validate first: nothing is loaded, converted or written into a folder that may not be used
        owned = pretrained_files() if args.format == "hub" else CHECKPOINT_FILES
        replaced = check_output_dir(out, overwrite=args.overwrite, owned_patterns=owned, what="convert",
                                    resumable=False, source=args.src, refuse_nonempty=True)
        src, tok, prov = load_source(args.src, args.rope)
        model = convert(src, args.to, args.init, seed=args.seed, share=True)  # the source is dropped after
        vocab = getattr(tok, "vocab_size", None)
        if vocab is not None and vocab > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} tokens but the model only {model.config.vocab_size}")
    except (ValueError, OSError, CheckpointError, OutputError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    if tok is None:
        print(f"note: {args.src} has no tokenizer.json; the checkpoint has no tokenizer", file=sys.stderr)
    checked = source_checks(model, src, seed=args.seed) if args.check else None
    _print_checks(checked[2] if checked else [])
    run_config = RunConfig.of_model(model.config)  # a model no run trained: no train or data section
    provenance = {"converted_from": {**prov, "to": args.to, "init": args.init, "seed": args.seed}}
    if args.format == "hub":
        kept = write_pretrained_into(out, model, tokenizer=tok)
    else:
        kept = write_checkpoint_into(out, model, run_config=run_config, tokenizer=tok, train_state=provenance)
    if replaced:
        print(f"note: --overwrite: replaced {', '.join(p.name for p in replaced)} in {out}", file=sys.stderr)
    if kept:
        print(f"note: {out} also holds {', '.join(kept[:6])}{', ...' if len(kept) > 6 else ''}: left as they were",
              file=sys.stderr)
    if (out / LATEST / MANIFEST).is_file():
        print(f"note: commands given {out} now read the converted model; the run in {out / LATEST} is still there "
              f"(give {out / LATEST} to use it)", file=sys.stderr)
    wrote = (f"wrote {args.out}: {model.config.attention} ({args.init}), {model.num_params():,} parameters "
             f"(source {src.num_params():,})")
    del model, src  # transformers' copy of the source is read next: one model in memory at a time
    if checked:
        more = transformers_checks(prov, *checked[:2])
        _print_checks(more)
        if not checked[2] and not more:
            print("note: --check: the model is the source as it was read; nothing to compare (with a "
                  "transformers folder and transformers installed, it is compared with transformers' model)",
                  file=sys.stderr)
    print(wrote, file=sys.stderr)
    return 0


def _print_checks(checks: list[tuple[str, float]]) -> None:
    for against, err in checks:
        print(f"max |Δlogits| vs {against}: {err:.3g}")
