"""Fused differential attention V1 in Triton: both softmax maps in one pass over K/V, forward and backward.

Import only through :func:`diffattn.attention.diff.diff_attention` (``backend="triton"``): this module needs
triton, which the package does not require. On CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is first imported), which is how the tests check it against ``diff_attention_ref``.

Layout as ``diff_attention_ref``: q (B, 2h, Tq, d) with diff-head i owning sub-heads 2i (Q1) and 2i+1 (Q2);
k (B, 2hkv, Tk, d) with KV diff-head g owning 2g (K1), 2g+1 (K2); v (B, hkv, Tk, 2d); both maps of diff-head i
read KV diff-head i // n_rep (official GQA pairing). Output (B, h, Tq, 2d).

Forward, per (batch, diff-head, query tile): each K1/K2/V tile is loaded once; s1 = Q1K1ᵀ·scale and
s2 = Q2K2ᵀ·scale (width d), one V tile (width 2d) feeds two online softmaxes, and
out = acc1/l1 − λ·acc2/l2. Saved for the backward: the two log-sum-exp rows (B, h, 2, Tq) fp32 and O2 =
acc2/l2 (B, h, Tq, 2d) in the input dtype — one extra output-sized tensor, from which O1 = out + λ·O2, so the
backward needs no extra pass over K/V to get rowsum(dO ⊙ O2).

Backward: with dO1 = dO and dO2 = −λ·dO, dP2 = −λ·dP1, so one dP = dO·Vᵀ tile serves both maps;
dV = (P1 − λ·P2)ᵀ·dO (one matmul); dS_i = P_i ⊙ (dP_i − D_i), D1 = rowsum(dO ⊙ O1), D2 = −λ·rowsum(dO ⊙ O2);
dλ = −Σ dO ⊙ O2. One kernel per key tile (dK1, dK2, dV; it loops over the n_rep query diff-heads of its KV
head, so no atomics), one per query tile (dQ1, dQ2). Accumulation is fp32 for every input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


def interpreted() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter."""
    return type(_fwd_kernel).__name__ == "InterpretedFunction"


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (interpreter only): its bf16 dot multiplies raw bit patterns, so
    bf16 operands go in as fp32 — exact products of bf16 values, only the summation order differs."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _fwd_kernel(
    Q, K, V, LAM, OUT, O2, LSE,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sot, sod,
    H, N_REP, TQ, TK, OFFSET, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # batch offsets can pass 2^31 elements
    hh = pid_bh % H
    g = hh // N_REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < TQ
    q_ptr = Q + b * sqb + (2 * hh) * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q_mask = m_ok[:, None] & (offs_d[None, :] < D)
    q1 = tl.load(q_ptr, mask=q_mask, other=0.0)
    q2 = tl.load(q_ptr + sqh, mask=q_mask, other=0.0)
    k_base = K + b * skb + (2 * g) * skh
    v_base = V + b * svb + g * svh
    # a finite floor instead of -inf: exp2(m_old - m_new) stays defined while a row has seen no key yet
    m1 = tl.full([BLOCK_M], -1.0e30, tl.float32)
    m2 = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = TK
    if CAUSAL:  # keys after this tile's last query position are never visible
        hi = tl.minimum(TK, OFFSET + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < TK
        k_ptr = k_base + offs_n[:, None] * skt + offs_d[None, :] * skd
        k_mask = n_ok[:, None] & (offs_d[None, :] < D)
        k1 = tl.load(k_ptr, mask=k_mask, other=0.0)
        k2 = tl.load(k_ptr + skh, mask=k_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svt + offs_dv[None, :] * svd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        keep = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= OFFSET + offs_m[:, None])
        s1 = _mm(q1, tl.trans(k1), PREC, UPCAST) * qk_scale
        s2 = _mm(q2, tl.trans(k2), PREC, UPCAST) * qk_scale
        s1 = tl.where(keep, s1, float("-inf"))
        s2 = tl.where(keep, s2, float("-inf"))
        mn1 = tl.maximum(m1, tl.max(s1, 1))
        mn2 = tl.maximum(m2, tl.max(s2, 1))
        p1 = tl.exp2(s1 - mn1[:, None])
        p2 = tl.exp2(s2 - mn2[:, None])
        a1 = tl.exp2(m1 - mn1)
        a2 = tl.exp2(m2 - mn2)
        l1 = l1 * a1 + tl.sum(p1, 1)
        l2 = l2 * a2 + tl.sum(p2, 1)
        acc1 = acc1 * a1[:, None] + _mm(p1.to(v.dtype), v, PREC, UPCAST)
        acc2 = acc2 * a2[:, None] + _mm(p2.to(v.dtype), v, PREC, UPCAST)
        m1 = mn1
        m2 = mn2
    lam = tl.load(LAM)
    # a row with no visible key (only possible for padding rows) gives zeros and lse = +inf (P = 0 in backward)
    o1 = acc1 / tl.where(l1 > 0, l1, 1.0)[:, None]
    o2 = acc2 / tl.where(l2 > 0, l2, 1.0)[:, None]
    o_ptr = offs_m[:, None] * sot + offs_dv[None, :] * sod
    o_mask = m_ok[:, None] & (offs_dv[None, :] < DV)
    out_base = b * sob + hh * soh
    tl.store(OUT + out_base + o_ptr, (o1 - lam * o2).to(OUT.dtype.element_ty), mask=o_mask)
    tl.store(O2 + out_base + o_ptr, o2.to(O2.dtype.element_ty), mask=o_mask)
    lse_base = LSE + pid_bh * 2 * TQ
    tl.store(lse_base + offs_m, tl.where(l1 > 0, m1 + tl.log2(tl.where(l1 > 0, l1, 1.0)), float("inf")), mask=m_ok)
    tl.store(lse_base + TQ + offs_m, tl.where(l2 > 0, m2 + tl.log2(tl.where(l2 > 0, l2, 1.0)), float("inf")),
             mask=m_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, LAM, DO, LSE, DELTA, DK, DVO,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
    H, N_REP, TQ, TK, OFFSET, qk_scale, sm_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dK1, dK2, dV for one key tile of KV diff-head g, summed over the n_rep query diff-heads reading it.
    dK, dV have the strides of k, v (contiguous copies are passed for all four)."""
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    hkv = H // N_REP
    b = (pid_bg // hkv).to(tl.int64)
    g = pid_bg % hkv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < TK
    k_off = b * skb + (2 * g) * skh + offs_n[:, None] * skt + offs_d[None, :] * skd
    k_mask = n_ok[:, None] & (offs_d[None, :] < D)
    k1 = tl.load(K + k_off, mask=k_mask, other=0.0)
    k2 = tl.load(K + k_off + skh, mask=k_mask, other=0.0)
    v_off = b * svb + g * svh + offs_n[:, None] * svt + offs_dv[None, :] * svd
    v_mask = n_ok[:, None] & (offs_dv[None, :] < DV)
    v = tl.load(V + v_off, mask=v_mask, other=0.0)
    lam = tl.load(LAM)
    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo = 0
    if CAUSAL:  # query tiles that end before this tile's first key see none of it
        lo = (tl.maximum(0, pid_n * BLOCK_N - OFFSET) // BLOCK_M) * BLOCK_M
    for r in range(0, N_REP):
        hh = g * N_REP + r
        q_base = Q + b * sqb + (2 * hh) * sqh
        do_base = DO + b * sdb + hh * sdh
        row_base = (b * H + hh) * 2 * TQ
        for start_m in range(lo, TQ, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < TQ
            q_ptr = q_base + offs_m[:, None] * sqt + offs_d[None, :] * sqd
            q_mask = m_ok[:, None] & (offs_d[None, :] < D)
            q1 = tl.load(q_ptr, mask=q_mask, other=0.0)
            q2 = tl.load(q_ptr + sqh, mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdt + offs_dv[None, :] * sdd,
                         mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse1 = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float("inf"))
            lse2 = tl.load(LSE + row_base + TQ + offs_m, mask=m_ok, other=float("inf"))
            d1 = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            d2 = tl.load(DELTA + row_base + TQ + offs_m, mask=m_ok, other=0.0)
            keep = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= OFFSET + offs_m[None, :])
            # transposed tiles (keys × queries): the key-side gradients are then plain row-major matmuls
            s1t = _mm(k1, tl.trans(q1), PREC, UPCAST) * qk_scale
            s2t = _mm(k2, tl.trans(q2), PREC, UPCAST) * qk_scale
            p1t = tl.exp2(tl.where(keep, s1t - lse1[None, :], float("-inf")))
            p2t = tl.exp2(tl.where(keep, s2t - lse2[None, :], float("-inf")))
            dv += _mm((p1t - lam * p2t).to(do.dtype), do, PREC, UPCAST)
            dpt = _mm(v, tl.trans(do), PREC, UPCAST)  # dP1ᵀ; dP2ᵀ = −λ·dP1ᵀ
            ds1t = p1t * (dpt - d1[None, :])
            ds2t = p2t * (-lam * dpt - d2[None, :])
            dk1 += _mm(ds1t.to(q1.dtype), q1, PREC, UPCAST)
            dk2 += _mm(ds2t.to(q2.dtype), q2, PREC, UPCAST)
    tl.store(DK + k_off, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DK + k_off + skh, (dk2 * sm_scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DVO + v_off, dv.to(DVO.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, LAM, DO, LSE, DELTA, DQ,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sdb, sdh, sdt, sdd,
    H, N_REP, TQ, TK, OFFSET, qk_scale, sm_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """dQ1, dQ2 for one query tile of diff-head hh (DQ has q's strides)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # batch offsets can pass 2^31 elements
    hh = pid_bh % H
    g = hh // N_REP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < TQ
    q_off = b * sqb + (2 * hh) * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q_mask = m_ok[:, None] & (offs_d[None, :] < D)
    q1 = tl.load(Q + q_off, mask=q_mask, other=0.0)
    q2 = tl.load(Q + q_off + sqh, mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + hh * sdh + offs_m[:, None] * sdt + offs_dv[None, :] * sdd,
                 mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    row_base = pid_bh * 2 * TQ
    lse1 = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float("inf"))
    lse2 = tl.load(LSE + row_base + TQ + offs_m, mask=m_ok, other=float("inf"))
    d1 = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
    d2 = tl.load(DELTA + row_base + TQ + offs_m, mask=m_ok, other=0.0)
    lam = tl.load(LAM)
    k_base = K + b * skb + (2 * g) * skh
    v_base = V + b * svb + g * svh
    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = TK
    if CAUSAL:
        hi = tl.minimum(TK, OFFSET + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < TK
        k_ptr = k_base + offs_n[:, None] * skt + offs_d[None, :] * skd
        k_mask = n_ok[:, None] & (offs_d[None, :] < D)
        k1 = tl.load(k_ptr, mask=k_mask, other=0.0)
        k2 = tl.load(k_ptr + skh, mask=k_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svt + offs_dv[None, :] * svd,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        keep = n_ok[None, :] & m_ok[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= OFFSET + offs_m[:, None])
        s1 = _mm(q1, tl.trans(k1), PREC, UPCAST) * qk_scale
        s2 = _mm(q2, tl.trans(k2), PREC, UPCAST) * qk_scale
        p1 = tl.exp2(tl.where(keep, s1 - lse1[:, None], float("-inf")))
        p2 = tl.exp2(tl.where(keep, s2 - lse2[:, None], float("-inf")))
        dp = _mm(do, tl.trans(v), PREC, UPCAST)
        ds1 = p1 * (dp - d1[:, None])
        ds2 = p2 * (-lam * dp - d2[:, None])
        dq1 += _mm(ds1.to(k1.dtype), k1, PREC, UPCAST)
        dq2 += _mm(ds2.to(k2.dtype), k2, PREC, UPCAST)
    tl.store(DQ + q_off, (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)
    tl.store(DQ + q_off + sqh, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


def _blocks(d: int, dv: int) -> tuple[int, int]:
    # tl.dot wants every dimension >= 16 and a power of two; the masks cover the padding
    return max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))


def _precision(dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast) for tl.dot: fp32 inputs get IEEE products (no TF32 rounding); bf16 under the
    interpreter is upcast (see :func:`_mm`)."""
    upcast = interpreted() and dtype == torch.bfloat16
    return ("ieee" if dtype == torch.float32 or upcast else "tf32"), upcast


def _launch_opts() -> dict:
    # untuned (no GPU was available to tune on): two (64, 2d) fp32 accumulators per program want 8 warps
    return {} if interpreted() else {"num_warps": 8, "num_stages": 2}


# The kernel pair is a registered custom op (torch.library) with its autograd formula, so torch.compile treats it
# as one opaque node (no graph break; the fake implementations give it shapes) and eager autograd runs it as well.
@torch.library.custom_op("diffattn::diff_attn_fwd", mutates_args=())
def diff_attn_fwd(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, causal: bool, offset: int, scale: float,
                  block_m: int, block_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v, lam (1,) fp32) -> (out (B, h, Tq, Dv), O2 (B, h, Tq, Dv), lse (B, h, 2, Tq) fp32)."""
    b, h2, tq, d = q.shape
    hkv, tk, dv = v.shape[1], k.shape[2], v.shape[-1]
    h = h2 // 2
    out = q.new_empty(b, h, tq, dv)
    o2 = torch.empty_like(out)
    lse = torch.empty(b, h, 2, tq, dtype=torch.float32, device=q.device)
    bd, bdv = _blocks(d, dv)
    prec, upcast = _precision(q.dtype)
    grid = (triton.cdiv(tq, block_m), b * h)
    _fwd_kernel[grid](
        q, k, v, lam, out, o2, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, h // hkv, tq, tk, offset, scale * LOG2E,
        D=d, DV=dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, PREC=prec,
        UPCAST=upcast, **_launch_opts(),
    )
    return out, o2, lse


@diff_attn_fwd.register_fake
def _fwd_fake(q, k, v, lam, causal, offset, scale, block_m, block_n):
    b, h2, tq, _ = q.shape
    out = q.new_empty(b, h2 // 2, tq, v.shape[-1])
    return out, torch.empty_like(out), q.new_empty(b, h2 // 2, 2, tq, dtype=torch.float32)


@torch.library.custom_op("diffattn::diff_attn_bwd", mutates_args=())
def diff_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, out: Tensor, o2: Tensor,
                  lse: Tensor, causal: bool, offset: int, scale: float, block_m: int,
                  block_n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv, dλ (1,)) of :func:`diff_attn_fwd`'s ``out``."""
    b, h2, tq, d = q.shape
    hkv, tk, dv = v.shape[1], k.shape[2], v.shape[-1]
    h = h2 // 2
    prec, upcast = _precision(q.dtype)
    dout = dout.contiguous()
    lam32 = lam.float()
    do32, o2_32 = dout.float(), o2.float()
    t2 = (do32 * o2_32).sum(-1)  # rowsum(dO ⊙ O2): (B, h, Tq)
    d1 = (do32 * (out.float() + lam32 * o2_32)).sum(-1)  # rowsum(dO1 ⊙ O1), O1 = out + λ·O2
    delta = torch.stack((d1, -lam32 * t2), dim=2).contiguous()  # (B, h, 2, Tq): D1, D2 = rowsum(dO2 ⊙ O2)
    dlam = -t2.sum().reshape(1)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dvv = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(vc)
    bd, bdv = _blocks(d, dv)
    common = dict(D=d, DV=dv, BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                  PREC=prec, UPCAST=upcast, **_launch_opts())
    strides = (*qc.stride(), *kc.stride(), *vc.stride(), *dout.stride())
    sizes = (h, h // hkv, tq, tk, offset, scale * LOG2E, scale)
    _bwd_dkdv_kernel[(triton.cdiv(tk, block_n), b * hkv)](
        qc, kc, vc, lam32, dout, lse, delta, dk, dvv, *strides, *sizes, **common)
    _bwd_dq_kernel[(triton.cdiv(tq, block_m), b * h)](
        qc, kc, vc, lam32, dout, lse, delta, dq, *strides, *sizes, **common)
    return dq, dk, dvv, dlam


@diff_attn_bwd.register_fake
def _bwd_fake(dout, q, k, v, lam, out, o2, lse, causal, offset, scale, block_m, block_n):
    # the real op returns contiguous gradients
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), lam.new_empty(1, dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, lam, causal, offset, scale, block_m, block_n = inputs
    out, o2, lse = output
    ctx.mark_non_differentiable(o2, lse)
    ctx.save_for_backward(q, k, v, lam, out, o2, lse)
    ctx.args = (causal, offset, scale, block_m, block_n)


def _backward(ctx, dout, _do2, _dlse):
    q, k, v, lam, out, o2, lse = ctx.saved_tensors
    dq, dk, dv, dlam = diff_attn_bwd(dout, q, k, v, lam, out, o2, lse, *ctx.args)
    return dq, dk, dv, dlam.to(lam.dtype), None, None, None, None, None


diff_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def diff_attention_triton(q: Tensor, k: Tensor, v: Tensor, lam: Tensor | float, *, causal: bool = True,
                          offset: int = 0, scale: float | None = None, block_m: int | None = None,
                          block_n: int | None = None) -> Tensor:
    """Fused differential attention V1. q (B, 2h, Tq, d), k (B, 2hkv, Tk, d), v (B, hkv, Tk, Dv), λ a scalar
    (float or a one-element tensor, which gets a gradient) -> (B, h, Tq, Dv) in q's dtype.

    Causal: key j is visible to query i iff j <= offset + i. Shapes are checked by the caller
    (:func:`diffattn.attention.diff.diff_attention`).
    """
    if not q.is_cuda and not interpreted():
        raise RuntimeError("the triton diff-attention kernel needs a CUDA device, or TRITON_INTERPRET=1 set "
                           "before diffattn.ops.triton_diff is first imported (CPU interpreter, for tests)")
    lam_t = torch.as_tensor(lam, device=q.device)
    if lam_t.numel() != 1:
        raise ValueError(f"the triton diff-attention kernel takes a scalar λ, got shape {tuple(lam_t.shape)}")
    lam_in = lam_t.reshape(1).float()
    dflt = 16 if interpreted() else 64
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _, _ = diff_attn_fwd(q, k, v, lam_in, bool(causal), int(offset), scale, block_m or dflt, block_n or dflt)
    return out

