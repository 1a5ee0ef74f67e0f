"""``diffattn study DATA --from SRC``: the retrofit study's source model, a pretrained standard-attention causal LM
(a transformers folder of a family diffattn reads, or a diffattn checkpoint). The ``standard`` arm is SRC continued;
every other arm is SRC converted exactly (``convert(init="exact")``: the same logits until trained) and fine-tuned;
shape, vocabulary and tokenizer are SRC's. :func:`read_source` reads what planning needs without the weights,
refusing in one line what cannot be a source; :func:`arm_init` gives a cell its initial weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diffattn.checkpoint.format import MANIFEST, CheckpointError, load_checkpoint
from diffattn.checkpoint.hf_folder import from_hf_config, read_config_json, read_tokenizer, weight_files
from diffattn.checkpoint.run_folder import LATEST, resolve_checkpoint_dir
from diffattn.experiments.study.spec import StudyError, StudySpec, parse_variant
from diffattn.interop.convert import convert, load_source
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import printable


def _is_checkpoint(p: Path) -> bool:
    return (p / MANIFEST).is_file() or (p / LATEST / MANIFEST).is_file()


def read_source(path: str) -> tuple[ModelConfig, Any, str]:
    """(model config, tokenizer, format "transformers" | "diffattn") of SRC, its weights left unread. Raises
    StudyError (one line): not found, not a causal LM, a family diffattn does not read, no tokenizer, not
    standard attention."""
    p = Path(path)
    if not p.exists():
        raise StudyError(f"--from {path}: not found (give a transformers model folder or a diffattn checkpoint)")
    if not p.is_dir():
        raise StudyError(f"--from {path}: not a folder (give a transformers model folder or a diffattn checkpoint)")
    if _is_checkpoint(p):
        try:
            checkpoint = load_checkpoint(resolve_checkpoint_dir(p), tensors=False)
        except (CheckpointError, OSError, ValueError) as e:
            raise StudyError(f"--from {path}: not a readable checkpoint: {printable(e)}") from None
        if checkpoint.task != "lm":
            raise StudyError(f"--from {path}: a {checkpoint.task} checkpoint, not a causal language model")
        cfg, tok, fmt = checkpoint.model_config, checkpoint.tokenizer, "diffattn"
    else:
        try:
            raw = read_config_json(p)
            archs = raw.get("architectures") or []
            if archs and not any(str(a).endswith("ForCausalLM") for a in archs):
                raise ValueError(f"its architectures {printable(archs)} hold no causal LM (…ForCausalLM)")
            cfg = from_hf_config(raw)
            weight_files(p)  # the weight files it names lie inside SRC (no ../, no link out): before a cell opens one
            check_fits(cfg, str(p), copies=1)  # and the model fits, before the plan is written and cells start
            tok = read_tokenizer(p)
        except (ValueError, OSError) as e:
            raise StudyError(f"--from {path}: {printable(e)}") from None
        fmt = "transformers"
    if cfg.attention != "standard":
        raise StudyError(f"--from {path}: a {cfg.attention} model; --from takes a standard-attention model (the "
                         "source every arm is converted from)")
    if tok is None:
        raise StudyError(f"--from {path}: it has no tokenizer, so the text cannot be read with its vocabulary")
    return cfg, tok, fmt


def source_model(path: str) -> TransformerLM:
    """SRC's model in fp32 (read each time: a cell holds it only while it converts it, so that a worker training a
    pretrained model's cells does not keep a second copy of it for good)."""
    try:
        model, _, _ = load_source(str(Path(path).resolve()))
    except (ValueError, CheckpointError, OSError) as e:
        raise StudyError(f"--from {path}: {printable(e)}") from None
    return model.float().eval()


def arm_init(path: str, attention: str, seed: int, src: TransformerLM | None = None) -> dict[str, Tensor]:
    """The initial weights of a cell of arm type ``attention``: SRC's own, or SRC converted exactly (``seed``
    draws the tensors the recipe creates, e.g. V1's λ vectors; the function is the source's whatever the seed).
    ``src``: SRC already read (else it is read here)."""
    src = source_model(path) if src is None else src
    if attention == "standard":
        return {k: v.detach().clone() for k, v in src.state_dict().items()}
    with torch.no_grad():
        model = convert(src, to=attention, init="exact", seed=seed)
    return {k: v.detach() for k, v in model.state_dict().items()}


# Fine-tuning a pretrained model wants far smaller steps than training one from scratch (the study's default
# centre is 3e-3·sqrt(128/d_model)): three LRs a factor 2 apart around 3e-4, bracketed like any study's.
SOURCE_LRS = (1.5e-4, 3e-4, 6e-4)
_SHAPE_FLAGS = {"d_model": "--d-model", "n_layers": "--n-layers", "n_heads": "--n-heads", "head_dim": "--head-dim"}


def source_spec(data: str, source: str, *, variants: str, lrs: list[float] | None, seeds: int, steps: int,
                seq_len: int, batch_size: int, val_tokens: int | None, shape: dict[str, int | None],
                lr_extensions: int, diag_early_steps: int, eval_batches: int = 8,
                evals: int | None = None, retrofit_steps: int | None = None) -> StudySpec:
    """The spec of ``diffattn study DATA --from SRC``: arms ``standard`` + ``variants`` (comma-separated; default
    ``diff``; ``standard`` itself is always trained), SRC's shape and tokenizer. ``shape``: the shape options as
    given (None: not given); one that contradicts SRC is refused. ``retrofit_steps``: each converted arm anneals
    from the exact conversion into its plain type over that many steps (``train --retrofit.*``; None: no
    schedule, the conversion as it is). Raises StudyError (one line)."""
    if not Path(data).exists():
        raise StudyError(f"data {data!r} does not exist (give a text file or a folder of text files)")
    cfg, tok, _ = read_source(source)
    src_shape = {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                 "head_dim": cfg.qk_head_dim}
    bad = [f"{_SHAPE_FLAGS[k]} {v} (SRC has {src_shape[k]})" for k, v in shape.items()
           if v is not None and v != src_shape[k]]
    if bad:
        raise StudyError(f"--from {source}: the shape is SRC's; {', '.join(bad)} contradicts it")
    names = [v.strip() for v in (variants or "").split(",") if v.strip()]
    if names and all(v == "standard" for v in names):
        raise StudyError("--from: --variants names only standard, which is SRC continued (always trained): name "
                         "the types to retrofit, e.g. --variants diff,diff_v2")
    names = [v for v in names if v != "standard"] or ["diff"]
    if len(set(names)) != len(names):
        raise StudyError(f"--variants lists a type twice: {names}")
    if any("+" in v for v in names):
        raise StudyError(f"--from: variant options ({', '.join(v for v in names if '+' in v)}) do not apply: each "
                         "arm is SRC converted exactly to a type")
    for v in names:
        parse_variant(v)  # an unknown type: one line naming the registered ones
    if retrofit_steps is not None and not 0 <= retrofit_steps <= steps:
        raise StudyError(f"--retrofit-steps {retrofit_steps}: the schedule must fit in the cells' {steps} steps "
                         "(0 to --steps)")
    if seq_len > cfg.max_seq_len:
        raise StudyError(f"--seq-len {seq_len} exceeds SRC's context ({cfg.max_seq_len})")
    spec = StudySpec.from_dict(dict(
        data=str(Path(data).resolve()), tokenizer=tok.kind, d_model=cfg.d_model, n_layers=cfg.n_layers,
        variants=names, lrs=list(lrs or SOURCE_LRS), seeds=list(range(seeds)), seq_len=seq_len,
        batch_size=batch_size, steps=steps, lr_extensions=lr_extensions, diag_early_steps=diag_early_steps,
        val_tokens=val_tokens, eval_batches=eval_batches, evals=evals, retrofit_steps=retrofit_steps,
        source_model=cfg.to_dict(), heads=[cfg.n_heads],
        **{"from": str(Path(source).resolve())}))
    for a in spec.arms():  # a type that cannot convert SRC: one line, before anything is written
        spec.arm_config(a)
    return spec
