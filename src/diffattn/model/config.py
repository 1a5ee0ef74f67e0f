"""ModelConfig, the shape and options of a model, as plain data checked on construction, and its
parameter-matched baseline. The attention types and their properties come from the registry
(:mod:`diffattn.attention.registry`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from diffattn.attention.registry import ATTENTION, build_attention, carry_options, check_options

#: The gated MLP's activations: SwiGLU's SiLU, GeGLU's tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``).
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
#: The longest sliding window a config may ask for (2³¹ − 1 tokens): one as long as the context or longer
#: changes nothing, one beyond this is a mistake.
MAX_WINDOW = 2**31 - 1


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class ModelConfig:
    """Shape and options of a model. ``n_heads`` counts the attention module's heads: for ``diff`` these are
    diff-heads (Q/K sub-heads of width d_model / (2·n_heads), V of width 2d); for ``diff_v2``, output heads
    (each with two query heads of width d_model / n_heads); otherwise ordinary heads.

    ``head_dim``: the Q/K (sub-)head width d when it is not the one derived from d_model above (e.g. a model
    converted from a Llama keeps the source's head width, see :mod:`diffattn.interop.convert`); the projections are
    then sized from it (``diff``: Q 2h·d, K 2hkv·d, V hkv·2d, output h·2d -> d_model). None: derived.
    ``attn_options``: the attention type's own options (its ``Options`` dataclass, declared in its file; e.g.
    V1's ``lambda_init``, ``subln``, ``lambda_std``, DA's ``distance_w_init``), checked on construction;
    ``options`` is the typed view, with the defaults filled in. Options another type declares are accepted and
    unused (one template, several arms). A field that became a type's option is read from an old config as that
    option (:func:`migrate_fields`).
    ``rope``: a type that carries its own position signal (ALiBi) takes none; its config reads ``rope="none"``.

    The pretrained families' options (LitGPT's design: one config, options rather than a class per family; every
    attention type takes them, :class:`~diffattn.attention.base.HeadOptions`; their defaults are the plain model,
    so an older config reads as it did): ``qkv_bias`` / ``out_bias`` the attention projections' biases (None:
    ``bias``, which is also the MLP's; Qwen2: q, k, v and not o); ``qk_norm`` RMSNorm over each query and key
    head before RoPE (Qwen3, Gemma 3); ``sliding_window`` a query sees the keys less than that many positions back
    (itself included), on the layers ``window_layers`` (0-based; None: all), whose RoPE base is
    ``rope_local_theta`` when set (Gemma 3's local layers); ``rope_factor`` linear RoPE scaling of the other
    layers (angles / factor); ``post_attn_norm`` / ``post_ffn_norm`` RMSNorm on the attention's and the MLP's
    output before the residual add (Gemma 2/3); ``norm_unit_offset`` every RMSNorm of the family's (block norms,
    final norm, QK-norm) computes x̂·(1 + w) (Gemma; V1's per-head norm is ours and stays as it is);
    ``mlp_activation`` the gated MLP's activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma);
    ``scale_embeddings`` embeddings × √d_model (Gemma); ``query_pre_attn_scalar`` logits × scalar^-½ instead of
    1/√(head width) (Gemma 3). ``family``: the transformers ``model_type`` the model was read from (``llama``,
    ``qwen2``, ...), which ``export --to hf`` writes back; None: Llama's.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    attention: str = "diff"
    max_seq_len: int = 512
    rope: str = "interleaved"  # "interleaved" (official DIFF code), "neox" (Llama), or "none"
    rope_theta: float = 10000.0
    ffn_hidden: int | None = None  # default: 8/3·d_model rounded up to a multiple of 64
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    dropout: float = 0.0
    bias: bool = False
    head_dim: int | None = None  # Q/K (sub-)head width; None: d_model / (head_split · n_heads)
    init_std: float = 0.02
    causal: bool = True
    # K from the query projection (the seeds' "Diff_Symmetry"): no k_proj, a symmetric logit map. Defined for
    # the types that declare ``supports_shared_qk`` (standard, diff, distance, ...) with n_kv_heads == n_heads;
    # not for diff_v2. A model option, not one type's (like the families' options): many types take it, and a
    # matched baseline keeps it (a symmetric DIFF model's baseline is a symmetric Transformer).
    shared_qk: bool = False
    # The attention type's own options (see the class docstring); only what was set, so configs round-trip.
    attn_options: dict[str, Any] = field(default_factory=dict)
    # The pretrained families' options (see the class docstring); the defaults are the plain model.
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    window_layers: list[int] | None = None
    rope_local_theta: float | None = None
    rope_factor: float = 1.0
    post_attn_norm: bool = False
    post_ffn_norm: bool = False
    norm_unit_offset: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    family: str | None = None
    # The attention type of each layer when they differ (a selective retrofit's: the layers it did not convert
    # stay "standard"); None: every layer is ``attention``. See :meth:`layer_config`.
    layer_attention: list[str] | None = None
    # Per layer, the 0-based heads whose negative map is on (a selective retrofit's, DEX-style); the others are
    # standard heads on their first map. None: every head. See :meth:`_check_diff_heads`. A model field like
    # ``layer_attention``, not one type's option: it is per layer (``first_layers`` cuts it), and V1 and
    # V2 (``selects_heads``) read it alike.
    diff_heads: list[list[int]] | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.attention in ATTENTION, f"unknown attention {self.attention!r}; registered: {sorted(ATTENTION)}")
        need(self.rope in ("interleaved", "neox", "none"), f"rope must be interleaved|neox|none, got {self.rope!r}")
        if not ATTENTION[self.attention].uses_rope:
            self.rope = "none"  # the type's own bias is its position signal (e.g. ALiBi): no RoPE tables either
        try:
            check_options(self.attention, self.attn_options)
        except (TypeError, ValueError) as e:  # a dataclass's own check may raise either
            need(False, f"attn_options: {e}")
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        need(isinstance(kv, int) and kv > 0 and self.n_heads % kv == 0,
             f"n_heads ({self.n_heads}) must be a positive multiple of n_kv_heads ({self.n_kv_heads})")
        split = ATTENTION[self.attention].head_split
        width = split * self.n_heads
        if self.head_dim is None:
            need(self.d_model % width == 0,
                 f"d_model ({self.d_model}) must be divisible by {'2·n_heads' if split == 2 else 'n_heads'}"
                 f" ({width}) for attention {self.attention!r} (or set head_dim)")
        else:
            need(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim > 0,
                 f"head_dim must be a positive int or None, got {self.head_dim!r}")
        if self.rope != "none":
            need(self.qk_head_dim % 2 == 0, f"RoPE needs an even head dim, got {self.qk_head_dim}")
        for name in ("rope_theta", "norm_eps", "init_std", "dropout"):  # NaN passes every comparison
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                 f"{name} must be a finite number >= 0, got {v!r}")
        need(self.rope == "none" or self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta!r}")
        need(_number(self.dropout) and 0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        if self.ffn_hidden is not None:
            need(isinstance(self.ffn_hidden, int) and self.ffn_hidden > 0,
                 f"ffn_hidden must be a positive int, got {self.ffn_hidden!r}")
        need(isinstance(self.shared_qk, bool), f"shared_qk must be true or false, got {self.shared_qk!r}")
        self._check_family_options(need)
        self._check_layer_attention(need)
        if self.shared_qk:
            need(ATTENTION[self.attention].supports_shared_qk,
                 f"shared_qk is not defined for attention {self.attention!r}; it is for "
                 f"{sorted(n for n, c in ATTENTION.items() if c.supports_shared_qk)}")
            need(kv == self.n_heads, f"shared_qk needs n_kv_heads == n_heads (K = Q per head), got n_heads "
                 f"{self.n_heads} and n_kv_heads {kv}")

    def _check_family_options(self, need) -> None:
        """The pretrained families' options (class docstring): each of its type, no absurd value."""
        for name in ("qk_norm", "post_attn_norm", "post_ffn_norm", "norm_unit_offset", "scale_embeddings"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("bias", "qkv_bias", "out_bias"):
            v = getattr(self, name)
            need(isinstance(v, bool) or (v is None and name != "bias"),
                 f"{name} must be true or false{'' if name == 'bias' else ' (or None: bias)'}, got {v!r}")
        for name in ("rope_theta", "rope_local_theta", "rope_factor", "query_pre_attn_scalar", "norm_eps"):
            v = getattr(self, name)
            if v is not None or name in ("rope_theta", "rope_factor", "norm_eps"):
                need(_number(v) and math.isfinite(v) and v > 0, f"{name} must be a finite number > 0, got {v!r}")
        need(self.mlp_activation in MLP_ACTIVATIONS,
             f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
        w = self.sliding_window
        if w is not None:
            need(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WINDOW,
                 f"sliding_window must be a whole number of tokens from 1 to {MAX_WINDOW:,} (or None: no window), "
                 f"got {w!r}")
        layers = self.window_layers
        if layers is not None:
            need(w is not None, "window_layers names the sliding-window layers, but sliding_window is not set")
            need(isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                            and 0 <= i < self.n_layers for i in layers)
                 and len(set(layers)) == len(layers),
                 f"window_layers must list distinct layer indices from 0 to {self.n_layers - 1}, got {layers!r}")
            self.window_layers = sorted(layers)
        note = ATTENTION[self.attention].window_note
        need(w is None or note is None, f"sliding_window is not defined for attention {self.attention!r}: {note}")
        if self.rope_local_theta is not None:
            need(w is not None, "rope_local_theta is the RoPE base of the sliding-window layers, but sliding_window "
                                "is not set")
        need(self.family is None or (isinstance(self.family, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,63}",
                                                                                    self.family) is not None),
             f"family must be a transformers model_type (lower-case letters, digits, _) or None, got {self.family!r}")

    def _check_layer_attention(self, need) -> None:
        """``layer_attention``: one registered type per layer, every layer's Q/K head width the same (one RoPE
        table serves them all)."""
        types = self.layer_attention
        if types is not None:
            need(isinstance(types, (list, tuple)) and len(types) == self.n_layers
                 and all(t in ATTENTION for t in types),
                 f"layer_attention must name a registered attention type for each of the {self.n_layers} layers, "
                 f"got {types!r}")
            self.layer_attention = list(types)
        self._check_diff_heads(need)
        for t in set(types or ()) - {self.attention}:
            try:
                other = self.layer_config(types.index(t))
            except ValueError as e:
                need(False, f"layer_attention: a {t!r} layer of this config: {e}")
            need(other.qk_head_dim == self.qk_head_dim and other.rope == self.rope,
                 f"layer_attention: {t!r} layers would have Q/K heads of width {other.qk_head_dim}, the "
                 f"{self.attention!r} layers {self.qk_head_dim}: set head_dim so that they share one RoPE table")

    def _check_diff_heads(self, need) -> None:
        """``diff_heads``: for each layer, its selected heads, distinct, increasing, of the layer's ``n_heads``
        (V1's diff-heads, V2's query-head pairs); a layer of a type that selects heads (``selects_heads``) has at
        least one (one with none is a standard layer: ``layer_attention`` says so), any other layer none."""
        heads, n = self.diff_heads, self.n_layers
        if heads is None:
            return
        kinds = self.attention_per_layer
        selecting = ", ".join(sorted(t for t, c in ATTENTION.items() if c.selects_heads))
        need(isinstance(heads, (list, tuple)) and len(heads) == n and all(isinstance(h, (list, tuple))
                                                                          for h in heads),
             f"diff_heads must list the selected heads of each of the {n} layers, got {heads!r}")
        for i, (t, hs) in enumerate(zip(kinds, heads)):
            need(all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < self.n_heads for j in hs)
                 and list(hs) == sorted(set(hs)),
                 f"diff_heads[{i}] must list distinct heads in increasing order, from 0 to {self.n_heads - 1}, "
                 f"got {list(hs)!r}")
            if ATTENTION[t].selects_heads:
                need(len(hs) > 0, f"diff_heads[{i}] selects no head of a {t!r} layer: a layer without a selected "
                                  "head is standard attention (layer_attention)")
            else:
                need(not hs, f"diff_heads[{i}] selects heads {list(hs)} of a {t!r} layer, a type that does not "
                             f"select heads (the types that do: {selecting})")
        self.diff_heads = [list(h) for h in heads]

    def layer_heads(self, layer_idx: int) -> list[int] | None:
        """The heads of layer ``layer_idx`` whose negative map is on (``diff_heads``); None: every head."""
        return None if self.diff_heads is None else self.diff_heads[layer_idx]

    def layer_config(self, layer_idx: int) -> ModelConfig:
        """The config layer ``layer_idx`` is built from: this one, or for a layer of another type
        (``layer_attention``) this one with that type (every other field as it is, but ``diff_heads``: that
        layer's heads for every layer when the type selects heads, else None)."""
        t = self.attention if self.layer_attention is None else self.layer_attention[layer_idx]
        if t == self.attention:
            return self
        heads = self.layer_heads(layer_idx) if ATTENTION[t].selects_heads else None
        return self.replace(attention=t, layer_attention=None, attn_options=carry_options(self.attn_options, t),
                            diff_heads=None if heads is None else [heads] * self.n_layers)

    @property
    def attention_per_layer(self) -> list[str]:
        """The attention type of each layer (``layer_attention``, or ``attention`` on every layer)."""
        return list(self.layer_attention) if self.layer_attention is not None else [self.attention] * self.n_layers

    @property
    def mixed(self) -> bool:
        """Whether the layers' attention types differ (``layer_attention``)."""
        return self.layer_attention is not None and len(set(self.layer_attention)) > 1

    def family_options(self) -> list[str]:
        """The pretrained families' options this config sets beyond Llama's shape, as phrases (empty: a Llama)."""
        said = []
        if self.attn_qkv_bias != self.bias or self.attn_out_bias != self.bias:
            said.append(f"attention biases (q/k/v {self.attn_qkv_bias}, o {self.attn_out_bias})")
        said += [name for name in ("qk_norm", "post_attn_norm", "post_ffn_norm", "norm_unit_offset",
                                   "scale_embeddings") if getattr(self, name)]
        said += [f"{name}={getattr(self, name)!r}" for name in ("sliding_window", "rope_local_theta",
                                                                 "query_pre_attn_scalar")
                 if getattr(self, name) is not None]
        if self.rope_factor != 1.0:
            said.append(f"rope_factor={self.rope_factor!r}")
        if self.mlp_activation != "silu":
            said.append(f"mlp_activation={self.mlp_activation!r}")
        return said

    @property
    def attn_qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases (``qkv_bias``, else ``bias``)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def attn_out_bias(self) -> bool:
        """Whether the attention's out-projection has a bias (``out_bias``, else ``bias``)."""
        return self.bias if self.out_bias is None else self.out_bias

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None: it attends to every earlier position)."""
        if self.sliding_window is None or (self.window_layers is not None and layer_idx not in self.window_layers):
            return None
        return self.sliding_window

    def local_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` takes the local RoPE base ``rope_local_theta`` (a window layer, when set)."""
        return self.rope_local_theta is not None and self.layer_window(layer_idx) is not None

    @property
    def has_local_rope(self) -> bool:
        """Whether some layer takes the local RoPE base (:meth:`local_rope`)."""
        return (self.rope_local_theta is not None and self.sliding_window is not None
                and (self.window_layers is None or len(self.window_layers) > 0))

    def first_layers(self, n_layers: int) -> ModelConfig:
        """This config cut to its first ``n_layers`` layers (the window layers among them kept), for a model
        built to count or trace a few layers."""
        wl, types, heads = self.window_layers, self.layer_attention, self.diff_heads
        return self.replace(n_layers=n_layers, window_layers=None if wl is None else [i for i in wl if i < n_layers],
                            layer_attention=None if types is None else types[:n_layers],
                            diff_heads=None if heads is None else heads[:n_layers])

    @property
    def score_scale(self) -> float | None:
        """The logits' scale when it is not 1/√(head width): ``query_pre_attn_scalar``^-½; else None."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def options(self) -> Any:
        """The attention type's typed options (an instance of its ``Options``; None when it declares none)."""
        return check_options(self.attention, self.attn_options)

    @property
    def qk_head_dim(self) -> int:
        """The Q/K (sub-)head width: ``head_dim``, or the one derived from d_model."""
        if self.head_dim is not None:
            return self.head_dim
        return self.d_model // (ATTENTION[self.attention].head_split * self.n_heads)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // 64) * 64

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A config from its dict layout (a checkpoint's, a run config's model section), an old one's moved fields
        read as the options they became (:func:`migrate_fields`)."""
        d = migrate_fields(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


#: {old top-level field: its default}: ModelConfig fields that became attention types' typed options (V1's,
#: :class:`~diffattn.attention.diff.DiffOptions`). Old checkpoints, TOML files and ``--model.NAME`` still say them.
MOVED_TO_OPTIONS: dict[str, Any] = {"lambda_init": None, "subln": True, "lambda_std": 0.1}


def migrate_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict with its old top-level fields (:data:`MOVED_TO_OPTIONS`) moved into ``attn_options``; a
    copy, ``d`` itself when it has none. An old config wrote every field, so one at its default is dropped (it
    says nothing); a value that ``attn_options`` also gives, differently, is a ValueError naming both."""
    moved = {k: d[k] for k in MOVED_TO_OPTIONS if k in d}
    if not moved:
        return d
    out = {k: v for k, v in d.items() if k not in moved}
    opts = out.get("attn_options")
    opts = dict(opts) if isinstance(opts, dict) else ({} if opts is None else opts)
    if isinstance(opts, dict):  # anything else is refused, naming attn_options, when the config is built
        for k, v in moved.items():
            default = MOVED_TO_OPTIONS[k]
            if v is default or (type(v) is type(default) and v == default):
                continue
            if k in opts and opts[k] != v:
                raise ValueError(f"ModelConfig: {k}={v!r} (an old top-level field) and attn_options.{k}="
                                 f"{opts[k]!r} disagree; {k} is an attention option now: give it once")
            opts[k] = v
    out["attn_options"] = opts
    return out


def matched_baseline(cfg: ModelConfig) -> ModelConfig:
    """The paper's parameter-matched baseline of a DIFF config: twice the heads at half the head width, so the
    projections are the same size (parameters differ only by DIFF's λ vectors and norm gains, < 0.1%).

    ``diff_v2`` keeps the baseline's head width, so its baseline has the same ``n_heads`` (V2 has the extra
    query projection and W_λ; it is not parameter-matched by design). A type without a baseline is returned as is.
    Every other field carries over, ``shared_qk`` included: a symmetric DIFF model's baseline is a symmetric
    Transformer (both drop their key projection); of ``attn_options``, those the baseline type declares.
    A type whose attention has materially fewer or more parameters than the baseline's (``match_baseline_ffn``,
    e.g. Shared DIFF's shared projections) gets a baseline whose FFN width makes the totals match (to within one
    hidden unit per layer: 3·d_model parameters, see :func:`ffn_width_matching`).
    """
    cls = ATTENTION[cfg.attention]
    if cls.baseline is None:
        return cfg
    k = cls.head_split
    kv = None if cfg.n_kv_heads is None else k * cfg.n_kv_heads
    base = cfg.replace(attention=cls.baseline, n_heads=k * cfg.n_heads, n_kv_heads=kv, diff_heads=None,
                       attn_options=carry_options(cfg.attn_options, cls.baseline))
    if cls.match_baseline_ffn:
        base = base.replace(ffn_hidden=ffn_width_matching(base, attention_params(cfg) - attention_params(base)))
    return base


def attention_params(cfg: ModelConfig) -> int:
    """The parameters of ``cfg``'s attention modules over all layers (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for i in range(cfg.n_layers) for p in build_attention(cfg, i).parameters())


def ffn_width_matching(cfg: ModelConfig, extra_params: int) -> int:
    """The FFN width that gives ``cfg`` ``extra_params`` more parameters (fewer when negative), to the nearest
    hidden unit: a SwiGLU hidden unit holds 3·d_model weights (+2 biases with ``bias``) in each layer."""
    per_unit = cfg.n_layers * (3 * cfg.d_model + (2 if cfg.bias else 0))
    return max(1, cfg.ffn_dim + round(extra_params / per_unit))
