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

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from diffattn.attention.registry import ATTENTION, attention_label
from diffattn.fileio import confined, printable
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.transformer import TransformerLM

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["export_problems", "from_hf", "from_hf_config", "read_hf_folder", "to_hf", "to_hf_config"]

TRANSFORMERS = ">=5"  # the version this module's layout facts were read off and tested with; = the hf extra's
_HF_CLASS = {"standard": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}
_MODEL_TYPE = {"llama": "standard", "diffllama": "diff"}


def require_transformers():
    try:
        import transformers  # optional and slow to import (seconds): only the transformers objects need it
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"diffattn.interop.hf needs the `transformers` package ({TRANSFORMERS}); install it with "
            f"`pip install -e \".[hf]\"` in the diffattn checkout, or `pip install \"transformers{TRANSFORMERS}\"`"
        ) from e
    return transformers


# ------------------------------------------------------------------------------------------ row layouts
def _rope_perm(d: int) -> Tensor:
    """perm (d,) with neox_vec = interleaved_vec[perm]: even coordinates first, then odd ones."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))


def _permute_within_heads(w: Tensor, d: int, perm: Tensor) -> Tensor:
    """Reorder the d rows of every head of a projection weight w: (n·d, E) by ``perm`` (d,)."""
    n = w.shape[0] // d
    return w.reshape(n, d, -1)[:, perm.to(w.device)].reshape(w.shape)


def _pairs_to_halves(w: Tensor, d: int) -> Tensor:
    """Official -> DiffLlama sub-head order. w: (2n·d, E) with sub-heads [a0, b0, a1, b1, ...] ->
    [a0, a1, ..., b0, b1, ...]."""
    n = w.shape[0] // (2 * d)
    return w.reshape(n, 2, d, -1).transpose(0, 1).reshape(w.shape)


def _halves_to_pairs(w: Tensor, d: int) -> Tensor:
    """DiffLlama -> official sub-head order (inverse of :func:`_pairs_to_halves`)."""
    n = w.shape[0] // (2 * d)
    return w.reshape(2, n, d, -1).transpose(0, 1).reshape(w.shape)


# --------------------------------------------------------------------------------------------- configs
def export_problems(cfg: ModelConfig) -> list[str]:
    """Every reason ``cfg`` cannot become a transformers Llama / DiffLlama, one phrase each (empty: it can).

    Only the attention types in ``_HF_CLASS`` map; any other registered type (today's V2 and distance-aware
    ones, and every type added to the registry later) is refused with no change here: with the reason its class
    declares as ``export_note`` when it has one, else by its report label."""
    problems: list[str] = []
    refuse = problems.append
    if cfg.attention not in _HF_CLASS:
        why = (getattr(ATTENTION.get(cfg.attention), "export_note", None)
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


def from_hf_config(hf_config: PretrainedConfig, rope: str = "neox") -> ModelConfig:
    """The :class:`ModelConfig` of a ``LlamaConfig`` / ``DiffLlamaConfig``. ``rope`` picks our RoPE style
    ("neox" or "interleaved"); both are exact, see the module docstring. Raises ValueError for HF settings
    our models cannot express (RoPE scaling, biases, another activation, a head_dim that does not divide
    hidden_size, ...)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _MODEL_TYPE:
        raise ValueError(f"cannot convert a transformers config of model_type {model_type!r}; "
                         f"supported: {sorted(_MODEL_TYPE)}")
    if rope not in ("neox", "interleaved"):
        raise ValueError(f"rope must be 'neox' or 'interleaved', got {rope!r}")
    attention = _MODEL_TYPE[model_type]

    def refuse(msg: str) -> None:
        raise ValueError(f"cannot convert {type(hf_config).__name__}: {msg}")

    if hf_config.hidden_act != "silu":
        refuse(f"hidden_act={hf_config.hidden_act!r}; our MLP is SwiGLU (silu)")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        refuse("attention_bias / mlp_bias are set; only bias-free models are supported")
    if getattr(hf_config, "attention_dropout", 0.0):
        refuse(f"attention_dropout={hf_config.attention_dropout}; only 0 is supported")
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rp.get("rope_type", "default") != "default":
        refuse(f"rope_type={rp.get('rope_type')!r}; only plain RoPE ('default') is supported")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor={rp['partial_rotary_factor']}; only full-width RoPE is supported")
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        refuse("no rope_theta found in rope_parameters")

    split = 2 if attention == "diff" else 1
    n_sub = hf_config.num_attention_heads
    n_kv_sub = hf_config.num_key_value_heads or n_sub
    if n_sub % split or n_kv_sub % split:
        refuse(f"DiffLlama needs even num_attention_heads / num_key_value_heads, got {n_sub} / {n_kv_sub}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_sub
    n_heads, kv = n_sub // split, n_kv_sub // split
    lambda_std = getattr(hf_config, "lambda_std_dev", None)  # Llama has none: keep our default
    cfg = ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=None if kv == n_heads else kv,
        attention=attention,
        max_seq_len=hf_config.max_position_embeddings,
        rope=rope,
        rope_theta=float(theta),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        norm_eps=float(hf_config.rms_norm_eps),
        init_std=float(hf_config.initializer_range),
        lambda_std=0.1 if lambda_std is None else float(lambda_std),
        # keep head_dim=None when it is the derived width, so configs round-trip unchanged
        head_dim=None if head_dim * n_sub == hf_config.hidden_size else int(head_dim),
    )
    # Keep ffn_hidden=None when it is our default, so configs round-trip unchanged.
    if cfg.ffn_dim != hf_config.intermediate_size:
        cfg = cfg.replace(ffn_hidden=int(hf_config.intermediate_size))
    return cfg


# --------------------------------------------------------------------------------------------- weights
def _layer_names(i: int) -> list[tuple[str, str]]:
    """(ours, HF) names of the per-layer tensors that copy across unchanged."""
    ours, hf = f"body.blocks.{i}.", f"model.layers.{i}."
    return [
        (ours + "attn_norm.weight", hf + "input_layernorm.weight"),
        (ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight"),
        (ours + "ffn.gate_proj.weight", hf + "mlp.gate_proj.weight"),
        (ours + "ffn.up_proj.weight", hf + "mlp.up_proj.weight"),
        (ours + "ffn.down_proj.weight", hf + "mlp.down_proj.weight"),
    ]


_GLOBAL_NAMES = [("body.tok_emb.weight", "model.embed_tokens.weight"),
                 ("body.norm.weight", "model.norm.weight"),
                 ("lm_head.weight", "lm_head.weight")]
_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


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


def read_hf_folder(path: str | os.PathLike, rope: str = "neox") -> TransformerLM:
    """The :class:`TransformerLM` of a local transformers folder (``save_pretrained`` output: config.json and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``) of a ``llama`` or ``diffllama``
    model, in fp32 on the CPU, eval mode. Nothing is downloaded. Raises ValueError naming what is missing or
    what our models cannot express."""
    folder = Path(path)
    if not confined(folder, "config.json").is_file():
        raise ValueError(f"{folder}: not a transformers model folder (no config.json)")
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/config.json: not valid JSON: {printable(e)}") from None
    cfg = from_hf_config(_config_namespace(raw), rope=rope)
    files = weight_files(folder)
    check_fits(cfg, str(folder), copies=2)  # the files' tensors in fp32 and the model: refused before either
    src: dict[str, Tensor] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    src[key] = f.get_tensor(key).float()
        except (SafetensorError, OSError) as e:  # an empty or truncated file
            raise ValueError(f"{folder / printable(name)}: not a readable safetensors file "
                             f"({printable(str(e).splitlines()[0] if str(e) else type(e).__name__)})") from None
    return _build_from_hf_state(cfg, src, rope, torch.device("cpu"), torch.float32)


INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a transformers folder: ``model.safetensors``, or those the index's
    ``weight_map`` names, each a plain file name inside the folder (no ``..``, no path, no link out of it but
    into a Hugging Face cache's blobs/), checked before any is opened. ValueError (UnsafePath) otherwise."""
    if confined(folder, INDEX).is_file():
        try:
            index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
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


# transformers' LlamaConfig defaults for keys an older or hand-written config.json may leave out
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02, "head_dim": None,
    "max_position_embeddings": 2048, "lambda_std_dev": None,
}


def _config_namespace(raw: dict[str, Any]) -> Any:
    """A config.json dict as the attribute object :func:`from_hf_config` reads, without importing transformers
    (seconds of start-up): LlamaConfig's defaults for absent keys; old-style ``rope_theta``/``rope_scaling``
    folded into ``rope_parameters``."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    need = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads"]
    missing = [k for k in need if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    d = {**_LLAMA_DEFAULTS, **raw}
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    if not d.get("rope_parameters"):
        scaling = dict(d.get("rope_scaling") or {})
        if "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        d["rope_parameters"] = {"rope_type": "default", **scaling, "rope_theta": float(d.get("rope_theta", 10000.0))}
    return SimpleNamespace(**d)


def _build_from_hf_state(cfg: ModelConfig, src: dict[str, Tensor], rope: str, device: torch.device,
                         dtype: torch.dtype) -> TransformerLM:
    """Our model from an HF state dict ``src`` (HF names) of the network ``cfg`` describes."""
    if cfg.tie_embeddings:  # HF may leave the tied alias out of its state dict
        src.setdefault("lm_head.weight", src["model.embed_tokens.weight"])
    try:
        sd = _import_state_dict(cfg, src, rope)
    except KeyError as e:
        raise ValueError(f"HF weights lack {e.args[0]!r} (needed for {cfg.n_layers} layers)") from None
    with torch.device(device):
        model = TransformerLM(cfg)
    model.load_state_dict(sd, strict=True)
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval()


def _import_state_dict(cfg: ModelConfig, src: dict[str, Tensor], rope: str) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {ours: src[hf] for ours, hf in _GLOBAL_NAMES}
    d = cfg.qk_head_dim
    inv_perm = torch.argsort(_rope_perm(d))
    for i in range(cfg.n_layers):
        sd.update({ours: src[hf] for ours, hf in _layer_names(i)})
        p, q = f"body.blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        wq, wk, wv, wo = (src[q + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if cfg.attention == "diff":
            wq, wk, wv = _halves_to_pairs(wq, d), _halves_to_pairs(wk, d), _halves_to_pairs(wv, d)
            sd.update({p + n: src[q + n] for n in _LAMBDAS})
            sd[p + "subln.weight"] = torch.ones(2 * d, dtype=wo.dtype, device=wo.device)
        if rope == "interleaved":
            wq, wk = _permute_within_heads(wq, d, inv_perm), _permute_within_heads(wk, d, inv_perm)
        sd.update({p + "q_proj.weight": wq, p + "k_proj.weight": wk, p + "v_proj.weight": wv,
                   p + "out_proj.weight": wo})
    return sd
