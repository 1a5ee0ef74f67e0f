"""DA-Transformer attention (Wu, Wu & Huang 2021): softmax(ReLU(QKᵀ) ⊙ f(w_h·|i − j|; v_h)·scale)·V with two
learnable scalars per head.

``distance_attention_ref`` materializes the map (the spec); ``distance_attention`` is the block-wise O(T)-memory
kernel or FlexAttention (:mod:`diffattn.ops.distance_block`, :mod:`diffattn.ops.distance_flex`). Shapes and mask
conventions: :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, HeadOptions, head_options
from diffattn.attention.registry import register
from diffattn.attention.standard import StandardAttention
from diffattn.ops import backends, distance_flex
from diffattn.ops.core import ScoreMod, check_heads, masked_softmax, repeat_kv
from diffattn.ops.distance_block import DistanceAttnFn
from diffattn.ops.distance_score import (
    check_distance_params,
    distance_logits,
    distance_mask,
    distance_positions,
    mask4,
)


def distance_attention_ref(q: Tensor, k: Tensor, v: Tensor, w: Tensor, v_param: Tensor, *, causal: bool = True,
                           attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                           score_mod: ScoreMod | None = None, return_maps: bool = False):
    """DA-Transformer attention, materialized: softmax(ReLU(QKᵀ) ⊙ f(w_h·R; v_h) · scale) · V.

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), w, v_param: (Hq,) per query head.
    R_ij = |qpos_i − j| with qpos from :func:`distance_positions` (``offset``: int, or (Tq,) positions).
    ``score_mod`` rewrites the final scores before masking. Returns (B, Hq, Tq, Dv), plus {"logits" (the
    post-ReLU ⊙ f scores), "probs"} when asked.
    """
    n_rep = check_heads(q.shape[1], k.shape[1], "distance attention")
    check_distance_params(w, v_param, q.shape[1], "distance attention")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    qpos = distance_positions(q.shape[-2], offset, q.device)
    logits = distance_logits(q, k, w, v_param, qpos, scale)
    if score_mod is not None:
        logits = score_mod(logits)
    probs = masked_softmax(logits, distance_mask(qpos, k.shape[-2], causal, attn_mask))
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def distance_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, v_param: Tensor, *, causal: bool = True,
                       attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                       block_q: int = 256, block_k: int = 256, backend: str = "auto") -> Tensor:
    """Fast DA-Transformer attention, O(T) memory, exact backward. Same math and shapes as
    :func:`distance_attention_ref`.

    ``backend``: ``"block"`` is a block-wise online softmax in PyTorch with a recomputing backward (every
    device; only (B, H, block_q, block_k) tiles; ``block_q``/``block_k`` trade Python overhead for tile memory;
    fp16/bf16 computed in fp32). ``"flex"`` is FlexAttention with a distance score_mod
    (:func:`diffattn.ops.distance_flex.flex_distance`; compiled on CUDA; on CPU torch runs it eagerly, forward
    only); ``"auto"`` takes flex on CUDA for boolean or no masks once it passed its self-check there
    (:mod:`diffattn.ops.backends`; ``DIFFATTN_BACKEND`` overrides it), the block path otherwise.
    """
    n_rep = check_heads(q.shape[1], k.shape[1], "distance attention")
    check_distance_params(w, v_param, q.shape[1], "distance attention")
    if backend not in ("auto", "block", "flex"):
        raise ValueError(f"distance attention backend must be 'auto', 'block' or 'flex', got {backend!r}")
    chosen = backends.choose("distance", q.device, q.dtype) if backend == "auto" else backend
    if chosen == "flex":
        why = distance_flex.flex_unsupported(q, k, v, attn_mask)
        if why is None:
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            return distance_flex.flex_distance(q, k, v, w, v_param, causal=causal, attn_mask=attn_mask, offset=offset,
                                    scale=float(scale))
        if backend == "flex":
            raise ValueError(f"distance attention backend 'flex': {why}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_q}, {block_k}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = q.dtype
    cdt = torch.float64 if dt == torch.float64 else torch.float32
    qpos = distance_positions(q.shape[-2], offset, q.device)
    mask = mask4(attn_mask)
    out = DistanceAttnFn.apply(
        *(x.to(cdt).contiguous() for x in (q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))), w.to(cdt),
        v_param.to(cdt), qpos, mask, causal, float(scale), int(block_q), int(block_k),
    )
    return out.to(dt)


def _check_case(device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The self-check's small causal case: q (1, 4, 40, 16), k (1, 2, 40, 16), v (1, 2, 40, 16) in ``dtype``,
    w (4,) and v_param (4,) in fp32 (as under autocast)."""
    qkv = backends.random_inputs(device, dtype, [(1, 4, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16)])
    return [*qkv, torch.linspace(-0.3, 0.5, 4, device=device), torch.linspace(-1.0, 2.0, 4, device=device)]


backends.register(backends.Kernel(
    name="flex", safe="block", family="distance", available=distance_flex.flex_available,
    run=lambda backend, x: distance_attention(*x, causal=True, backend=backend),
    make_inputs=_check_case, grad_names=("out", "dq", "dk", "dv", "dw", "dv_param"),
    opt_in="slower than the block loop on an H200 (bf16 fwd+bwd 6-12x the block path's time, T = 1k-8k; the "
           "gradients of w and v_param miss the bf16 tolerance; docs/results/gpu/)"))


# ----------------------------------------------------------------------------------------------- module
@dataclass(frozen=True)
class DistanceOptions:
    """The ``ModelConfig.attn_options`` of the distance-aware types (``distance``, ``diff_distance``).

    ``distance_w_init``: a number a >= 0 spreads w evenly over the heads from −a (shortest range) to +a
    (longest range), or a list gives one w per head. Default 0.1: the most local head's f falls to 1/2 at
    distance ln 3 / 0.1 ≈ 11 and to ~0 past ~60 tokens, the middle heads start close to distance-agnostic
    (f ≈ 1), and the most global head's f rises to its bound 2 past ~40 tokens: a spread of ranges, which the
    paper finds heads learn, without any head starting degenerate. The paper publishes no initialisation.
    ``distance_v_init``: a number or one per head. Default 0: f(x; 0) = 2σ(x), symmetric bounds (0, 2) around
    f(0) = 1, with the largest slope (1/2) at x = 0, so w gets a useful gradient from the start.
    ``distance_block``: tile size (queries and keys) of the fast block-wise op.
    DA-Transformer uses no RoPE: prefer ``rope = "none"`` for these types (the ReLU(QKᵀ) works with RoPE too).
    """

    distance_w_init: float | list[float] = 0.1
    distance_v_init: float | list[float] = 0.0
    distance_block: int = 256

    def __post_init__(self) -> None:
        if self.distance_block < 1:
            raise ValueError(f"distance_block must be a positive int, got {self.distance_block!r}")
        if not isinstance(self.distance_w_init, (list, tuple)) and self.distance_w_init < 0:
            raise ValueError(f"distance_w_init: the spread half-width must be >= 0, got {self.distance_w_init}")


def distance_init(n: int, w_init, v_init) -> tuple[Tensor, Tensor]:
    """Initial (w, v) for n heads, each (n,) fp32. See :class:`DistanceOptions`."""

    def per_head(x, name: str, spread: bool) -> Tensor:
        if isinstance(x, (list, tuple)):
            if len(x) != n or not all(isinstance(e, (int, float)) for e in x):
                raise ValueError(f"attn_options {name}: a list needs {n} numbers (one per head), got {x!r}")
            return torch.tensor([float(e) for e in x])
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
            raise ValueError(f"attn_options {name} must be a number or a list of {n}, got {x!r}")
        if spread:
            if x < 0:
                raise ValueError(f"attn_options {name}: the spread half-width must be >= 0, got {x}")
            return torch.linspace(-float(x), float(x), n) if n > 1 else torch.zeros(1)
        return torch.full((n,), float(x))

    return per_head(w_init, "distance_w_init", True), per_head(v_init, "distance_v_init", False)


@register("distance", label="DA", color="#9467bd")
class DistanceAttention(StandardAttention):
    """DA-Transformer attention (Wu, Wu & Huang 2021): softmax(ReLU(QKᵀ) ⊙ f(w_h·|i − j|; v_h) / √d)·V
    with two learnable scalars per head, ``distance_w`` and ``distance_v`` (h,). Positions are absolute, so
    with the KV cache query i sits at ``input_pos[i]``. Maps recorded by ``capture``: logits (post ReLU ⊙ f),
    probs."""

    fast_op, ref_op = staticmethod(distance_attention), staticmethod(distance_attention_ref)

    kernel_family = "distance"
    Options = DistanceOptions
    unsupported = {"serve": (
        "its logits are ReLU(QKᵀ)·f(w·|i−j|; v), a score modification vLLM's stock attention kernels have no hook "
        "for: serving it needs a per-layer, per-head score_mod over the paged KV cache (vLLM's FlexAttention "
        "backend takes one score_mod for the whole batch and runs on CUDA only); its KV cache would be "
        "the standard one")}

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, w_init=0.1, v_init=0.0, block: int = 256,
                 shared_qk: bool = False, heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, shared_qk=shared_qk, heads=heads)
        self._distance_args = (w_init, v_init)
        w, v = distance_init(num_heads, w_init, v_init)
        self.distance_w = nn.Parameter(w)
        self.distance_v = nn.Parameter(v)
        self.block = block

    def reset_parameters(self) -> None:
        w, v = distance_init(self.num_heads, *self._distance_args)
        self.distance_w.copy_(w)
        self.distance_v.copy_(v)

    def op_params(self) -> tuple[Tensor, Tensor]:
        return self.distance_w, self.distance_v

    def fast_kwargs(self) -> dict[str, int]:
        return {"block_q": self.block, "block_k": self.block}

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        o = cfg.options
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   w_init=o.distance_w_init, v_init=o.distance_v_init, block=o.distance_block,
                   shared_qk=cfg.shared_qk, heads=head_options(cfg, layer_idx))
