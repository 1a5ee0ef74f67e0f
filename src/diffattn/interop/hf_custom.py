"""A custom-code transformers folder: what ``diffattn export RUN --to hf`` writes for a model no class of
transformers computes (V2, DA, the rivals, mixed layers, head-selected retrofits, ...).

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads it, offline, without diffattn
installed: ``config.json`` names ``DiffattnConfig`` and ``DiffattnForCausalLM`` in its ``auto_map``, and the
folder holds their modules with the diffattn modules they run (:mod:`diffattn.interop.hf_snapshot`). The weights
are the model's own state dict under ``model.`` (fp32, as the native exports; a tied ``lm_head`` stored once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diffattn.attention.registry import option_fields
from diffattn.interop.hf import require_transformers
from diffattn.interop.hf_snapshot import AUTO_MAP, write_snapshot
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

ARCHITECTURE = "DiffattnForCausalLM"
#: The code files a custom-code folder holds (all an export with --overwrite may replace of them).
CODE_FILES = ("configuration_diffattn.py", "modeling_diffattn.py", "diffattn_*.py")


def config_types(cfg: ModelConfig) -> list[str]:
    """The attention types a model of ``cfg`` names: its layers' and its own (which its config checks)."""
    return sorted({cfg.attention, *cfg.attention_per_layer})


def carried_config(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg`` as the folder's config carries it: its ``attn_options`` narrowed to the options of the types its
    layers use (the snapshot registers only those types; an option of another type is read by none)."""
    used = {n for t in config_types(cfg) for n in option_fields(t)}
    return cfg.replace(attn_options={k: v for k, v in cfg.attn_options.items() if k in used}).to_dict()


def hf_config(cfg: ModelConfig) -> Any:
    """The folder's ``DiffattnConfig`` (``architectures`` and ``auto_map`` set, no special tokens)."""
    require_transformers()
    from diffattn.interop.hf_custom_config import DiffattnConfig  # imports transformers: only when exporting

    config = DiffattnConfig(diffattn=carried_config(cfg), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = [ARCHITECTURE]
    config.auto_map = dict(AUTO_MAP)
    return config


def custom_state_dict(model: TransformerLM) -> dict[str, torch.Tensor]:
    """The weights as the wrapper names them (``model.`` + ours), fp32, contiguous, on the CPU; a tied
    ``lm_head.weight`` left out (transformers ties it back on load)."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {f"model.{k}": v.detach().float().cpu().contiguous() for k, v in state.items()}


def write_custom(model: TransformerLM, stage: Path) -> Any:
    """Write the model's config.json, model.safetensors and code into ``stage``; returns the config."""
    config = hf_config(model.config)
    config.save_pretrained(stage)
    save_file(custom_state_dict(model), str(stage / "model.safetensors"), metadata={"format": "pt"})
    write_snapshot(stage, config_types(model.config))
    return config
