"""Sample text from a checkpoint with the static KV cache (`diffattn generate CKPT --prompt "..."`).

The sampling and the sliding window are :mod:`diffattn.model.generate`'s; this module reads the command line, loads
the checkpoint and streams the text.
"""

from __future__ import annotations

import argparse
import sys

from diffattn.cli.options import model_folder_refused, usage_error
from diffattn.cli.threads import add_threads_argument, torch_threads
from diffattn.system.atomic_files import printable_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run folder (diffattn train --out DIR) or its ckpt/, a converted model "
                                      "(diffattn convert --out DIR) or a save_pretrained folder")
    p.add_argument("--prompt", required=True, help="text to continue (encoded with its tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate; past the model's context the window slides (see --window-keep)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with mass >= p")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--window-keep", type=int, default=None,
                   help="when the context is full, keep this many last tokens and continue (default: half the"
                        " context; the full context = nanoGPT's crop, slower)")
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward each step (oracle)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_threads_argument(p)


def run(args: argparse.Namespace) -> int:
    """``diffattn generate`` on ``--threads`` torch threads."""
    if (refused := model_folder_refused(args.checkpoint)) is not None:  # before torch is imported
        return refused
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import CheckpointError
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.model.generate import StreamDecoder, default_window_keep, generate, slides, validate_sampling

    try:  # validate first: the sampling settings, then the checkpoint, before anything is printed
        validate_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        checkpoint = open_model_folder(args.checkpoint)
    except (CheckpointError, ValueError) as e:
        return usage_error(str(e))
    if checkpoint.task != "lm":
        return usage_error(f"{checkpoint.path} is a {checkpoint.task!r} checkpoint; generate needs a language model "
                           "(task 'lm')")
    tok = checkpoint.tokenizer
    if tok is None or isinstance(tok, dict):
        return usage_error(f"{checkpoint.path} has no usable tokenizer (trained on a synthetic task or a token file "
                           "without one), so text prompts cannot be encoded")
    try:
        model = checkpoint.build_model().to(args.device)
        prompt_ids = tok.encode(args.prompt)
        if not prompt_ids:
            return usage_error("the prompt is empty: give at least one character to condition on")
        ctx = model.config.max_seq_len
        keep = default_window_keep(ctx) if args.window_keep is None else args.window_keep
        if not 1 <= keep <= ctx:
            return usage_error(f"--window-keep must be in [1, {ctx}] (the model's context), got {keep}")
        if slides(len(prompt_ids), args.max_new_tokens, ctx):
            print(f"note: prompt ({len(prompt_ids)} tokens) + {args.max_new_tokens} new tokens exceed the model's"
                  f" context ({ctx}); the window slides, keeping the last {keep} tokens each time it is full",
                  file=sys.stderr)
        out = sys.stdout
        stream = StreamDecoder(tok)
        out.write(printable_text(args.prompt))
        out.flush()

        def on_token(t: int) -> None:  # a crafted tokenizer's text may hold ESC, BEL, U+202E: shown escaped
            piece = stream.push(t)
            if piece:
                out.write(printable_text(piece))
                out.flush()

        generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache, on_token=on_token,
                 window_keep=keep, vocab_limit=tok.vocab_size)
        out.write(printable_text(stream.flush()) + "\n")
        out.flush()
    except ValueError as e:
        return usage_error(str(e))
    return 0
