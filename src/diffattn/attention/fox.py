"""FoX, the Forgetting Transformer (Lin, Nikishin, He & Courville, ICLR 2025, arXiv 2503.02130): softmax attention
whose logits are down-weighted by a data-dependent forget gate, f_t = σ(w_h·x_t + b_h) per token t and head h:

    logit(i, j) = q_i·k_j·scale + Σ_{l=j+1..i} log f_l = q_i·k_j·scale + c_i − c_j,   c_t = Σ_{l≤t} log f_l

a learned recency decay, with no position embedding (the paper's default; ``uses_rope = False``). As the
authors' code: w_h and b_h form a (E → H) linear layer with bias on the block's pre-normed input, w drawn like
every projection and b = 0 (``fox_gate_bias_init``), so f ≈ ½ at the start; log f in fp32.

Bidirectional (the paper has only causal LMs; our choice): the bias is −|c_i − c_j|, the log forget gates of
the tokens between the two positions whichever comes first. It equals the causal bias wherever j ≤ i, so
one formula serves both (and the KV cache, whose explicit mask keeps j ≤ i).

Ops (positions as :mod:`diffattn.ops.core`: queries at ``offset`` (or the (Tq,) positions the KV cache passes),
keys at 0..Tk−1; ``log_f`` holds the keys' log forget gates):

* ``fox_attention_ref`` materializes the biased (Tq, Tk) logits (the spec).
* ``fox_attention`` never builds a (Tq, Tk) tensor on the causal path: the bias is rank 2, so it rides in two
  extra channels of Q and K, q' = [q·scale, c_i, 1] and k' = [k, 1, −c_j], q'·k' = q·k·scale + c_i − c_j, and
  one SDPA call (scale 1, V zero-padded to the same width so CPU SDPA keeps its fused kernel) computes it all,
  gradients of c (hence of the gates) included. Bidirectional, it attends over the keys twice: [k, 1, −c_j]
  for j ≤ i and [k, −1, c_j] for j > i, split by a (Tq, 2Tk) boolean mask (O(T²) bits, not a map). c is
  per query head, so GQA's keys and values are expanded to the query heads inside the op (the KV cache keeps
  them at the KV heads, plus one log f per head and token). Computed in fp32 (fp64 for fp64): fp16/bf16 inputs
  are upcast, since c grows with the sequence and a 16-bit channel would lose it.
  On CPU, strongly decaying heads at long T drive many exp() results into fp32 denormals, which the CPU
  runs slowly; ``torch.set_flush_denormal(True)`` removes that cost (benchmarks/bench_rivals.py measures both).

FLOPs: standard attention's (the bias is O(T) work per row in the augmented channels, not multiply-adds
that grow with d). ``convert`` refuses FoX: a forget gate of exactly 1 (log f = 0) is reached only as b → ∞,
where its gradient σ(−b) is 0, so an exact conversion would never learn to forget; and a RoPE source's
positions have no exact FoX counterpart (FoX takes no RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, HeadOptions, MaskArgs, head_options
from diffattn.attention.registry import register
from diffattn.attention.standard import StandardAttention
from diffattn.ops.core import ScoreMod, check_heads, masked_softmax, repeat_kv, sdpa
from diffattn.ops.distance_score import distance_mask, distance_positions
from diffattn.ops.kv_cache import KVCache


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(q: Tensor, k: Tensor, log_f: Tensor, offset: int | Tensor) -> tuple[int, Tensor, Tensor]:
    """(n_rep, query positions (Tq,), c = cumsum of log f over the keys (B, Hq, Tk) in fp32/fp64)."""
    n_rep = check_heads(q.shape[1], k.shape[1], "fox attention")
    b, hq, tq = q.shape[:3]
    tk = k.shape[-2]
    if log_f.shape != (b, hq, tk):
        raise ValueError(f"fox attention wants log_f (B, Hq, Tk) = ({b}, {hq}, {tk}), one log forget gate per "
                         f"query head and key position, got {tuple(log_f.shape)}")
    qpos = distance_positions(tq, offset, q.device)
    if tq and not isinstance(q, torch._subclasses.FakeTensor) and int(qpos.max()) >= tk:
        raise ValueError(f"fox attention: query positions must lie among the keys' 0..{tk - 1} (the forget gates "
                         f"between them are the keys'), got up to {int(qpos.max())}")
    return n_rep, qpos, log_f.to(_compute_dtype(q.dtype)).cumsum(-1)


def fox_bias(c: Tensor, qpos: Tensor) -> Tensor:
    """−|c_i − c_j| for queries at ``qpos`` (Tq,) and keys 0..Tk−1, c (B, H, Tk): (B, H, Tq, Tk). For j ≤ i it is
    c_i − c_j = Σ_{l=j+1..i} log f_l."""
    return -(c[..., qpos, None] - c[..., None, :]).abs()


def fox_attention_ref(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor, *, causal: bool = True,
                      attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None,
                      score_mod: ScoreMod | None = None, return_maps: bool = False):
    """Forgetting attention, materialized: softmax(QKᵀ·scale − |c_i − c_j|)·V, c = cumsum(log f).

    q: (B, Hq, Tq, D), k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv), log_f: (B, Hq, Tk) the keys' log forget gates
    (≤ 0). ``score_mod`` rewrites the biased scores before masking. Returns (B, Hq, Tq, Dv), plus {"logits"
    (biased), "probs"} when asked.
    """
    n_rep, qpos, c = _prepare(q, k, log_f, offset)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = (q @ k.transpose(-1, -2)) * scale + fox_bias(c, qpos).to(q.dtype)
    if score_mod is not None:
        logits = score_mod(logits)
    probs = masked_softmax(logits, distance_mask(qpos, k.shape[-2], causal, attn_mask))
    out = probs @ v
    return (out, {"logits": logits, "probs": probs}) if return_maps else out


def fox_attention(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor, *, causal: bool = True,
                  attn_mask: Tensor | None = None, offset: int | Tensor = 0, scale: float | None = None) -> Tensor:
    """Fast forgetting attention: one SDPA call with the bias in two extra Q/K channels (module docstring).
    Shapes as :func:`fox_attention_ref`."""
    n_rep, qpos, c = _prepare(q, k, log_f, offset)
    cdt = c.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(k, n_rep).to(cdt), repeat_kv(v, n_rep).to(cdt)
    cq = c[..., qpos, None]
    one_q, one_k = torch.ones_like(cq), torch.ones_like(c[..., None])
    qa = torch.cat((q.to(cdt) * scale, cq, one_q), -1)
    lower = torch.cat((k, one_k, -c[..., None]), -1)  # q'·k' = q·k·scale + c_i − c_j
    # CPU SDPA stays fused only with V as wide as Q and K; CUDA's fp32 (memory-efficient) kernel only with a
    # width that is a multiple of 8: at 66 it fell back to the materialized path (32 GiB at T = 16k on an H200)
    width = -(-max(qa.shape[-1], v.shape[-1]) // 8) * 8
    qa, lower = F.pad(qa, (0, width - qa.shape[-1])), F.pad(lower, (0, width - lower.shape[-1]))
    va = F.pad(v, (0, width - v.shape[-1]))
    if causal and attn_mask is None and isinstance(offset, int):
        out = sdpa(qa, lower, va, causal=True, offset=offset, attn_mask=None, scale=1.0)
    else:  # −|c_i − c_j|: keys j <= i through [k, 1, −c_j], keys j > i through [k, −1, c_j]
        upper = torch.cat((k, -one_k, c[..., None]), -1)
        upper = F.pad(upper, (0, width - upper.shape[-1]))
        tk = k.shape[-2]
        before = torch.arange(tk, device=q.device)[None, :] <= qpos[:, None]  # (Tq, Tk)
        user = distance_mask(qpos, tk, causal, attn_mask)  # causality and the user's mask, on both copies
        keep = torch.cat((before, ~before), -1)[None, None]  # 4-D: a 2-D mask would read as key padding
        if user is not None:
            user = user.expand(*user.shape[:-1], tk) if user.shape[-1] == 1 else user
            keep = torch.cat((user, user), -1).logical_and(keep) if user.dtype == torch.bool else (
                torch.cat((user, user), -1).masked_fill(~keep, float("-inf")))
        out = sdpa(qa, torch.cat((lower, upper), -2), torch.cat((va, va), -2), causal=False, offset=0,
                   attn_mask=keep, scale=1.0)
    return out[..., : v.shape[-1]].to(q.dtype)


class ForgetCache(KVCache):
    """The KV cache plus ``log_f`` (B, H, S): each cached position's log forget gate per query head."""

    def __init__(self, k_shape, v_shape, log_f_shape, dtype: torch.dtype, device=None):
        super().__init__(k_shape, v_shape, dtype=dtype, device=device)
        # fp32 whatever the cache's dtype: c sums these over the whole context
        ldt = torch.float64 if dtype == torch.float64 else torch.float32
        self.register_buffer("log_f", torch.zeros(log_f_shape, dtype=ldt, device=device), persistent=False)


@dataclass(frozen=True)
class FoxOptions:
    """FoX's ``ModelConfig.attn_options``: ``fox_gate_bias_init``, the forget gate's bias b at the start (the
    authors' code: 0, f ≈ σ(0) = ½; a larger b starts with a longer memory, f = σ(b))."""

    fox_gate_bias_init: float = 0.0


@register("fox", label="FoX", color="#7f7f7f")
class ForgettingAttention(StandardAttention):
    """Forgetting attention (FoX, Lin et al. 2025): standard multi-head (GQA) attention with the forget-gate
    bias (module docstring) and no position embedding (``uses_rope = False``). ``fgate_proj`` (E → H, no bias)
    and ``fgate_bias`` (H,) give the gate logits w_h·x + b_h; the bias is a parameter of its own so that the
    model's initialisation (which zeroes linear biases) leaves ``fox_gate_bias_init`` in place. Maps recorded
    by ``capture``: logits (biased), probs, forget (f, (B, H, T))."""

    fast_op, ref_op = staticmethod(fox_attention), staticmethod(fox_attention_ref)

    baseline = "standard"
    uses_rope = False
    supports_shared_qk = False
    Options = FoxOptions
    unsupported = {
        "export": "transformers' Llama has no forget gate (and applies RoPE)",
        "convert": ("FoX reaches a forget gate of exactly 1 (log f = 0) only as its bias goes to infinity, where "
                    "the gate's gradient is 0, and takes no RoPE: no exact, trainable conversion exists"),
        "serve": ("its logits carry a data-dependent decay, the difference of cumulative log forget gates, which "
                  "reduces to a per-key bias −Σ_{s≤j} log f_s over the request's whole prefix: vLLM's stock Attention "
                  "takes no logit bias (an extra key channel could carry one), and a step that sees only its new "
                  "tokens (decode, chunked prefill, a prefix-cache hit) lacks the earlier tokens' sum, state no "
                  "stock layer keeps"),
    }

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = False, gate_bias_init: float = 0.0, heads: HeadOptions | None = None):
        super().__init__(embed_dim, num_heads, num_kv_heads, head_dim, bias, heads=heads)
        self.gate_bias_init = float(gate_bias_init)
        self.fgate_proj = nn.Linear(embed_dim, num_heads, bias=False)
        self.fgate_bias = nn.Parameter(torch.full((num_heads,), self.gate_bias_init))

    def reset_parameters(self) -> None:
        self.fgate_bias.fill_(self.gate_bias_init)

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        return cls(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim, bias=cfg.attn_qkv_bias,
                   gate_bias_init=cfg.options.fox_gate_bias_init, heads=head_options(cfg, layer_idx))

    @classmethod
    def core_flops_per_token(cls, cfg: AttentionConfig, context: float) -> float:
        """Standard attention's QKᵀ and P·V (the forget bias adds O(1) work per logit, no multiply-adds in d)."""
        h, d = cfg.n_heads, cfg.qk_head_dim
        return 2 * (h * d + h * d) * context

    def setup_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype, device=None) -> None:
        self.cache = ForgetCache(*self.cache_shapes(batch_size, max_seq_len), (batch_size, self.num_heads, max_seq_len),
                                 dtype=dtype, device=device)

    def log_forget(self, x: Tensor) -> Tensor:
        """log f = logσ(w·x + b) per head and token, (B, H, T), in fp32 (fp64 for fp64)."""
        logits = self.fgate_proj(x).transpose(1, 2) + self.fgate_bias[:, None]
        return F.logsigmoid(logits.to(torch.float64 if x.dtype == torch.float64 else torch.float32))

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, margs: MaskArgs) -> Tensor:
        """The core with the forget gates log f (B, H, T) of x, appended to the cache's when decoding (where
        ``margs.offset`` holds the new tokens' positions)."""
        log_f = self.log_forget(x)
        if self.cache is not None:
            self.cache.log_f.index_copy_(2, margs.offset, log_f.to(self.cache.log_f.dtype))
            log_f = self.cache.log_f
        return self.core(q, k, v, margs, log_f)

    def extra_maps(self, log_f: Tensor) -> dict[str, Tensor]:
        return {"forget": log_f.exp()}
