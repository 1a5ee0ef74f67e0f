"""Read a local transformers folder of a family diffattn speaks (``save_pretrained`` output: config.json and
safetensors, one file or sharded; the families: :mod:`diffattn.checkpoint.hf_family_table`) as our
:class:`~diffattn.model.transformer.TransformerLM`, without transformers and without downloading anything, so
every command that reads a model folder reads the model a user brings, and what it was converted to.

Their configs and weight layouts are read by :mod:`diffattn.checkpoint.hf_families`; DiffLlama's layout facts
(sub-head order, the per-head norm's gain, ``lambda_init``) are set out in :mod:`diffattn.interop.hf`, which writes
such folders with these same layouts. The weight files a folder names are plain names inside it
(:func:`weight_files`), checked before any is opened; the model is checked against the machine before it is
built, then built without values and filled one tensor at a time, each read with one ``readinto`` and no memory
map (:class:`~diffattn.checkpoint.tensor_files.Reader`; streamed: the memory of the model and of its largest
tensor, never the whole file beside the model); every tensor's shape is checked against the config, and a tensor
the config does not describe is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diffattn.checkpoint.hf_families import (
    IGNORED_SUFFIXES,
    FamilyError,
    family_config,
    halves_to_pairs,
    permute_within_heads,
    rope_perm,
    rotated,
    weight_layout,
)
from diffattn.checkpoint.hf_family_table import BASE
from diffattn.checkpoint.tensor_files import Reader, TensorFileError
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.tokenizer import HFTokenizer
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import confined, printable, read_json

INDEX = "model.safetensors.index.json"
#: The files that say a transformers folder has a tokenizer: its ``tokenizer.json`` is then what diffattn reads.
TOKENIZER_SIGNS = ("tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def from_hf_config(hf_config: Any, rope: str = "neox") -> ModelConfig:
    """The :class:`ModelConfig` of a transformers config (a config object, or a config.json dict) of a family
    diffattn reads (:mod:`diffattn.checkpoint.hf_families`). ``rope``: our RoPE layout, "neox" or "interleaved"
    (both exact). Raises ValueError for what our models cannot express (the family, RoPE scaling other than
    linear, soft-capping, ...)."""
    return family_config(hf_config, rope=rope)


def read_config_json(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of a transformers folder as a dict (ValueError: missing, a link out, not JSON)."""
    if not confined(folder, "config.json").is_file():
        raise ValueError(f"{folder}: not a transformers model folder (no config.json)")
    try:
        raw = read_json(folder / "config.json")
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/config.json: not valid JSON: {printable(e)}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{folder}/config.json must hold a JSON object")
    return raw


def read_hf_folder(path: str | os.PathLike, rope: str = "neox") -> TransformerLM:
    """The :class:`TransformerLM` of a local transformers folder (``save_pretrained`` output: config.json and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``) of a family diffattn reads, in fp32 on
    the CPU, eval mode. Nothing is downloaded. Raises ValueError naming what is missing, what our models cannot
    express, or where the weights and the config disagree."""
    folder = Path(path)
    raw = read_config_json(folder)
    try:
        cfg = from_hf_config(raw, rope=rope)
    except FamilyError:
        raise
    except ValueError as e:  # ModelConfig's own check: an absurd value (a window of 0, a negative base, ...)
        raise FamilyError(f"{folder}/config.json: {printable(e)}") from None
    files = weight_files(folder)
    check_fits(cfg, str(folder), copies=1)  # the model; its tensors are read one at a time
    readers: dict[str, Reader] = {}
    where: dict[str, Reader] = {}
    try:
        for name in files:
            try:  # no memory map: its touched pages would stay resident beside the model
                readers[name] = Reader(folder / name)
            except OSError as e:
                raise ValueError(f"{folder / printable(name)}: not readable ({printable(e)})") from None
            except TensorFileError as e:  # an empty or truncated file, a header that does not describe it
                raise ValueError(f"{folder}: not a readable safetensors file: {printable(e)}") from None
            where.update(dict.fromkeys(readers[name].entries, readers[name]))

        def get(key: str) -> Tensor:
            try:
                return where[key].read(key)
            except (TensorFileError, OSError) as e:
                raise ValueError(f"{folder}: {printable(key)} is not readable ({printable(e)})") from None

        return build_from_hf(cfg, where.keys(), get, rope)
    finally:
        for r in readers.values():
            r.close()


def read_tokenizer(path: str | os.PathLike) -> HFTokenizer | None:
    """The tokenizer of a transformers folder: its ``tokenizer.json`` (the fast tokenizer), or None when the folder
    has no tokenizer at all (a model saved alone). A folder that has one (``tokenizer_config.json``, a
    SentencePiece ``tokenizer.model``) but no ``tokenizer.json`` is refused (ValueError, one line), so no command
    runs on a model without the tokenizer it was meant to have."""
    folder = Path(path)
    f = confined(folder, "tokenizer.json")
    if f.is_file():
        return HFTokenizer.from_file(f)
    signs = [s for s in TOKENIZER_SIGNS if confined(folder, s).is_file()]
    if signs:
        raise ValueError(f"{folder}: it has {', '.join(signs)} but no tokenizer.json, the tokenizer file diffattn "
                         "reads; write it with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    return None


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a transformers folder: ``model.safetensors``, or those the index's
    ``weight_map`` names, each a plain file name inside the folder (no ``..``, no path, no link out of it but
    into a Hugging Face cache's blobs/), checked before any is opened. ValueError (UnsafePath) otherwise."""
    if confined(folder, INDEX).is_file():
        try:
            index = read_json(folder / INDEX)
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder / INDEX}: not valid JSON: {printable(e)}") from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ValueError(f"{folder / INDEX}: no \"weight_map\" object naming the weight files; the folder is "
                             "damaged or not a transformers model")
        files: set[str] = set()
        for v in wmap.values():
            if not (isinstance(v, str) and v in files):
                files.add(confined(folder, v, what=f"{INDEX} weight file").name)
        return sorted(files)
    if confined(folder, "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(f"{folder}: no model.safetensors or {INDEX} (only safetensors weights are read; nothing is "
                     "unpickled)")


def empty_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> TransformerLM:
    """``TransformerLM(cfg)`` in fp32 on ``device`` with its parameters allocated and not set (built on the meta
    device: no initialisation drawn), its buffers (RoPE tables, λ scales) computed, embeddings tied as asked."""
    with torch.device("meta"):
        model = TransformerLM(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty re-creates parameters one module at a time, which unties them
        model.lm_head.weight = model.body.tok_emb.weight
    with torch.no_grad():
        for m in model.modules():
            if any(b is not None for b in m._buffers.values()):
                m.reset_parameters()  # RoPE tables, λ scales (a module's parameters are set from the weights next)
    return model


def build_from_hf(cfg: ModelConfig, names: Iterable[str], get: Callable[[str], Tensor], rope: str,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> TransformerLM:
    """Our model of ``cfg`` from the transformers tensors ``names`` (``get(name)`` reads one), streamed: each is
    read, checked against the config's shape, re-laid out (Phi-3's fused rows split, DiffLlama's sub-heads
    reordered, q/k rows for ``rope="interleaved"``) and copied in before the next is read. Raises ValueError for a
    missing tensor, a shape the config does not describe, or a tensor it has no place for."""
    names = set(names)
    model = empty_model(cfg, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    layout = weight_layout(cfg)
    d = cfg.qk_head_dim
    perm = torch.argsort(rope_perm(d))
    with torch.no_grad():
        for entry in layout:
            if entry.hf not in names:
                raise ValueError(f"the weights lack {printable(entry.hf)} (the config describes "
                                 f"{cfg.n_layers} layers{_features(cfg)})")
            t = get(entry.hf)
            targets = [params[o] for o in entry.ours]
            rows = [p.shape[0] for p in targets]
            want = (sum(rows), *targets[0].shape[1:])
            if tuple(t.shape) != want:
                raise ValueError(f"{printable(entry.hf)} has shape {tuple(t.shape)} in the weights, but the config "
                                 f"describes {want}: config.json and the weights disagree")
            for o, part in zip(entry.ours, torch.split(t, rows)):
                part = part.to(torch.float32)
                if entry.pairs:
                    part = halves_to_pairs(part, d)
                if rope == "interleaved" and rotated(o):
                    part = permute_within_heads(part, d, perm)
                params[o].copy_(part)
                filled.add(o)
            del t
        _check_rest(cfg, names, {e.hf for e in layout}, get)
    created = {n for n in params if n.endswith("attn.subln.weight")}  # DiffLlama's norm has no gain: ours is 1
    with torch.no_grad():
        for n in created:
            params[n].fill_(1.0)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unset = sorted(set(params) - filled - created - tied)
    if unset:  # every parameter must come from the weights (a layout that misses one is a bug, not bad input)
        raise RuntimeError(f"read_hf_folder: no value for {unset[:4]}")
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval()


def _check_rest(cfg: ModelConfig, names: set[str], used: set[str], get: Callable[[str], Tensor]) -> None:
    """The tensors no entry read: a tied ``lm_head`` equal to the embeddings and RoPE's saved tables are fine;
    anything else is a part of a model the config does not describe."""
    rest = sorted(n for n in names - used if not n.endswith(IGNORED_SUFFIXES))
    if cfg.tie_embeddings and "lm_head.weight" in rest:
        rest.remove("lm_head.weight")
        if not torch.equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
            raise ValueError("config.json ties the embeddings (tie_word_embeddings) but the weights hold an "
                             "lm_head.weight that differs from model.embed_tokens.weight")
    if rest:
        more = f" (and {len(rest) - 1} more)" if len(rest) > 1 else ""
        raise ValueError(f"the weights hold {printable(rest[0])}{more}, which the config's model does not have "
                         f"({cfg.family or BASE.model_type}{_features(cfg)}): config.json and the weights disagree")


def _features(cfg: ModelConfig) -> str:
    """The config's options that decide which tensors there are, named when weights and config disagree."""
    said = [f"{'' if on else 'no '}{what}" for on, what in ((cfg.attn_qkv_bias, "q/k/v biases"),
                                                            (cfg.attn_out_bias, "o bias"), (cfg.bias, "MLP biases"))]
    if cfg.qk_norm:
        said.append("QK-norm")
    return ", " + ", ".join(said)
