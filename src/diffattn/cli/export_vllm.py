"""`diffattn export RUN --to vllm --out DIR`: a run as one folder vLLM serves (with diffattn's plugin) and diffattn
loads (:mod:`diffattn.interop.vllm.export`). Checked before anything is written: --out (never the source, never
an unasked overwrite), the model (a causal LM whose attention type has a vLLM recipe)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from diffattn.checkpoint.format import CheckpointError
from diffattn.checkpoint.model_folders import load_pretrained, open_model_folder
from diffattn.checkpoint.output_guard import OutputError, check_output_dir
from diffattn.checkpoint.run_folder import pick_checkpoint
from diffattn.interop.hf import require_transformers
from diffattn.interop.vllm.export import VLLM_FILES, export_problems, export_vllm
from diffattn.interop.vllm.served import config_problems, kv_bytes_per_token, served_config
from diffattn.system.atomic_files import printable

CHECK_TOL = 1e-4  # fp32 logits: the served re-expression is exact up to rounding


def prepare(args: argparse.Namespace, owned: tuple[str, ...], problems_of: Callable, target: str,
            transformers: bool = False) -> tuple:
    """Validate before anything is written: --out (never the source, never an unasked overwrite), the extra the
    export needs (transformers: always with ``transformers``, else for a run with a tokenizer), then the model
    (``problems_of(model)``: every reason it cannot go to ``target``). -> (the entries --overwrite replaces, the
    checkpoint, the model). Raises ValueError, OSError, CheckpointError or OutputError (one line; a missing
    extra is a :class:`~diffattn.system.atomic_files.MissingExtra`, a ValueError too)."""
    replaced = check_output_dir(Path(args.out), overwrite=args.overwrite, owned_patterns=owned, what="export",
                                resumable=False, source=args.run, refuse_nonempty=True)
    checkpoint = open_model_folder(pick_checkpoint(args.run, args.checkpoint))
    if transformers or checkpoint.tokenizer is not None:  # its tokenizer becomes a transformers fast tokenizer
        require_transformers()
    model = checkpoint.build_model()
    problems = problems_of(model)
    if problems:
        raise ValueError(f"cannot export {args.run} {target}: " + "; ".join(problems))
    return replaced, checkpoint, model


def notes(args: argparse.Namespace, replaced: list[Path], kept: list[str], no_tokenizer: str | None) -> None:
    """The lines every export prints after writing: what --overwrite replaced, what else --out holds, a missing
    tokenizer (``no_tokenizer``: its consequence, when the run has none)."""
    out = args.out
    if replaced:
        print(printable(f"note: --overwrite: replaced {', '.join(p.name for p in replaced)} in {out}"),
              file=sys.stderr)
    if kept:  # names of files in the folder: shown escaped
        print(printable(f"note: {out} also holds {', '.join(kept[:6])}{', ...' if len(kept) > 6 else ''}: left as "
                        "they were"), file=sys.stderr)
    if no_tokenizer:
        print(printable(f"note: {args.run} has no tokenizer, so {out} has none ({no_tokenizer})"), file=sys.stderr)


def run_vllm(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        replaced, checkpoint, model = prepare(args, VLLM_FILES, export_problems, "for vLLM")
    except (ValueError, OSError, CheckpointError, OutputError) as e:  # MissingExtra too
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    step = (checkpoint.train_state or {}).get("step")
    kept = export_vllm(model, checkpoint.tokenizer, out, provenance={"source": str(args.run), "step": step})
    notes(args, replaced, kept, "give vLLM token ids" if checkpoint.tokenizer is None else None)
    for problem in config_problems(model.config, cpu=True):
        print(f"note: vLLM's CPU build cannot serve it ({problem}); vLLM on CUDA can", file=sys.stderr)
    cfg, served = model.config, served_config(model.config)
    kv = kv_bytes_per_token(cfg, 2)
    as_ = "" if served.attention == cfg.attention else f" (served as {served.attention!r})"
    what = f"layers {', '.join(cfg.layer_attention)}" if cfg.mixed else cfg.attention
    print(f"wrote {out}: {what}{as_} for vLLM (DiffattnForCausalLM), {model.num_params():,} parameters; "
          f"KV cache {kv['served']:,} bytes per token in bf16, {kv['ratio']:.2f}x the floor", file=sys.stderr)
    if args.check:
        return _check(model, out)
    return 0


@torch.no_grad()
def _check(model: torch.nn.Module, out: Path) -> int:
    """Read the folder back with diffattn and compare fp32 logits on random ids with the run's."""
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.max_seq_len)), generator=torch.Generator().manual_seed(0))
    back = load_pretrained(out).float()
    err = (model.float().eval()(ids) - back(ids)).abs().max().item()
    print(f"max |Δlogits| vs the run: {err:.3g} (the folder read back by diffattn, fp32)")
    if err > CHECK_TOL:
        print(f"error: the exported folder does not reproduce the run (tolerance {CHECK_TOL:g})", file=sys.stderr)
        return 1
    return 0
