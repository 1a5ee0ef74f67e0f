"""The block-wise distance-aware kernel: O(T) memory, flash-attention style, in pure PyTorch, with its own
backward (:class:`DistanceAttnFn`) and the per-call state and tables it shares between forward and backward
(:class:`DistanceState`). The score it computes is :mod:`.distance_score`'s.

Shapes and mask conventions as :mod:`diffattn.ops.core`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor  # imported by torch itself: costs nothing

from diffattn.ops.distance_score import distance_f


def _mask_block(m: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    if m.shape[-2] != 1:
        m = m[..., qs:qe, :]
    return m[..., ks:ke] if m.shape[-1] != 1 else m


def _distance_tables(w: Tensor, v_param: Tensor, length: int, scale: float) -> tuple[Tensor, Tensor]:
    """Per head and distance r < length: scale·f(w·r; v) as (H, L), and (σ(v − w·r)·r, σ(v − w·r)) as (2H, L).

    f depends on (head, distance) only, so the block loops gather from these tables instead of recomputing f.
    With s = ReLU(raw)·f·scale and E = dS ⊙ s: ∂L/∂w = Σ E·σ(v − x)·r and ∂L/∂v = Σ E·(σ(v) − σ(v − x)),
    because d log f / dx = σ(v − x) and d log f / dv = σ(v) − σ(v − x) (x = w·r).
    """
    r = torch.arange(length, device=w.device, dtype=w.dtype)
    x = w[:, None] * r
    vv = v_param[:, None]
    sig = torch.sigmoid(vv - x)
    return distance_f(x, vv) * scale, torch.cat((sig * r, sig))


# Scores at most this large are exponentiated directly (no running max): e^60 · 2^31 keys is still finite
# in fp32, and every unmasked score is >= 0 (ReLU · f · scale, scale > 0): exp(score) >= 1 cannot underflow.
_EXP_SAFE = 60.0


@dataclass
class DistanceState:
    """Per-call state of the block kernel, shared by forward and backward (built by :meth:`build`).

    ``qpos_l``: the query positions as ints; ``contiguous``: whether they are consecutive; ``length``: one
    more than the largest distance; ``bounded``: whether the softmax may skip the running max; ``fs``: scale·f
    per head and distance (H, L); ``dtab``: the gradient tables (2H, L) (:func:`_distance_tables`). Only for
    contiguous positions: ``fs_ext`` / ``dtab_ext`` (mirrored around distance 0, ext[L − 1 + r] = tab[|r|]),
    and the "signed distance >= 0" causal mask as a multiplicative (``keep``, on exp(s)) and an additive
    (``addneg``, on s) factor.
    """

    qpos_l: list[int]
    contiguous: bool
    length: int
    bounded: bool
    fs: Tensor
    dtab: Tensor
    fs_ext: Tensor | None = None
    dtab_ext: Tensor | None = None
    keep: Tensor | None = None
    addneg: Tensor | None = None

    @classmethod
    def build(cls, q: Tensor, k: Tensor, w: Tensor, v_param: Tensor, qpos: Tensor, mask: Tensor | None,
              scale: float) -> DistanceState:
        """The state for q (B, H, Tq, D), k (B, H, Tk, D), w, v_param (H,), qpos (Tq,), a 4-D mask or None."""
        fake = isinstance(q, FakeTensor)
        # On fake tensors (the memory planner counts what autograd saves, without data) positions cannot be read:
        # the planner runs a training forward, whose positions are 0..Tq-1. Both softmax paths save the same.
        qpos_l = list(range(qpos.shape[0])) if fake else qpos.tolist()
        contiguous = all(qpos_l[i + 1] == qpos_l[i] + 1 for i in range(len(qpos_l) - 1))
        length = max(max(qpos_l, default=0), k.shape[2] - 1) + 1
        fs, dtab = _distance_tables(w.detach(), v_param.detach(), length, scale)
        bounded = False
        if scale > 0 and (mask is None or mask.dtype == torch.bool) and q.numel() and k.numel() and not fake:
            # ReLU(q·k)·f·scale <= |q|·|k|·max(f·scale); a NaN/inf bound compares False -> online path
            bound = q.norm(dim=-1).amax() * k.norm(dim=-1).amax() * fs.amax()
            bounded = bool(bound <= _EXP_SAFE)
        st = cls(qpos_l=qpos_l, contiguous=contiguous, length=length, bounded=bounded, fs=fs, dtab=dtab)
        if contiguous:
            st.fs_ext, st.dtab_ext = (torch.cat((t.flip(-1), t[:, 1:]), -1) for t in (fs, dtab))
            keep = torch.arange(2 * length - 1, device=q.device) >= length - 1  # signed distance >= 0
            # causal masks as multiplicative (on exp(s)) / additive (on s) factors: a broadcast multiply by a
            # strided float view is several times faster than masked_fill_ with a strided bool view
            st.keep = keep.to(q.dtype)
            st.addneg = torch.zeros_like(st.keep).masked_fill_(~keep, float("-inf"))
        return st

    def key(self, qpos: Tensor, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int, int] | Tensor:
        """What fixes a tile's distances with keys reversed (column j' is key ke − 1 − j'): for contiguous
        positions (c, bq, bk) with R_ij' = |c + i + j'|, c = qpos[qs] − ke + 1; else the flat index
        (bq·bk,)."""
        if self.contiguous:
            return (self.qpos_l[qs] - ke + 1, qe - qs, ke - ks)
        kpos = torch.arange(ke - 1, ks - 1, -1, device=qpos.device)
        return (qpos[qs:qe, None] - kpos[None, :]).abs().flatten()

    def f_tile(self, key: tuple[int, int, int] | Tensor, bq: int, bk: int) -> Tensor:
        """scale·f at the tile's distances: (H, bq, bk)."""
        return self._gather(self.fs, self.fs_ext, key, bq, bk)

    def dtab_tile(self, key: tuple[int, int, int] | Tensor, bq: int, bk: int) -> Tensor:
        """The gradient tables at the tile's distances: (2H, bq, bk)."""
        return self._gather(self.dtab, self.dtab_ext, key, bq, bk)

    def _gather(self, tab: Tensor, ext: Tensor | None, key: tuple[int, int, int] | Tensor, bq: int,
                bk: int) -> Tensor:
        """Table ``tab`` (N, L) at the tile's distances: (N, bq, bk), a strided view of ``ext`` when key is a
        tuple."""
        if isinstance(key, tuple):
            off = ext.storage_offset() + self.length - 1 + key[0]
            return ext.as_strided((ext.shape[0], bq, bk), (ext.shape[1], 1, 1), off)
        return tab.index_select(1, key).view(tab.shape[0], bq, bk)

    def mask_tile(self, t: Tensor, fill: float, cut: bool, key: tuple[int, int, int] | Tensor, qpos_b: Tensor,
                  qs: int, qe: int, ks: int, ke: int, mask: Tensor | None) -> Tensor:
        """Masked entries of a key-reversed tile set to ``fill`` (−inf on scores, 0 on exp(scores)); a float
        user mask is added instead (scores only)."""
        if cut and isinstance(key, tuple):  # key after query <=> signed distance c + i + j' < 0
            tab = self.keep if fill == 0.0 else self.addneg
            off = tab.storage_offset() + self.length - 1 + key[0]
            view = tab.as_strided((t.shape[-2], t.shape[-1]), (1, 1), off)
            t = t.mul_(view) if fill == 0.0 else t.add_(view)
        elif cut:
            kpos = torch.arange(ke - 1, ks - 1, -1, device=t.device)
            t = t.masked_fill_(kpos[None, :] > qpos_b[:, None], fill)
        if mask is not None:
            mb = _mask_block(mask, qs, qe, ks, ke)
            mb = mb.flip(-1) if mb.shape[-1] != 1 else mb
            t = t.masked_fill_(~mb, fill) if mb.dtype == torch.bool else t.add_(mb.to(t.dtype))
        return t


class DistanceAttnFn(torch.autograd.Function):
    """Block-wise distance-aware attention with O(T) memory (flash-attention style, pure PyTorch).

    Forward: softmax over key blocks for each query block; saves only the output and the per-row logsumexp.
    Backward: recomputes each block's scores, dS = P ⊙ (dP − rowsum(dO ⊙ O)); through the product
    s = ReLU(raw)·f the raw-score gradient is dS·f·[raw > 0], and the (w, v) gradients are contractions of
    E = dS ⊙ s with per-distance tables (:class:`DistanceState`). Causal: key blocks entirely after a query
    block's last position are skipped; only blocks crossing the diagonal are masked elementwise.
    All heads equal (GQA is expanded by the caller); q, k, v in fp32/fp64.

    Speed (CPU, where every elementwise pass over a tile and every fresh allocation counts):
    - keys are visited in reverse order inside each block (K, V reversed once per call), so for contiguous
      query positions a tile's distance R_ij' = |c + i + j'| is a Hankel pattern: its f-tile, the causal
      mask and the gradient tables are zero-copy strided views of 1-D per-distance tables, not gathers;
    - when Cauchy–Schwarz bounds every score by :data:`_EXP_SAFE` (and masks are boolean) the softmax needs
      no running max: P = exp(s)·exp(−lse), and the backward folds the row factor exp(−lse) into dO and
      rowsum(dO ⊙ O) once per call; otherwise the online-softmax path with a running max runs;
    - f·[raw > 0] is one fused op (threshold_backward) reused for s and for dS; E is accumulated per block
      diagonal (tiles on one diagonal share their distances) and contracted with the tables once at the end;
    - tiles live in reused scratch buffers, and dK/dV accumulate in one contiguous buffer per key block.
    """

    @staticmethod
    def _blocks(qpos_l, tk, causal, bq, bk):
        """Yield (qs, qe, [(ks, ke, needs_causal_mask)]) for the non-skipped blocks."""
        tq = len(qpos_l)
        for qs in range(0, tq, bq):
            qe = min(tq, qs + bq)
            lo, hi = min(qpos_l[qs:qe]), max(qpos_l[qs:qe])
            kend = min(tk, hi + 1) if causal else tk
            ends = [(ks, min(kend, ks + bk)) for ks in range(0, kend, bk)]
            yield qs, qe, [(ks, ke, causal and ke - 1 > lo) for ks, ke in ends]

    @staticmethod
    def _tiles(n, like, bq, bk):
        """n flat scratch buffers for (B·H·bq·bk) tiles, reused by every block (views of their prefixes)."""
        size = like.shape[0] * like.shape[1] * max(1, bq) * max(1, bk)
        return [torch.empty(size, dtype=like.dtype, device=like.device) for _ in range(n)]

    @staticmethod
    def forward(ctx, q, k, v, w, v_param, qpos, mask, causal, scale, block_q, block_k):
        b, h, tq, d = q.shape
        tk, dv = k.shape[2], v.shape[-1]
        F_ = DistanceAttnFn
        st = DistanceState.build(q, k, w, v_param, qpos, mask, scale)
        bounded = st.bounded
        q3 = q.view(b * h, tq, d)
        kr3, vr3 = k.view(b * h, tk, d).flip(1), v.view(b * h, tk, dv).flip(1)  # key j at row tk − 1 − j
        out = torch.zeros(b, h, tq, dv, dtype=q.dtype, device=q.device)
        lse = torch.full((b, h, tq), float("-inf"), dtype=q.dtype, device=q.device)
        (sbuf,) = F_._tiles(1, q, min(block_q, tq), min(block_k, tk))
        for qs, qe, kblocks in F_._blocks(st.qpos_l, tk, causal, block_q, block_k):
            bq = qe - qs
            qb3, qpos_b = q3[:, qs:qe], qpos[qs:qe]
            m = torch.full((b, h, bq), 0.0 if bounded else float("-inf"), dtype=q.dtype, device=q.device)
            lsum = torch.zeros_like(m)
            acc = torch.zeros(b * h, bq, dv, dtype=q.dtype, device=q.device)
            for ks, ke, cut in kblocks:
                bk = ke - ks
                key = st.key(qpos, qs, qe, ks, ke)
                fb = st.f_tile(key, bq, bk)
                s = torch.bmm(qb3, kr3[:, tk - ke:tk - ks].transpose(1, 2),
                              out=sbuf[:b * h * bq * bk].view(b * h, bq, bk))
                s = s.view(b, h, bq, bk).clamp_min_(0).mul_(fb)
                if bounded:  # scores <= _EXP_SAFE: no running max, no rescaling
                    p = s.exp_()
                    if cut or mask is not None:
                        p = st.mask_tile(p, 0.0, cut, key, qpos_b, qs, qe, ks, ke, mask)
                else:
                    s = st.mask_tile(s, float("-inf"), cut, key, qpos_b, qs, qe, ks, ke, mask)
                    m_new = torch.maximum(m, s.amax(-1))
                    m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # all masked so far: exp() finite
                    p = s.sub_(m_safe[..., None]).exp_()
                    alpha = (m - m_safe).exp_()
                    lsum.mul_(alpha)
                    acc.mul_(alpha.view(-1, bq, 1))
                    m = m_new
                lsum.add_(p.sum(-1))
                acc.baddbmm_(p.view(-1, bq, bk), vr3[:, tk - ke:tk - ks])
            empty = lsum == 0  # every key masked: output zeros, as SDPA does
            torch.div(acc.view(b, h, bq, dv), lsum.masked_fill(empty, 1.0)[..., None], out=out[:, :, qs:qe])
            lse[:, :, qs:qe] = torch.where(empty, float("-inf"), m + lsum.clamp_min(1e-38).log())
        ctx.save_for_backward(q, k, v, w, v_param, qpos, out, lse)
        ctx.mask, ctx.causal, ctx.scale, ctx.block = mask, causal, scale, (block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, w, v_param, qpos, out, lse = ctx.saved_tensors
        mask, causal, scale = ctx.mask, ctx.causal, ctx.scale
        want_wv = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        b, h, tq, d = q.shape
        tk, dvw = k.shape[2], v.shape[-1]
        F_ = DistanceAttnFn
        st = DistanceState.build(q, k, w, v_param, qpos, mask, scale)
        bounded = st.bounded
        dout = dout.to(q.dtype).contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO ⊙ O): (B, H, Tq)
        if bounded:  # P = exp(s)·exp(−lse): fold the row factor into dO and delta once (all-masked rows: 0)
            inv = torch.exp(-lse).masked_fill_(torch.isinf(lse), 0.0)
            dout, delta = dout * inv[..., None], delta.mul_(inv)
        else:
            lse_safe = lse.masked_fill(torch.isinf(lse), float("inf"))  # all-masked rows: P = 0
        q3, do3 = q.view(b * h, tq, d), dout.view(b * h, tq, dvw)
        kr3, vr3 = k.view(b * h, tk, d).flip(1), v.view(b * h, tk, dvw).flip(1)  # key j at row tk − 1 − j
        dq = torch.zeros_like(q)
        dq3 = dq.view(b * h, tq, d)
        # dK, dV (key-reversed rows) accumulate per key block in contiguous buffers: baddbmm_ into a strided
        # slice of a (B·H, Tk, D) tensor falls back to one GEMM per batch entry, several times slower
        bk_max = ctx.block[1]
        kbl = [(ks, min(tk, ks + bk_max)) for ks in range(0, tk, bk_max)]
        dkb = [k.new_zeros(b * h, ke - ks, d) for ks, ke in kbl]
        dvb = [v.new_zeros(b * h, ke - ks, dvw) for ks, ke in kbl]
        e_acc: dict = {}  # per distance pattern: (Σ_batch E (H, bq, bk), key)
        thr_bw = torch.ops.aten.threshold_backward.grad_input
        bufs = F_._tiles(4, q, min(ctx.block[0], tq), min(bk_max, tk))
        for qs, qe, kblocks in F_._blocks(st.qpos_l, tk, causal, *ctx.block):
            bq = qe - qs
            qb3, qpos_b, dob3 = q3[:, qs:qe], qpos[qs:qe], do3[:, qs:qe]
            delta_b = delta[:, :, qs:qe, None]
            dqb = q3.new_zeros(b * h, bq, d)
            for ks, ke, cut in kblocks:
                bk = ke - ks
                kb3, vb3 = kr3[:, tk - ke:tk - ks], vr3[:, tk - ke:tk - ks]
                key = st.key(qpos, qs, qe, ks, ke)
                fb = st.f_tile(key, bq, bk)
                rawb, fposb, pb, dsb = (x[: b * h * bq * bk].view(b, h, bq, bk) for x in bufs)
                raw = torch.bmm(qb3, kb3.transpose(1, 2), out=rawb.view(b * h, bq, bk)).view(b, h, bq, bk)
                fpos = thr_bw(fb, raw, 0.0, grad_input=fposb)  # f·[raw > 0] = ∂s/∂raw; s = raw·fpos
                s = torch.mul(raw, fpos, out=pb)  # raw is kept: E = dS ⊙ s = (dS ⊙ fpos) ⊙ raw below
                if bounded:
                    p = s.exp_()
                    if cut or mask is not None:
                        p = st.mask_tile(p, 0.0, cut, key, qpos_b, qs, qe, ks, ke, mask)
                else:
                    s = s.sub_(lse_safe[:, :, qs:qe, None])
                    p = st.mask_tile(s, float("-inf"), cut, key, qpos_b, qs, qe, ks, ke, mask).exp_()
                p3 = p.view(b * h, bq, bk)
                j = ks // bk_max
                dkj, dvj = dkb[j], dvb[j]
                if dkj.shape[1] != bk:  # causal cut shorter than the block: its last keys are the first rows
                    cut_rows = kbl[j][1] - ke
                    dkj, dvj = dkj[:, cut_rows:cut_rows + bk], dvj[:, cut_rows:cut_rows + bk]
                dvj.baddbmm_(p3.transpose(1, 2), dob3)
                ds = torch.bmm(dob3, vb3.transpose(1, 2), out=dsb.view(b * h, bq, bk)).view(b, h, bq, bk)
                draw = ds.sub_(delta_b).mul_(p).mul_(fpos)  # ∂L/∂raw = dS ⊙ f ⊙ [raw > 0]
                if want_wv:  # E = dS ⊙ s = draw ⊙ raw
                    slot = e_acc.get(key) if isinstance(key, tuple) else None
                    if slot is None:
                        e = draw * raw if b == 1 else (draw * raw).sum(0, keepdim=True)
                        e_acc[key if isinstance(key, tuple) else len(e_acc)] = (e.view(h, bq, bk), key)
                    elif b == 1:
                        slot[0].view(1, h, bq, bk).addcmul_(draw, raw)
                    else:
                        slot[0].add_((draw * raw).sum(0))
                draw3 = draw.view(b * h, bq, bk)
                dqb.baddbmm_(draw3, kb3)
                dkj.baddbmm_(draw3.transpose(1, 2), qb3)
            dq3[:, qs:qe] = dqb
        gw = torch.zeros(h, dtype=q.dtype, device=q.device)
        gv = torch.zeros_like(gw)
        for e, key in e_acc.values():  # ∂/∂w = Σ E·σ(v−x)·r, ∂/∂v = σ(v)·Σ E − Σ E·σ(v−x)
            tab = st.dtab_tile(key, e.shape[1], e.shape[2]).view(2, h, e.shape[1], e.shape[2])
            prod = [torch.mul(tab[i], e, out=bufs[i][: e.numel()].view(e.shape)) for i in (0, 1)]  # no alloc
            gw += prod[0].sum((-2, -1))  # Σ E·σ(v−x)·r
            gv += torch.sigmoid(v_param.detach()) * e.sum((-2, -1)) - prod[1].sum((-2, -1))
        # block j of the reversed layout holds keys kbl[j] last-first; the blocks go last-first too
        dk = torch.cat(dkb[::-1], 1).flip(1).view(k.shape) if dkb else torch.zeros_like(k)
        dv = torch.cat(dvb[::-1], 1).flip(1).view(v.shape) if dvb else torch.zeros_like(v)
        return dq, dk, dv, gw.to(w.dtype), gv.to(v_param.dtype), None, None, None, None, None, None
