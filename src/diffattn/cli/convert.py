"""`diffattn convert SRC --to TYPE --out DIR`: read a transformers model of a family diffattn speaks (Llama, Qwen2/2.5,
Qwen3, Mistral, Gemma 3, Phi-3) as it is (`--to standard`), or turn a standard-attention model of any of them into
differential attention.

The command line of :mod:`diffattn.interop.convert`: its :func:`~diffattn.interop.convert.convert_folder` checks --out
(never the source, never an unasked overwrite), loads, converts, optionally checks the logits and writes the
checkpoint; a refusal propagates as one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys

from diffattn.cli.options import add_output_folder, model_folder_refused
from diffattn.system.atomic_files import printable

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
    """``diffattn convert``: the library holds --out while it writes there, converts and says what it wrote."""
    if (refused := model_folder_refused(args.src)) is not None:  # before torch is imported
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.interop.convert import convert_folder

    wrote = convert_folder(args.src, args.out, args.to, init=args.init, rope=args.rope, seed=args.seed,
                           fmt=args.format, check=args.check, overwrite=args.overwrite,
                           note=lambda line: print(printable(line), file=sys.stderr),
                           checked=lambda against, err: print(f"max |Δlogits| vs {against}: {err:.3g}"))
    print(printable(wrote), file=sys.stderr)
    return 0
