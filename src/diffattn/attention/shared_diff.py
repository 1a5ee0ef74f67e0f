"""Shared DIFF attention (Shared DIFF Transformer, Cang et al., arXiv 2501.17900): V1's differential attention
(softmax(Q1K1ᵀ/√d) − λ·softmax(Q2K2ᵀ/√d))·V whose two maps' projections share one base matrix plus a low-rank
update per map:

    Q_m = X·(W_Q + A_Q,m B_Q,m)ᵀ,   K_m = X·(W_K + A_K,m B_K,m)ᵀ,   m = 1, 2

with W_Q: (h·d, E) shared by both maps (the "common mode"), A_Q,m: (h·d, r), B_Q,m: (r, E) (rank r), likewise
for K; V, λ, the per-head norm and the output projection are V1's. Only the abstract of the paper could be read
here (no official code exists): the form above, the rank (``shared_rank``, default an eighth of the update's full
rank, h·d/8: d at 8 diff-heads) and the initialisation (every factor drawn like any projection) are our choices;
README says so. At the default rank the Q and K projections hold 0.69× V1's parameters at any shape
(E·h·d + 2r·(E + h·d) with h·d = E/2, r = h·d/8, against V1's E²).

``shared_projection_ref`` materializes W + A_m B_m (the spec); the fast path applies X·Wᵀ + (X·B_mᵀ)·A_mᵀ and
never forms the (h·d, E) update. The attention op is V1's (:func:`~diffattn.attention.diff.diff_attention`,
SDPA, or the opt-in Triton kernel). Shapes as :mod:`diffattn.attention.diff`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.attention.base import AttentionBase, AttentionConfig, check_positive, head_options, split_heads
from diffattn.attention.diff import DiffOptions, MultiheadDiffAttention, v1_kwargs
from diffattn.attention.diff_recipes import DiffServed
from diffattn.attention.registry import register, serves


def shared_projection_ref(x: Tensor, base: Tensor, downs: list[Tensor], ups: list[Tensor],
                          bias: Tensor | None = None) -> list[Tensor]:
    """Each map's projection with its weight materialized: x (B, T, E) @ (base + ups[m] @ downs[m])ᵀ (+ bias)
    for m = 0, 1. base: (n, E), downs[m]: (r, E), ups[m]: (n, r). Returns two (B, T, n)."""
    out = []
    for down, up in zip(downs, ups):
        y = x @ (base + up @ down).T
        out.append(y if bias is None else y + bias)
    return out


def shared_projection(x: Tensor, base: nn.Linear, down: nn.Linear, ups: list[nn.Linear]) -> list[Tensor]:
    """Fast :func:`shared_projection_ref`: x·baseᵀ once, plus each map's rank-r path (x·Bᵀ)·Aᵀ; ``down`` holds
    both maps' B stacked, (2r, E). Returns two (B, T, n)."""
    common = base(x)
    low = down(x).chunk(2, dim=-1)
    return [common + up(z) for up, z in zip(ups, low)]


def interleave_maps(a: Tensor, b: Tensor, n: int) -> Tensor:
    """Map-1 and map-2 projections (B, T, n·d) -> V1's sub-head layout (B, 2n, T, d): [a_0, b_0, a_1, b_1, ...]."""
    bt = a.shape[:-1]
    return split_heads(torch.stack((a.view(*bt, n, -1), b.view(*bt, n, -1)), dim=-2).reshape(*bt, -1), 2 * n)


def interleave_rows(a: Tensor, b: Tensor, n: int) -> Tensor:
    """Map-1 and map-2 rows (n·d, ...) -> V1's sub-head order (2n·d, ...): [a_0, b_0, a_1, b_1, ...]."""
    return torch.stack((a.reshape(n, -1, *a.shape[1:]), b.reshape(n, -1, *b.shape[1:])), dim=1).reshape(
        2 * a.shape[0], *a.shape[1:])


@dataclass(frozen=True)
class SharedDiffOptions(DiffOptions):
    """Shared DIFF's ``ModelConfig.attn_options``: V1's (:class:`~diffattn.attention.diff.DiffOptions`) and
    ``shared_rank``, the rank r of each map's update (None: h·d/8, an eighth of the update's full rank, at
    least 1)."""

    shared_rank: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_rank is not None and self.shared_rank < 1:
            raise ValueError(f"shared_rank must be a positive int or None, got {self.shared_rank!r}")


@register("shared_diff", label="Shared-DIFF", color="#17becf")
class SharedDiffAttention(MultiheadDiffAttention):
    """Shared DIFF attention (module docstring) on V1's head layout: ``q_proj`` (h·d, E) and ``k_proj``
    (hkv·d, E) are the shared bases, ``q_down`` (2r, E) / ``q_up1``, ``q_up2`` (h·d, r) the maps' rank-r
    updates (likewise ``k_*``); V, λ, ``subln`` and ``out_proj`` as V1. ``shared_qk``: no key projections at
    all (K_m = Q_m). It has fewer parameters than V1 (the base is shared), so its matched baseline (standard
    attention at twice the heads) gets a narrower FFN that makes the totals match (``match_baseline_ffn``)."""

    functional_ops = (shared_projection, shared_projection_ref)
    selects_heads = False  # V1's head mask (diff_heads) is V1's own forward; this type's op takes none

    Options = SharedDiffOptions
    match_baseline_ffn = True
    unsupported = {"export": "transformers has no Shared DIFF model",
                   "convert": "its parameters are not V1's (a shared base plus low-rank updates): no recipe maps a "
                              "standard model onto them exactly"}

    def __init__(self, embed_dim: int, num_heads: int, depth: int, num_kv_heads: int | None = None,
                 rank: int | None = None, **v1):
        super().__init__(embed_dim, num_heads, depth, num_kv_heads, **v1)
        d, bias = self.head_dim, self.v_proj.bias is not None
        self.rank = max(1, num_heads * d // 8) if rank is None else rank
        check_positive(rank=self.rank)
        self.q_proj = nn.Linear(embed_dim, num_heads * d, bias=bias)
        self.q_down = nn.Linear(embed_dim, 2 * self.rank, bias=False)
        self.q_up1, self.q_up2 = (nn.Linear(self.rank, num_heads * d, bias=False) for _ in range(2))
        if not self.shared_qk:
            self.k_proj = nn.Linear(embed_dim, self.num_kv_heads * d, bias=bias)
            self.k_down = nn.Linear(embed_dim, 2 * self.rank, bias=False)
            self.k_up1, self.k_up2 = (nn.Linear(self.rank, self.num_kv_heads * d, bias=False) for _ in range(2))

    def reset_subtree(self) -> None:
        """Initialise in place as the constructor did, drawing the same random numbers in the same order (see
        :func:`diffattn.model.init.replay_init`): V1's constructor first, whose ``q_proj`` and ``k_proj`` (V1's
        shapes) this one then replaced (drawn again here and dropped), then this one's own projections."""
        e, bias = self.v_proj.in_features, self.v_proj.bias is not None
        nn.Linear(e, 2 * self.num_heads * self.head_dim, bias=bias, device="cpu")  # V1's q_proj
        if not self.shared_qk:
            nn.Linear(e, 2 * self.num_kv_heads * self.head_dim, bias=bias, device="cpu")  # V1's k_proj
        self.v_proj.reset_parameters()
        self.out_proj.reset_parameters()
        super().reset_parameters()  # λ
        for norm in (self.q_norm, self.k_norm, self.subln):
            if norm is not None:
                norm.reset_parameters()
        for which in ("q",) if self.shared_qk else ("q", "k"):
            for part in ("proj", "down", "up1", "up2"):
                getattr(self, f"{which}_{part}").reset_parameters()

    @classmethod
    def from_config(cls, cfg: AttentionConfig, layer_idx: int) -> AttentionBase:
        o = cfg.options
        return cls(cfg.d_model, cfg.n_heads, layer_idx, cfg.n_kv_heads, rank=o.shared_rank, norm_eps=cfg.norm_eps,
                   bias=cfg.attn_qkv_bias, shared_qk=cfg.shared_qk, head_dim=cfg.head_dim, **v1_kwargs(cfg),
                   heads=head_options(cfg, layer_idx))

    def _maps(self, x: Tensor, which: str) -> list[Tensor]:
        base, down = getattr(self, f"{which}_proj"), getattr(self, f"{which}_down")
        ups = [getattr(self, f"{which}_up1"), getattr(self, f"{which}_up2")]
        if self.reference_path:
            r = self.rank
            downs = [down.weight[:r], down.weight[r:]]
            return shared_projection_ref(x, base.weight, downs, [u.weight for u in ups], base.bias)
        return shared_projection(x, base, down, ups)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = interleave_maps(*self._maps(x, "q"), self.num_heads)
        k = q if self.shared_qk else interleave_maps(*self._maps(x, "k"), self.num_kv_heads)
        return q, k, split_heads(self.v_proj(x), self.num_kv_heads)


@serves(SharedDiffAttention)
class SharedDiffServed(DiffServed):
    """Served as V1 (``as_type``): each map's projection merged, W + A_m B_m, gives V1's weights computing the
    same function, so V1's layer and KV cache serve it."""

    as_type = "diff"

    @classmethod
    def weights(cls, module: nn.Module) -> dict[str, Tensor]:
        """V1's weights computing the same function: each map's projection merged, W + A_m B_m (in float64,
        then rounded once), interleaved into V1's sub-head layout; the base's bias goes to both maps."""
        projections = tuple(f"{w}_{part}" for w in "qk" for part in ("proj", "down", "up"))
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(projections)}
        for which in ("q", "k"):
            src = "q" if module.shared_qk else which
            base, down = getattr(module, f"{src}_proj"), getattr(module, f"{src}_down").weight.double()
            n = module.num_heads if src == "q" else module.num_kv_heads
            maps = [base.weight.double() + getattr(module, f"{src}_up{m + 1}").weight.double()
                    @ down[m * module.rank:(m + 1) * module.rank] for m in (0, 1)]
            state[f"{which}_proj.weight"] = interleave_rows(*maps, n).to(base.weight.dtype)
            if base.bias is not None:
                state[f"{which}_proj.bias"] = interleave_rows(base.bias, base.bias, n)
        if module.shared_qk and module.q_norm is not None:
            state["k_norm.weight"] = state["q_norm.weight"]
        return state
