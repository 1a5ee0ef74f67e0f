"""`diffattn convert SRC --to TYPE --out DIR`: turn a standard-attention model of any family diffattn reads (Llama,
Qwen2/2.5, Qwen3, Mistral, Gemma 3, Phi-3) into another attention type, computing the same function.

The targets are the registered types with a conversion recipe (``@converts`` beside the class, in the type's own
file: :class:`~diffattn.attention.conversion.Conversion`): differential attention V1 (``diff``), V2 (``diff_v2``),
the types built on V1's parameters (``dint``, ``grouped_diff``), gated attention (``gated``), and whatever a new
variant's file registers. A type without one is refused, saying why (its ``unsupported["convert"]``).

SRC is a local transformers folder of one of these families (config.json, safetensors weights, tokenizer files;
nothing is downloaded) or one of our checkpoints of a ``standard`` model. The result is a checkpoint folder of a
:class:`~diffattn.model.transformer.TransformerLM` that every other command reads (``train --init-from``,
``generate``, ``eval``, ``info``), with the source's ``tokenizer.json`` used as it is.

Here: reading the source, building the converted model layer by layer from the seed, copying (or sharing) everything
outside attention (embeddings, norms, the gated MLP, lm_head: the families' options there are model options, unchanged
by every recipe) and asking the recipe for each layer's attention weights, biases and QK-norm gains included. The
recipe holds the rest: the config change (``head_dim`` and V1's options ``lambda_init`` and ``subln`` record V1's),
the weights, the exactness argument (its docstring) and the tensors it created, which :func:`created_tensors`
returns for the saddle check.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from torch import Tensor, nn

from diffattn.attention.conversion import INITS
from diffattn.attention.registry import CONVERSIONS, build_attention, conversion_of, unsupported_note
from diffattn.checkpoint.folder_kind import model_folder_kind
from diffattn.checkpoint.format import MANIFEST, CheckpointError, load_checkpoint, save_checkpoint
from diffattn.checkpoint.hf_folder import read_tokenizer
from diffattn.checkpoint.output_guard import CHECKPOINT_FILES, OutputError, OutputFolder, check_output_dir
from diffattn.checkpoint.run_folder import LATEST, resolve_checkpoint_dir
from diffattn.configs.run_config import RunConfig
from diffattn.interop.hf import read_hf_folder
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.init import is_meta
from diffattn.model.pretrained import README, TOKENIZER_FILE
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import Refused
from diffattn.system.run_lock import LOCK_NAME

__all__ = ["INITS", "ConvertRefused", "check_request", "check_target", "convert", "convert_folder",
           "converted_config", "created_tensors",
           "load_source", "logits_checks", "pretrained_files", "source_checks", "targets", "transformers_checks",
           "write_checkpoint_into",
           "write_pretrained_into"]


def targets() -> tuple[str, ...]:
    """The registered types a standard model converts to: those with a conversion recipe, sorted."""
    return tuple(sorted(CONVERSIONS))


def check_request(to: str, init: str) -> None:
    """Raise ValueError (one line) for a ``--to`` without a recipe (saying why, when its type says) or an
    ``--init`` its recipe does not define; checked before anything is read."""
    recipe = conversion_of(to)
    if recipe is None:
        note = unsupported_note(to, "convert")
        raise ValueError(f"convert: no conversion to {to!r}: {note}" if note else
                         f"convert: --to must be one of {', '.join(targets())}, got {to!r}")
    if init not in INITS:
        raise ValueError(f"convert: --init must be one of {', '.join(INITS)}, got {init!r}")
    if init not in recipe.inits:
        raise ValueError(f"convert: --init {init} is not defined for --to {to}: it is not parameter-matched by "
                         f"design (its recipe takes --init {' or '.join(recipe.inits)})")


def converted_config(cfg: ModelConfig, to: str, init: str = "exact") -> ModelConfig:
    """The config of the model :func:`convert` builds from a ``standard`` config ``cfg``."""
    if cfg.attention != "standard":
        raise ValueError(f"convert: the source must use standard attention, got {cfg.attention!r}")
    check_request(to, init)
    if conversion_of(to).keeps_source:
        return cfg
    check_target(cfg, to)
    return conversion_of(to).config(cfg, to, init)


@torch.no_grad()
def convert(src: TransformerLM, to: str = "diff", init: str = "exact", seed: int = 0,
            break_symmetry: float = 0.5, share: bool = False) -> TransformerLM:
    """A :class:`TransformerLM` of attention type ``to`` made from a ``standard`` one by ``to``'s recipe.

    ``init="exact"`` computes the source's logits (to float rounding) until trained; ``"split"`` (V1's
    parameter-matched alternative) does not. ``seed`` draws the converted model's new tensors (V1's λ vectors, as
    a fresh layer draws them, layer by layer) and the recipe's symmetry-breaking noise, which ``break_symmetry``
    scales. Returns an fp32 model in eval mode on the CPU.

    Streamed: the model is built without values (meta device), each attention layer is allocated, drawn and filled
    by the recipe one at a time, and everything outside attention (embeddings, norms, MLP, lm_head: unchanged by
    every recipe) is copied from the source, or with ``share=True`` is the source's own tensors (no copy: the
    command line, which drops the source, holds one model's weights plus the new attention; a caller that keeps
    training either model must not share)."""
    if not isinstance(src, TransformerLM):
        raise TypeError(f"convert: expected a TransformerLM, got {type(src).__name__}")
    cfg = converted_config(src.config, to, init)
    recipe = conversion_of(to)
    if recipe.keeps_source:
        return src.float().eval()
    check_fits(cfg, "convert", copies=1)  # the new model, beside the source already held
    with torch.device("meta"):
        model = TransformerLM(cfg)
    s = {k: v.detach().float().cpu() for k, v in src.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, block in enumerate(model.blocks):
            p = f"body.blocks.{i}.attn."
            block.attn = build_attention(cfg, i)  # its new tensors (λ, the per-head norm) drawn as a fresh layer's
            layer = {k[len(p):]: v for k, v in s.items() if k.startswith(p)}
            attn = recipe.weights(layer, block.attn, init=init, gen=gen, break_symmetry=break_symmetry)
            missing = sorted(set(block.attn.state_dict()) - set(attn))
            if missing:  # every tensor must come from the source or from the recipe
                raise RuntimeError(f"convert: no value for {[p + k for k in missing]}")
            block.attn.load_state_dict(attn, strict=True)
    for name, m in model.named_modules():
        if ".attn." in f"{name}.":  # filled above
            continue
        for n, t in list(m._parameters.items()):
            if t is not None:
                w = s[f"{name}.{n}" if name else n]
                m._parameters[n] = nn.Parameter(w if share else w.clone(), requires_grad=t.requires_grad)
        if any(b is not None and b.is_meta for b in m._buffers.values()):
            m.to_empty(device="cpu", recurse=False)
            m.reset_parameters()  # the RoPE tables
    if cfg.tie_embeddings:
        model.lm_head.weight = model.body.tok_emb.weight
    if is_meta(model):
        raise RuntimeError("convert: a tensor was left without a value")
    return model.eval()


def created_tensors(model: TransformerLM, grads: bool = False) -> dict[str, Tensor]:
    """Views of every block of parameters that conversion created or copied into several places (for the
    saddle check), by name ``layer{i}.<part>``, as the model's recipe names its parts
    (:meth:`~diffattn.attention.conversion.Conversion.created`). ``grads=True``: the same views of the
    gradients."""
    recipe = conversion_of(model.config.attention)
    if recipe is None:
        raise ValueError(f"created_tensors: not a converted model (attention {model.config.attention!r})")

    def get(p: Tensor) -> Tensor:
        if not grads:
            return p
        if p.grad is None:
            raise ValueError("created_tensors(grads=True): a parameter has no gradient; run backward first")
        return p.grad

    return {f"layer{i}.{part}": t for i, block in enumerate(model.blocks)
            for part, t in recipe.created(block.attn, get).items()}


def load_source(path: str | Path, rope: str = "neox") -> tuple[TransformerLM, Any, dict[str, Any]]:
    """(standard model, tokenizer or None, provenance) from a transformers Llama folder or our checkpoint."""

    p = Path(path)
    model_folder_kind(p)  # a folder that holds no model: NotAModelFolder (a ValueError), as every reader says it
    if (p / MANIFEST).is_file() or (p / LATEST / MANIFEST).is_file():
        checkpoint = load_checkpoint(resolve_checkpoint_dir(p))  # never a ckpt/ linked out of the folder
        model = checkpoint.build_model()
        if not isinstance(model, TransformerLM):
            raise ValueError(f"{p}: a {checkpoint.task} checkpoint; convert reads language models")
        return model, checkpoint.tokenizer, {"source": str(p), "format": "diffattn"}

    model = read_hf_folder(p, rope=rope)
    tok = read_tokenizer(p)  # before anything is written: a folder with a tokenizer but no tokenizer.json stops here
    return model, tok, {"source": str(p), "format": "transformers", "rope": rope}


def check_target(cfg: ModelConfig, to: str) -> None:
    """Refuse (ValueError, one line) a source the recipe of ``to`` cannot convert exactly, naming what stands in the
    way. Every recipe carries the families' options (q/k/v and o biases, QK-norm, windows, Gemma's norms, scalar
    and RoPE bases: :mod:`diffattn.attention.conversion`); what is left is a shape a recipe cannot take (its own
    :meth:`~diffattn.attention.conversion.Conversion.config` says which) and ``shared_qk`` (the recipes read a
    key projection)."""
    if cfg.shared_qk:
        raise ValueError(f"convert: --to {to} of a shared_qk source is not supported (the recipes read a key "
                         "projection)")


@torch.no_grad()
def logits_checks(model: TransformerLM, src: TransformerLM, provenance: dict[str, Any],
                  seed: int = 0) -> list[tuple[str, float]]:
    """max |Δlogits| of ``model`` in fp32 on 2 × min(64, context) random ids against what it came from:
    ("source", the source as read) when the conversion changed the model, and ("transformers", the source
    folder read by ``AutoModelForCausalLM`` in fp32) when the source is a transformers folder and transformers is
    installed (the label names its class). :func:`source_checks` and :func:`transformers_checks` are its two
    halves, for a caller that frees its models in between."""
    ids, logits, out = source_checks(model, src, seed)
    return out + transformers_checks(provenance, ids, logits)


@torch.no_grad()
def source_checks(model: TransformerLM, src: TransformerLM, seed: int = 0) -> tuple[Tensor, Tensor,
                                                                                      list[tuple[str, float]]]:
    """(ids, ``model``'s fp32 logits on them, [("source", max |Δlogits|)] when ``model`` is not ``src``): the
    first half of :func:`logits_checks`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, src.config.vocab_size, (2, min(64, src.config.max_seq_len)), generator=g)
    logits = model.float()(ids)
    out = [] if model is src else [("source", (logits - src.float()(ids)).abs().max().item())]
    return ids, logits, out


@torch.no_grad()
def transformers_checks(provenance: dict[str, Any], ids: Tensor, logits: Tensor) -> list[tuple[str, float]]:
    """[("transformers (its class, fp32)", max |Δlogits|)] of ``logits`` on ``ids`` against the transformers folder
    the model was read from, in fp32 (empty when it came from elsewhere or transformers is not installed): the
    second half of :func:`logits_checks`, which needs none of our models in memory."""
    if provenance.get("format") != "transformers":
        return []
    try:
        import transformers  # optional, and seconds to import: only for this check
    except ImportError:
        return []
    log = transformers.utils.logging
    was, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()  # no progress bars or notes on stderr
    log.disable_progress_bar()
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(provenance["source"], dtype=torch.float32,
                                                               local_files_only=True).eval()
    finally:
        log.set_verbosity(was)
        if bars:
            log.enable_progress_bar()
    return [(f"transformers ({type(hf).__name__}, fp32)", (logits - hf(ids).logits).abs().max().item())]



def write_checkpoint_into(out: Path, model: TransformerLM, **kw: Any) -> list[str]:
    """Save ``model`` as a checkpoint in the folder ``out``, replacing only the checkpoint files there (a new
    folder is written atomically by :func:`~diffattn.checkpoint.format.save_checkpoint`). In a folder that exists
    (held by the command: its lock file stays), the checkpoint is first written complete beside what it holds,
    then moved in file by file with the manifest last, so an interrupted write is detected on load (no manifest,
    or a mismatch). Returns the names of the other files, which stay."""

    out = Path(out)
    others = sorted(p.name for p in out.iterdir() if p.name not in (*CHECKPOINT_FILES, LOCK_NAME)) \
        if out.is_dir() else []
    if not out.exists():  # a folder that exists is written into (its lock, held by the command, stays)
        save_checkpoint(out, model, **kw)
        return []
    stage = out / f".convert-{os.getpid()}"
    try:
        save_checkpoint(stage, model, **kw)
        new = sorted(p.name for p in stage.iterdir())
        (out / MANIFEST).unlink(missing_ok=True)
        for name in CHECKPOINT_FILES:  # an older checkpoint's optimizer/rng files must not outlive it
            if name not in new:
                (out / name).unlink(missing_ok=True)
        for name in [n for n in new if n != MANIFEST] + [MANIFEST]:
            os.replace(stage / name, out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return others


def pretrained_files() -> tuple[str, ...]:
    """The files a ``save_pretrained`` folder consists of: what ``--format hub`` writes and may replace."""
    return (SAFETENSORS_SINGLE_FILE, CONFIG_NAME, README, TOKENIZER_FILE)


def write_pretrained_into(out: str | os.PathLike, model: TransformerLM, tokenizer: Any = None) -> list[str]:
    """Save a convert result as a ``save_pretrained`` folder (``diffattn convert --format hub``): weights, config.json,
    a model card and the tokenizer, each file moved into place atomically; ``diffattn.load_pretrained(out)``
    reads it back. Validate ``out`` first (``check_output_dir(owned_patterns=pretrained_files())``). Returns the
    names of the other files in ``out``, which stay."""
    out = Path(out)
    own = pretrained_files()
    others = sorted(p.name for p in out.iterdir() if p.name not in (*own, LOCK_NAME)) if out.is_dir() else []
    model.save_pretrained(out, tokenizer=tokenizer)
    return others


class ConvertRefused(Refused):
    """What ``diffattn convert`` refuses before it writes anything: a type without a recipe, an --out it may not
    use, a source it cannot read or convert (one line, exit 2)."""


def convert_folder(src: str | os.PathLike, out: str | os.PathLike, to: str, *, init: str = "exact",
                   rope: str = "neox", seed: int = 0, fmt: str = "checkpoint", check: bool = False,
                   overwrite: bool = False, note: Callable[[str], None] = lambda line: None,
                   checked: Callable[[str, float], None] = lambda against, err: None) -> str:
    """``diffattn convert SRC --to TYPE --out DIR``: hold ``out`` (as a training run holds its folder), check the
    request and ``out`` (never the source, never an unasked overwrite), read and convert, with ``check`` compare the
    logits (each ``checked(against, max |Δ|)``), write the checkpoint (``fmt`` "checkpoint") or a save_pretrained
    folder ("hub"). Says what else it did or left through ``note``; -> the line saying what it wrote. Raises
    ConvertRefused before anything is written."""
    written = pretrained_files() + CHECKPOINT_FILES
    with ExitStack() as stack:
        try:
            stack.enter_context(OutputFolder(out, "diffattn convert", written=written, quiet=True, source=src))
        except OutputError as e:
            raise ConvertRefused(str(e)) from None
        return _convert_into(Path(out), str(src), to, init, rope, seed, fmt, check, overwrite, note, checked)


def _convert_into(out: Path, src_path: str, to: str, init: str, rope: str, seed: int, fmt: str, check: bool,
                  overwrite: bool, note: Callable[[str], None], checked: Callable[[str, float], None]) -> str:
    try:  # validate first: nothing is loaded, converted or written into a folder that may not be used
        check_request(to, init)  # before anything is read or written: a type without a recipe says why
        owned = pretrained_files() if fmt == "hub" else CHECKPOINT_FILES
        replaced = check_output_dir(out, overwrite=overwrite, owned_patterns=owned, what="convert",
                                    resumable=False, source=src_path, refuse_nonempty=True)
        src, tok, prov = load_source(src_path, rope)
        model = convert(src, to, init, seed=seed, share=True)  # the source is dropped after
        vocab = getattr(tok, "vocab_size", None)
        if vocab is not None and vocab > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} tokens but the model only {model.config.vocab_size}")
    except (ValueError, OSError, CheckpointError, OutputError) as e:
        raise ConvertRefused(str(e)) from None
    if tok is None:
        note(f"note: {src_path} has no tokenizer.json; the checkpoint has no tokenizer")
    checks = source_checks(model, src, seed=seed) if check else None
    for against, err in checks[2] if checks else []:
        checked(against, err)
    if fmt == "hub":
        kept = write_pretrained_into(out, model, tokenizer=tok)
    else:  # a model no run trained: no train or data section
        provenance = {"converted_from": {**prov, "to": to, "init": init, "seed": seed}}
        kept = write_checkpoint_into(out, model, run_config=RunConfig.of_model(model.config), tokenizer=tok,
                                     train_state=provenance)
    if replaced:
        note(f"note: --overwrite: replaced {', '.join(p.name for p in replaced)} in {out}")
    if kept:
        note(f"note: {out} also holds {', '.join(kept[:6])}{', ...' if len(kept) > 6 else ''}: left as they were")
    if (out / LATEST / MANIFEST).is_file():
        note(f"note: commands given {out} now read the converted model; the run in {out / LATEST} is still there "
             f"(give {out / LATEST} to use it)")
    wrote = (f"wrote {out}: {model.config.attention} ({init}), {model.num_params():,} parameters "
             f"(source {src.num_params():,})")
    del model, src  # transformers' copy of the source is read next: one model in memory at a time
    if checks:
        more = transformers_checks(prov, *checks[:2])
        for against, err in more:
            checked(against, err)
        if not checks[2] and not more:
            note("note: --check: the model is the source as it was read; nothing to compare (with a transformers "
                 "folder and transformers installed, it is compared with transformers' model)")
    return wrote
