"""The transformers families diffattn reads: a ``config.json`` as a :class:`ModelConfig`, and where each of the
model's tensors lies in the family's weights (:func:`weight_layout`). No transformers import: every command reads
a user's model folder in milliseconds, and transformers' own config classes are the oracle in the tests.

The families, their defaults and their options are the records of :mod:`diffattn.checkpoint.hf_family_table`;
this module reads a config through them and names no family. What a family config asks that our models cannot
compute (another RoPE scaling than linear, partial rotary embeddings, logit soft-capping, bidirectional Gemma, an
activation we do not have) is refused in one line naming it. A key a config.json leaves out takes the transformers
config class's default (``Family.defaults``; a test holds them equal to transformers').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from diffattn.checkpoint.hf_family_table import FAMILIES, HF_ACTIVATIONS, Family, family_of
from diffattn.model.config import ModelConfig
from diffattn.system.untrusted import Refused, printable

_ACTIVATIONS = {hf: ours for ours, hf in HF_ACTIVATIONS.items()}  # transformers' name -> ours
_NEEDED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads")


class FamilyError(Refused):
    """A transformers config diffattn cannot read (one line: what it asks, and why not)."""


def family_config(raw: Any, rope: str = "neox") -> ModelConfig:
    """The :class:`ModelConfig` of a transformers ``config.json`` (a dict; or a transformers config object, read
    through its ``to_dict()``). ``rope``: our RoPE layout, "neox" (transformers' own) or "interleaved" (q/k rows
    reordered inside each head on reading; exact too). Raises :class:`FamilyError` (a ValueError) for a family or
    an option our models cannot compute, or a field of the wrong kind."""
    if hasattr(raw, "to_dict") and not isinstance(raw, dict):
        raw = raw.to_dict()
    if not isinstance(raw, dict):
        raise FamilyError("config.json must hold a JSON object")
    family = raw.get("model_type")
    f = family_of(family)
    if f is None:
        raise FamilyError(f"cannot read a transformers config of model_type {family!r}; supported: "
                          f"{', '.join(sorted(FAMILIES))}")
    missing = [k for k in _NEEDED if raw.get(k) is None]
    if missing:
        raise FamilyError(f"config.json lacks {missing} (model_type {family}; null counts as missing)")
    if rope not in ("neox", "interleaved"):
        raise FamilyError(f"rope must be 'neox' or 'interleaved', got {rope!r}")
    d = {**f.defaults, **{k: v for k, v in raw.items() if v is not None or k in _NULLABLE}}
    _check_kinds(family, d)
    try:
        return _read(f, d, rope)
    except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong kind (a string for a number, ...)
        raise FamilyError(f"config.json ({family}): a field is malformed ({type(e).__name__}: {e})") from None


# keys whose null means something (no window, no soft-capping, no head_dim given)
_NULLABLE = {"sliding_window", "final_logit_softcapping", "attn_logit_softcapping", "head_dim", "layer_types",
             "rope_scaling", "rope_parameters"}
# the fields of each kind, checked before anything is computed from them (a string, a float, 0 or a negative
# count reached arithmetic: a ZeroDivisionError traceback, or a head width of 0 taken as "not given")
_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "max_position_embeddings", "head_dim", "max_window_layers", "sliding_window_pattern")
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "use_bidirectional_attention")
_NUMBERS = ("rms_norm_eps", "initializer_range", "lambda_std_dev")


def _check_kinds(family: str, d: dict[str, Any]) -> None:
    """:class:`FamilyError` naming the first field of the wrong kind: a count that is no whole number >= 1 (null
    allowed where transformers derives it: ``head_dim``, ``num_key_value_heads``), a switch that is no boolean, a
    number that is no finite number."""
    def wrong(key: str, what: str) -> FamilyError:
        return FamilyError(f"config.json ({family}): {key} must be {what}, got {printable(repr(d[key]))[:80]}")

    for key in _COUNTS:
        v = d.get(key)
        if v is None and key in ("head_dim", "num_key_value_heads") or key not in d:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise wrong(key, "a whole number >= 1")
    for key in _SWITCHES:
        if key in d and not isinstance(d[key], bool):
            raise wrong(key, "true or false")
    for key in _NUMBERS:
        v = d.get(key)
        if key in d and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise wrong(key, "a finite number")


def _read(f: Family, d: dict[str, Any], rope: str) -> ModelConfig:
    def refuse(msg: str) -> None:
        raise FamilyError(f"cannot read {f.model_type}: {msg}")

    act = d.get(f.activation_key)
    if act not in _ACTIVATIONS:
        refuse(f"hidden activation {act!r}; supported: {sorted(_ACTIVATIONS)}")
    if d.get("attention_dropout"):
        refuse(f"attention_dropout={d['attention_dropout']}; only 0 is supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            refuse(f"{key}={d[key]}: logit soft-capping is not supported")
    if d.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention=true: only causal decoders are read")
    split = 2 if f.diff else 1
    n_sub, n_kv_sub = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if n_sub % split or n_kv_sub % split:
        refuse(f"DiffLlama needs even num_attention_heads / num_key_value_heads, got {n_sub} / {n_kv_sub}")
    head_dim = d["head_dim"] or d["hidden_size"] // n_sub
    window, window_layers = _window(f, d, refuse)
    theta, factor, local_theta = _rope(f, d, refuse)
    qkv_bias, out_bias, mlp_bias = _biases(f, d)
    scalar = float(d["query_pre_attn_scalar"]) if f.scores_scalar else None
    n_heads, kv = n_sub // split, n_kv_sub // split
    cfg = ModelConfig(
        vocab_size=d["vocab_size"], d_model=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=None if kv == n_heads else kv, attention="diff" if f.diff else "standard",
        max_seq_len=d["max_position_embeddings"], rope=rope, rope_theta=theta, rope_factor=factor,
        tie_embeddings=bool(d["tie_word_embeddings"]), norm_eps=float(d["rms_norm_eps"]),
        init_std=float(d["initializer_range"]),
        head_dim=None if head_dim * n_sub == d["hidden_size"] else int(head_dim),  # derived: None (round-trips)
        bias=mlp_bias, qkv_bias=None if qkv_bias == mlp_bias else qkv_bias,
        out_bias=None if out_bias == mlp_bias else out_bias,
        qk_norm=f.qk_norm, sliding_window=window, window_layers=window_layers,
        rope_local_theta=local_theta if window is not None and local_theta != theta else None,
        post_attn_norm=f.sandwich_norms, post_ffn_norm=f.sandwich_norms, norm_unit_offset=f.norm_unit_offset,
        mlp_activation=_ACTIVATIONS[act], scale_embeddings=f.scale_embeddings,
        query_pre_attn_scalar=None if scalar in (None, float(head_dim)) else scalar,
        family=f.model_type if f.named else None,
        # V1's λ-vector init; its default left unsaid, so a config round-trips as it was
        attn_options={"lambda_std": std} if f.diff and (std := float(d.get("lambda_std_dev", 0.1))) != 0.1 else {},
    )
    if cfg.ffn_dim != d["intermediate_size"]:  # our default stays None, so configs round-trip unchanged
        cfg = cfg.replace(ffn_hidden=int(d["intermediate_size"]))
    return cfg


def _biases(f: Family, d: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases."""
    if f.bias == "qkv":
        return True, False, False
    attn = bool(d.get("attention_bias", False))
    return attn, attn, bool(d.get("mlp_bias", False))


def _window(f: Family, d: dict[str, Any], refuse) -> tuple[int | None, list[int] | None]:
    """(sliding window, its layers or None for all) as transformers' modeling file applies them."""
    n = d["num_hidden_layers"]
    window = d.get("sliding_window")
    if f.window == "none":
        return None, None
    if f.window == "qwen" and not d.get("use_sliding_window"):
        window = None  # transformers drops the window unless use_sliding_window
    if window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse(f"sliding_window must be a positive whole number, got {window!r}")
    if f.window == "every_layer":  # their attention takes config.sliding_window on every layer
        return window, None
    types = d.get("layer_types")
    if types is None:
        if f.window == "gemma":
            pattern = d["sliding_window_pattern"]
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            types = ["sliding_attention" if i >= d["max_window_layers"] else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        refuse(f"layer_types must name each of the {n} layers, got {types!r}")
    odd = sorted({t for t in types if t not in ("sliding_attention", "full_attention")}, key=str)
    if odd:
        refuse(f"layer_types {odd} are not supported (only sliding_attention, full_attention)")
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not layers:
        return None, None
    return window, None if len(layers) == n else layers


def _rope(f: Family, d: dict[str, Any], refuse) -> tuple[float, float, float | None]:
    """(global RoPE base, its linear factor, the local layers' base or None) from ``rope_parameters`` (5.x) or the
    older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        if f.local_rope and {"full_attention", "sliding_attention"} & set(params):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
            full.setdefault("rope_theta", d["rope_theta"])
            local.setdefault("rope_theta", d["rope_local_base_freq"])
        else:
            full, local = dict(params), None
            full.setdefault("rope_theta", d["rope_theta"])
    else:
        full = {"rope_type": "default", **_scaling(d.get("rope_scaling")), "rope_theta": d["rope_theta"]}
        local = {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]} if f.local_rope else None
    theta, factor = _one_rope(full, refuse, "")
    if local is None:
        return theta, factor, None
    local_theta, local_factor = _one_rope(local, refuse, " (sliding_attention)")
    if local_factor != 1.0:
        refuse("RoPE scaling on the sliding-window layers is not supported")
    return theta, factor, local_theta


def _scaling(s: Any) -> dict[str, Any]:
    s = dict(s or {})
    if "type" in s:
        s["rope_type"] = s.pop("type")
    return s


def _one_rope(p: dict[str, Any], refuse, where: str) -> tuple[float, float]:
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ("default", "linear"):
        refuse(f"rope_type={kind!r}{where}; supported: plain RoPE ('default') and linear scaling ('linear')")
    if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(f"partial_rotary_factor={p['partial_rotary_factor']}{where}; only full-width RoPE is supported")
    theta = p.get("rope_theta")
    factor = float(p.get("factor", 1.0)) if kind == "linear" else 1.0
    for name, v in (("rope_theta", theta), ("factor", factor)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            refuse(f"{name}={v!r}{where} must be a finite number > 0")
    return float(theta), factor


# ------------------------------------------------------------------------------------------- weight layout
@dataclass(frozen=True)
class Entry:
    """One tensor of the family's weights (``hf``) and ours it holds, stacked along the rows in order (Phi-3's
    fused ``qkv_proj`` and ``gate_up_proj``; one name otherwise). ``pairs``: DiffLlama's sub-head order
    (:func:`halves_to_pairs` on reading)."""

    hf: str
    ours: tuple[str, ...]
    pairs: bool = False


def weight_layout(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the transformers model ``cfg`` describes (its family: ``cfg.family``, DiffLlama for a V1
    model, else Llama's names), with ours. Tied embeddings: no ``lm_head`` entry. DiffLlama's λ vectors are copied
    as they are; its per-head norm has no gain (ours is set to 1 on reading, folded into o_proj on writing: not
    here)."""
    out = [Entry("model.embed_tokens.weight", ("body.tok_emb.weight",)), Entry("model.norm.weight",
                                                                             ("body.norm.weight",))]
    if not cfg.tie_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head.weight",)))
    for i in range(cfg.n_layers):
        out += _layer_layout(cfg, i)
    return out


def _layer_layout(cfg: ModelConfig, i: int) -> list[Entry]:
    ours, hf = f"body.blocks.{i}.", f"model.layers.{i}."
    a, sa, m = ours + "attn.", hf + "self_attn.", hf + "mlp."
    f = family_of(cfg.family)
    fused = f is not None and f.fused
    diff = cfg.attention == "diff"
    out = [Entry(hf + "input_layernorm.weight", (ours + "attn_norm.weight",))]
    if cfg.post_attn_norm or cfg.post_ffn_norm:  # Gemma's four norms
        out += [Entry(hf + "post_attention_layernorm.weight", (ours + "post_attn_norm.weight",)),
                Entry(hf + "pre_feedforward_layernorm.weight", (ours + "ffn_norm.weight",)),
                Entry(hf + "post_feedforward_layernorm.weight", (ours + "post_ffn_norm.weight",))]
    else:
        out.append(Entry(hf + "post_attention_layernorm.weight", (ours + "ffn_norm.weight",)))
    kinds = ["weight"] + (["bias"] if cfg.attn_qkv_bias else [])
    for kind in kinds:
        if fused:
            out.append(Entry(f"{sa}qkv_proj.{kind}", tuple(f"{a}{p}_proj.{kind}" for p in "qkv")))
        else:
            out += [Entry(f"{sa}{p}_proj.{kind}", (f"{a}{p}_proj.{kind}",), pairs=diff) for p in "qkv"]
    out += [Entry(f"{sa}o_proj.{kind}", (f"{a}out_proj.{kind}",))
            for kind in ["weight"] + (["bias"] if cfg.attn_out_bias else [])]
    if cfg.qk_norm:
        out += [Entry(f"{sa}{p}_norm.weight", (f"{a}{p}_norm.weight",)) for p in "qk"]
    if diff:
        out += [Entry(sa + n, (a + n,)) for n in LAMBDAS]
    for kind in ["weight"] + (["bias"] if cfg.bias else []):
        if fused:
            out.append(Entry(f"{m}gate_up_proj.{kind}", (f"{ours}ffn.gate_proj.{kind}", f"{ours}ffn.up_proj.{kind}")))
        else:
            out += [Entry(f"{m}{p}_proj.{kind}", (f"{ours}ffn.{p}_proj.{kind}",)) for p in ("gate", "up")]
        out.append(Entry(f"{m}down_proj.{kind}", (f"{ours}ffn.down_proj.{kind}",)))
    return out


LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
#: Tensors some transformers checkpoints hold that are computed, not learned (older Llamas saved RoPE's).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def rotated(name: str) -> bool:
    """Whether our tensor ``name`` is laid out in rotated (sub-)heads, whose coordinates the interleaved RoPE
    layout reorders: the q/k projections (weights, biases) and the QK-norm gains."""
    return name.endswith(("attn.q_proj.weight", "attn.q_proj.bias", "attn.k_proj.weight", "attn.k_proj.bias",
                          "attn.q_norm.weight", "attn.k_norm.weight"))


def rope_perm(d: int) -> Tensor:
    """perm (d,) with neox_vec = interleaved_vec[perm]: even coordinates first, then odd ones."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))


def permute_within_heads(w: Tensor, d: int, perm: Tensor) -> Tensor:
    """Reorder the d rows of every head of a projection weight or bias w: (n·d, ...) by ``perm`` (d,)."""
    n = w.shape[0] // d
    return w.reshape(n, d, -1)[:, perm.to(w.device)].reshape(w.shape)


def pairs_to_halves(w: Tensor, d: int) -> Tensor:
    """Official -> DiffLlama sub-head order. w: (2n·d, ...) with sub-heads [a0, b0, a1, b1, ...] ->
    [a0, a1, ..., b0, b1, ...]."""
    n = w.shape[0] // (2 * d)
    return w.reshape(n, 2, d, -1).transpose(0, 1).reshape(w.shape)


def halves_to_pairs(w: Tensor, d: int) -> Tensor:
    """DiffLlama -> official sub-head order (inverse of :func:`pairs_to_halves`)."""
    n = w.shape[0] // (2 * d)
    return w.reshape(2, n, d, -1).transpose(0, 1).reshape(w.shape)
