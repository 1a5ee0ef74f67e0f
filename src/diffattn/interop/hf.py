"""Exact conversion between diffattn language models and Hugging Face ``transformers`` models.

``standard`` :class:`~diffattn.model.transformer.TransformerLM` <-> the family it was read from
(``ModelConfig.family``; a model of no family goes to the first family of the table that expresses it:
:mod:`diffattn.checkpoint.hf_family_table`); ``diff`` (V1) <-> ``transformers.DiffLlamaForCausalLM``. Same
weights up to a fixed re-layout (:func:`diffattn.checkpoint.hf_families.weight_layout`: Phi-3's fused
projections, Gemma's four norms, biases, QK-norm); logits agree to float rounding (~1e-6 in fp32). What the target
class cannot express is refused, every reason at once.

``transformers`` is imported lazily, inside the functions, so ``import diffattn`` never pulls it in.

Layout facts the conversion relies on (read off ``transformers`` 5.x ``modeling_diffllama.py``):

* DiffLlama counts *sub-heads*: ``num_attention_heads = 2h`` and ``num_key_value_heads = 2·hkv`` for our
  ``h`` diff-heads and ``hkv`` KV diff-heads, each sub-head of width ``d``. It pairs query sub-head ``i`` (Q1)
  with ``i + h`` (Q2). Its values are split along the KV-head axis into halves ``v[:hkv]``, ``v[hkv:]``, each
  tiled twice; after ``repeat_kv`` query sub-head ``j`` reads KV sub-head ``g = j // n_rep``, and since
  ``h = n_rep·hkv`` the partner ``i + h`` reads ``g + hkv``. So diff-head ``i`` (``g = i // n_rep``) computes
  ``(softmax(q_i k_gᵀ) − λ softmax(q_{i+h} k_{g+hkv}ᵀ)) · [v_g ; v_{g+hkv}]`` (the two value sub-heads
  concatenated to width 2d), then a gain-less RMSNorm over 2d, ``× (1 − λ_init)``, ``o_proj``.
* Ours (the official layout) keeps diff-head ``i``'s Q1, Q2 as adjacent sub-heads ``2i, 2i+1``, KV diff-head
  ``g``'s K1, K2 as ``2g, 2g+1`` and its value head as one 2d-wide block. Hence each of q_proj, k_proj and
  v_proj maps by the same sub-head reordering: rows viewed as ``(n, 2, d, E)`` -> ``(2, n, d, E)``
  (halves first, then heads), with ``n = h`` for q and ``n = hkv`` for k and v.
* Our per-head RMSNorm has a gain; DiffLlama's does not. The gain multiplies the 2d-wide head output right
  before the linear ``out_proj``, so it folds exactly into ``o_proj``'s columns on export; on import it is 1.
* HF applies NeoX (``rotate_half``) RoPE. Interleaved RoPE on a vector equals NeoX RoPE on the vector with its
  coordinates reordered (even ones first, then odd ones), and q·k is unchanged when q and k are reordered
  alike; so for ``rope="interleaved"`` the q/k rows (with their biases and the QK-norm gains) are reordered
  inside each rotated (sub-)head on export.
  On import the caller chooses: ``rope="neox"`` (default, HF's weights as they are) or ``rope="interleaved"``
  (rows reordered back; ours -> HF -> ours then gives back the original q/k weights).
* ``lambda_init`` is not configurable in DiffLlama (always ``0.8 − 0.6·exp(−0.3·layer_idx)``, the same
  schedule as our default ``lambda_init=None``), so a constant ``lambda_init`` is refused. DiffLlama always
  applies its per-head norm, so ``subln=False`` is refused too: a model converted from a Llama by
  :mod:`diffattn.interop.convert` (``--init exact``) has both, and the error lists what DiffLlama cannot express.
* ``head_dim`` (a head width not tied to ``hidden_size``) maps to HF's ``head_dim`` both ways.

:func:`read_hf_folder` reads a local ``save_pretrained`` folder (config.json + safetensors, one file or
sharded) without downloading anything and without instantiating the transformers model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from diffattn.attention.registry import attention_label, unsupported_note
from diffattn.checkpoint.hf_families import (  # the reading half: below the layers that read model folders
    pairs_to_halves,
    permute_within_heads,
    rope_perm,
    rotated,
    weight_layout,
)
from diffattn.checkpoint.hf_family_table import (
    BASE,
    BY_FEATURES,
    DIFF,
    HF_ACTIVATIONS,
    HF_CLASSES,
    Family,
    family_of,
)
from diffattn.checkpoint.hf_folder import build_from_hf, from_hf_config, read_hf_folder
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import MissingExtra

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["export_family", "export_problems", "from_hf", "from_hf_config", "hf_config_dict", "read_hf_folder",
           "to_hf", "to_hf_config"]

TRANSFORMERS = ">=5"  # the version this module's layout facts were read off and tested with; = the hf extra's
#: The attention types transformers has a model for: standard (every family), diff (DiffLlama).
_EXPORTS = {"standard": "the families' own classes", "diff": DIFF.model_class}
#: V1's options that DiffLlama's config expresses (``lambda_std``) or that are refused above when it cannot
#: (``lambda_init``, ``subln``); a standard model does not read them (an old matched baseline carried them).
_V1_SHAPE = ("lambda_init", "subln", "lambda_std")


def require_transformers():
    try:
        import transformers  # optional and slow to import (seconds): only the transformers objects need it
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingExtra(  # an ImportError, and a refusal: one line, exit 2
            f"diffattn.interop.hf needs the `transformers` package ({TRANSFORMERS}); install it with "
            f"`pip install -e \".[hf]\"` in the diffattn checkout, or `pip install \"transformers{TRANSFORMERS}\"`"
        ) from e
    return transformers


# --------------------------------------------------------------------------------------------- configs
def _family_problems(cfg: ModelConfig, f: Family) -> list[str]:
    """What family ``f``'s transformers class cannot express of ``cfg`` (empty: it can)."""
    cls = f.model_class
    problems = [f"{k}={getattr(cfg, k)!r} ({cls} has {v!r})" for k, v in f.fixed().items() if getattr(cfg, k) != v]
    scalar = cfg.query_pre_attn_scalar
    if f.scores_scalar and scalar is not None and not float(scalar).is_integer():
        problems.append(f"query_pre_attn_scalar={scalar} ({cls} takes a whole number)")
    if f.one_attention_bias and cfg.attn_qkv_bias != cfg.attn_out_bias:
        problems.append(f"q/k/v bias {cfg.attn_qkv_bias} but o bias {cfg.attn_out_bias} ({cls} has one "
                        "attention_bias for all four)")
    return problems


def export_family(cfg: ModelConfig) -> str:
    """The transformers family ``cfg`` is written as: DiffLlama for V1, the family it was read from for a
    standard model, else the first family of the table that expresses it (the base, Llama, when none does)."""
    if cfg.attention == "diff":
        return DIFF.model_type
    if cfg.family is not None:
        return cfg.family
    return next((f.model_type for f in BY_FEATURES if not _family_problems(cfg, f)), BASE.model_type)


def export_problems(cfg: ModelConfig) -> list[str]:
    """Every reason ``cfg`` cannot become a transformers model, one phrase each (empty: it can).

    Only standard attention (as its family's class) and V1 (as DiffLlama) map; any other registered type (today's
    V2 and distance-aware ones, and every type added to the registry later) is refused with no change here: with
    the reason its class declares (``unsupported["export"]``) when it has one, else by its report label."""
    problems: list[str] = []
    refuse = problems.append
    if cfg.attention not in _EXPORTS:
        why = (unsupported_note(cfg.attention, "export")
               or f"transformers has no {attention_label(cfg.attention)} attention")
        refuse(f"attention {cfg.attention!r} has no transformers counterpart ({why}; it has "
               f"{' and '.join(f'{v} for {k!r}' for k, v in sorted(_EXPORTS.items()))})")
    family = family_of(export_family(cfg)) if cfg.attention in _EXPORTS else None
    if cfg.attention in _EXPORTS and (family is None or family.diff != (cfg.attention == "diff")):
        refuse(f"family {cfg.family!r} has no transformers class here (known: {sorted(HF_CLASSES)})")
        family = None
    if cfg.rope == "none":
        refuse("rope='none' cannot be expressed: transformers' models always apply RoPE")
    if cfg.dropout:
        refuse(f"dropout={cfg.dropout}: transformers' models have no residual/embedding dropout; use dropout=0")
    if not cfg.causal:
        refuse("causal=False: only causal decoders are supported")
    opts = cfg.options
    if cfg.attention == "diff" and opts.lambda_init is not None:
        refuse(f"lambda_init={opts.lambda_init}: DiffLlama hard-codes the per-depth schedule "
               "0.8 − 0.6·exp(−0.3·depth) (our lambda_init=None); a constant λ_init cannot be expressed")
    if cfg.attention == "diff" and not opts.subln:
        refuse("subln=False: DiffLlama always applies its per-head RMSNorm and the (1 − λ_init) factor")
    stored = {k: v for k, v in cfg.attn_options.items() if k not in _V1_SHAPE}
    if stored and cfg.attention in _EXPORTS:
        refuse(f"attn_options {stored} are not read by {cfg.attention!r} attention and cannot be stored")
    if family is not None:
        problems += _family_problems(cfg, family)
    return problems


def _check_exportable(cfg: ModelConfig) -> None:
    problems = export_problems(cfg)
    if problems:
        family = export_family(cfg) if cfg.attention in _EXPORTS else None
        target = f" ({HF_CLASSES[family]})" if family in HF_CLASSES else ""
        raise ValueError(f"cannot convert to transformers{target}: " + "; ".join(problems))


def _rope_parameters(theta: float, factor: float) -> dict[str, Any]:
    if factor == 1.0:
        return {"rope_type": "default", "rope_theta": float(theta)}
    return {"rope_type": "linear", "factor": float(factor), "rope_theta": float(theta)}


def to_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The transformers config (``LlamaConfig``, ``Qwen2Config``, ..., ``DiffLlamaConfig``) describing the same
    network (:func:`export_family`). Raises ValueError for what that class cannot express (rope none, dropout,
    constant λ_init, an option of another family, ...)."""
    kw = hf_config_dict(cfg)
    return getattr(require_transformers(), family_of(export_family(cfg)).config_class)(**kw)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The arguments of the transformers config class :func:`to_hf_config` builds (its family's keys, from the
    family's record; no transformers needed). Raises ValueError as :func:`to_hf_config` does."""
    _check_exportable(cfg)
    f = family_of(export_family(cfg))
    split = 2 if f.diff else 1  # DiffLlama counts sub-heads
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=split * cfg.n_heads,
        num_key_value_heads=split * cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=_rope_parameters(cfg.rope_theta, cfg.rope_factor), attention_dropout=0.0,
        # Our models have no special tokens; the families' defaults (bos 1, eos 2, ...) would be made up.
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw[f.activation_key] = HF_ACTIVATIONS[f.activation]
    if f.head_dim_key:
        kw["head_dim"] = cfg.qk_head_dim
    if f.diff:
        kw["lambda_std_dev"] = cfg.options.lambda_std
    if f.one_attention_bias:
        kw["attention_bias"] = cfg.attn_qkv_bias
    if f.bias == "attention_mlp":
        kw["mlp_bias"] = cfg.bias
    types = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layers)]
    if f.window == "every_layer":
        kw["sliding_window"] = cfg.sliding_window
    elif f.window == "qwen":
        kw.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                  layer_types=types)
    elif f.window == "gemma":  # a window over the whole context when no layer has one
        kw.update(sliding_window=cfg.sliding_window or cfg.max_seq_len, layer_types=types)
    if f.local_rope:
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        kw["rope_parameters"] = {"full_attention": kw["rope_parameters"],
                                 "sliding_attention": _rope_parameters(local, 1.0)}
    if f.scores_scalar:
        kw["query_pre_attn_scalar"] = int(cfg.query_pre_attn_scalar or cfg.qk_head_dim)
    return kw


# --------------------------------------------------------------------------------------------- weights
def export_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    """``model``'s weights under its transformers family's names and layout (:func:`export_family`; what
    :func:`to_hf` loads): Phi-3's projections fused, q/k rows reordered for the interleaved RoPE layout, V1's
    sub-heads in DiffLlama's order with its per-head norm's gain folded into ``o_proj``; ``shared_qk`` (K = Q)
    written out as a key projection equal to the query projection."""
    cfg = model.config
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if getattr(cfg, "shared_qk", False):
        for i in range(cfg.n_layers):
            p = f"body.blocks.{i}.attn."
            for name in [n for n in state if n.startswith((p + "q_proj.", p + "q_norm."))]:
                state[p + "k" + name[len(p) + 1:]] = state[name]
    layout_cfg = cfg.replace(family=export_family(cfg))
    d = cfg.qk_head_dim
    perm = rope_perm(d)
    out: dict[str, Tensor] = {}
    for entry in weight_layout(layout_cfg):
        parts = []
        for name in entry.ours:
            t = state[name]
            if cfg.rope == "interleaved" and rotated(name):
                t = permute_within_heads(t, d, perm)
            parts.append(pairs_to_halves(t, d) if entry.pairs else t)
        out[entry.hf] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    if cfg.attention == "diff":  # out_proj(gain ⊙ norm(x)) == (out_proj · diag(gain tiled over heads))(norm(x))
        for i, block in enumerate(model.blocks):
            o = f"model.layers.{i}.self_attn.o_proj.weight"
            gain = state[f"body.blocks.{i}.attn.subln.weight"].to(out[o].dtype)
            out[o] = out[o] * gain.repeat(block.attn.num_heads)[None, :]
    return out


_export_state_dict = export_state_dict  # the name tests/faults/hostile.py imports


def to_hf(model: TransformerLM, attn_implementation: str | None = None) -> PreTrainedModel:
    """A ``transformers`` model computing the same logits as ``model`` (a ``standard`` model as its family's
    class, a ``diff`` one as ``DiffLlamaForCausalLM``), in eval mode, on the same device and dtype.
    ``attn_implementation`` ("eager", "sdpa", ...) is passed to transformers (None: its default). The weights are
    copies; ``model`` is not modified."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"to_hf converts a diffattn TransformerLM, got {type(model).__name__}")
    cfg = model.config
    hf_config = to_hf_config(cfg)
    tf = require_transformers()
    cls = getattr(tf, family_of(export_family(cfg)).model_class)
    ref = model.lm_head.weight
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf = cls._from_config(hf_config, dtype=ref.dtype, **kwargs)
    state = export_state_dict(model)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if missing or unexpected:  # every HF parameter must come from us, and nothing of ours may be dropped
        raise RuntimeError(f"to_hf: state dict mismatch; missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("to_hf: transformers did not tie lm_head to embed_tokens")
    return hf.to(ref.device).eval()


def from_hf(hf_model: PreTrainedModel, rope: str = "neox") -> TransformerLM:
    """The :class:`TransformerLM` computing the same logits as a transformers model of a family diffattn reads
    (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ..., -> ``standard``; ``DiffLlamaForCausalLM`` -> ``diff``).
    ``rope``: our RoPE layout, "neox" (transformers' q/k weights as they are) or "interleaved" (q/k rows
    reordered inside each head; exact too). The per-head norm gains of a ``diff`` model are 1 (DiffLlama's norm
    has none). Same dtype and device as ``hf_model``; eval mode."""
    if type(hf_model).__name__ not in HF_CLASSES.values():
        raise TypeError(f"from_hf converts {', '.join(sorted(HF_CLASSES.values()))}, got {type(hf_model).__name__}")
    cfg = from_hf_config(hf_model.config, rope=rope)
    src = {k: v.detach() for k, v in hf_model.state_dict().items()}
    ref = hf_model.lm_head.weight
    return build_from_hf(cfg, src.keys(), src.__getitem__, rope, ref.device, ref.dtype)
