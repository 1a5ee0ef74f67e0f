"""Exact conversion between diffattn language models and Hugging Face ``transformers`` models.

``standard`` :class:`~diffattn.model.transformer.TransformerLM` <-> ``transformers.LlamaForCausalLM``;
``diff`` (V1) :class:`~diffattn.model.transformer.TransformerLM` <-> ``transformers.DiffLlamaForCausalLM``.
Same weights up to a fixed re-layout; logits agree to float rounding (~1e-6 in fp32).

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
  alike; so for ``rope="interleaved"`` the q/k rows are reordered inside each rotated (sub-)head on export.
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

from torch import Tensor

from diffattn.attention.registry import attention_label, unsupported_note
from diffattn.checkpoint.hf_folder import (  # the reading half: below the layers that read model folders
    _GLOBAL_NAMES,
    _LAMBDAS,
    _build_from_hf_state,
    _layer_names,
    _pairs_to_halves,
    _permute_within_heads,
    _rope_perm,
    from_hf_config,
    read_hf_folder,
)
from diffattn.fileio import MissingExtra
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["export_problems", "from_hf", "from_hf_config", "read_hf_folder", "to_hf", "to_hf_config"]

TRANSFORMERS = ">=5"  # the version this module's layout facts were read off and tested with; = the hf extra's
_HF_CLASS = {"standard": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}


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
def export_problems(cfg: ModelConfig) -> list[str]:
    """Every reason ``cfg`` cannot become a transformers Llama / DiffLlama, one phrase each (empty: it can).

    Only the attention types in ``_HF_CLASS`` map; any other registered type (today's V2 and distance-aware
    ones, and every type added to the registry later) is refused with no change here: with the reason its class
    declares (``unsupported["export"]``) when it has one, else by its report label."""
    problems: list[str] = []
    refuse = problems.append
    if cfg.attention not in _HF_CLASS:
        why = (unsupported_note(cfg.attention, "export")
               or f"transformers has no {attention_label(cfg.attention)} attention")
        refuse(f"attention {cfg.attention!r} has no transformers counterpart ({why}; it has "
               f"{' and '.join(f'{_HF_CLASS[k]} for {k!r}' for k in sorted(_HF_CLASS))})")
    if cfg.rope == "none":
        refuse("rope='none' cannot be expressed: Llama/DiffLlama always apply RoPE")
    if cfg.bias:
        refuse("bias=True: our biases cover the attention projections and the MLP together, and DiffLlama "
               "has no MLP bias option; only bias=False is supported")
    if cfg.dropout:
        refuse(f"dropout={cfg.dropout}: Llama/DiffLlama have no residual/embedding dropout; use dropout=0")
    if not cfg.causal:
        refuse("causal=False: only causal decoders are supported")
    if cfg.attention == "diff" and cfg.lambda_init is not None:
        refuse(f"lambda_init={cfg.lambda_init}: DiffLlama hard-codes the per-depth schedule "
               "0.8 − 0.6·exp(−0.3·depth) (our lambda_init=None); a constant λ_init cannot be expressed")
    if cfg.attention == "diff" and not cfg.subln:
        refuse("subln=False: DiffLlama always applies its per-head RMSNorm and the (1 − λ_init) factor")
    if cfg.attn_options and cfg.attention in _HF_CLASS:
        refuse(f"attn_options {cfg.attn_options} are not read by {cfg.attention!r} attention "
               "and cannot be stored")
    return problems


def _check_exportable(cfg: ModelConfig) -> None:
    problems = export_problems(cfg)
    if problems:
        target = f" ({_HF_CLASS[cfg.attention]})" if cfg.attention in _HF_CLASS else ""
        raise ValueError(f"cannot convert to transformers{target}: " + "; ".join(problems))


def to_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The ``LlamaConfig`` (``standard``) or ``DiffLlamaConfig`` (``diff``) describing the same network.

    Raises ValueError for settings HF cannot express (rope none, bias, dropout, constant λ_init, ...).
    """
    _check_exportable(cfg)
    tf = require_transformers()
    split = 2 if cfg.attention == "diff" else 1  # DiffLlama counts sub-heads
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=split * cfg.n_heads,
        num_key_value_heads=split * cfg.kv_heads,
        head_dim=cfg.qk_head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        attention_dropout=0.0,
        # Our models have no special tokens; Llama's defaults (bos 1, eos 2) would be made up.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if cfg.attention == "diff":
        return tf.DiffLlamaConfig(**common, lambda_std_dev=cfg.lambda_std)
    return tf.LlamaConfig(**common, mlp_bias=False)




# --------------------------------------------------------------------------------------------- weights




def _export_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {hf: sd[ours] for ours, hf in _GLOBAL_NAMES}
    for i, block in enumerate(model.blocks):
        attn = block.attn
        out.update({hf: sd[ours] for ours, hf in _layer_names(i)})
        p, q = f"body.blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        d = attn.head_dim
        # shared_qk (K = Q, no k_proj of its own): exported exactly as a k_proj equal to q_proj.
        wk_name = p + ("q_proj" if getattr(cfg, "shared_qk", False) else "k_proj") + ".weight"
        wq, wk, wv, wo = sd[p + "q_proj.weight"], sd[wk_name], sd[p + "v_proj.weight"], sd[p + "out_proj.weight"]
        if cfg.rope == "interleaved":
            perm = _rope_perm(d)
            wq, wk = _permute_within_heads(wq, d, perm), _permute_within_heads(wk, d, perm)
        if cfg.attention == "diff":
            wq, wk, wv = _pairs_to_halves(wq, d), _pairs_to_halves(wk, d), _pairs_to_halves(wv, d)
            # out_proj(gain ⊙ norm(x)) == (out_proj · diag(gain tiled over heads))(norm(x)).
            gain = sd[p + "subln.weight"].to(wo.dtype)
            wo = wo * gain.repeat(attn.num_heads)[None, :]
            out.update({q + n: sd[p + n] for n in _LAMBDAS})
        out.update({q + "q_proj.weight": wq, q + "k_proj.weight": wk, q + "v_proj.weight": wv,
                    q + "o_proj.weight": wo})
    return out


def to_hf(model: TransformerLM, attn_implementation: str | None = None) -> PreTrainedModel:
    """A ``transformers`` model computing the same logits as ``model`` (a ``standard`` or ``diff``
    :class:`TransformerLM`): ``LlamaForCausalLM`` or ``DiffLlamaForCausalLM``, in eval mode, on the same
    device and dtype. ``attn_implementation`` ("eager", "sdpa", ...) is passed to transformers (None: its
    default). The weights are copies; ``model`` is not modified."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"to_hf converts a diffattn TransformerLM, got {type(model).__name__}")
    cfg = model.config
    hf_config = to_hf_config(cfg)
    tf = require_transformers()
    cls = getattr(tf, _HF_CLASS[cfg.attention])
    ref = model.lm_head.weight
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    hf = cls._from_config(hf_config, dtype=ref.dtype, **kwargs)
    sd = _export_state_dict(model)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if missing or unexpected:  # every HF parameter must come from us, and nothing of ours may be dropped
        raise RuntimeError(f"to_hf: state dict mismatch; missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("to_hf: transformers did not tie lm_head to embed_tokens")
    return hf.to(ref.device).eval()


def from_hf(hf_model: PreTrainedModel, rope: str = "neox") -> TransformerLM:
    """The :class:`TransformerLM` computing the same logits as a ``LlamaForCausalLM`` (-> ``standard``) or a
    ``DiffLlamaForCausalLM`` (-> ``diff``). ``rope``: our RoPE style, "neox" (HF's q/k weights as they are) or
    "interleaved" (q/k rows reordered inside each head; exact too). The per-head norm gains of a ``diff``
    model are 1 (DiffLlama's norm has none). Same dtype and device as ``hf_model``; eval mode."""
    tf = require_transformers()
    if not isinstance(hf_model, (tf.LlamaForCausalLM, tf.DiffLlamaForCausalLM)):
        raise TypeError("from_hf converts LlamaForCausalLM or DiffLlamaForCausalLM, "
                        f"got {type(hf_model).__name__}")
    cfg = from_hf_config(hf_model.config, rope=rope)
    src = {k: v.detach() for k, v in hf_model.state_dict().items()}
    ref = hf_model.lm_head.weight
    return _build_from_hf_state(cfg, src, rope, ref.device, ref.dtype)














