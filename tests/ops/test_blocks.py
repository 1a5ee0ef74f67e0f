"""The building blocks in diffattn.ops: RMSNorm (ops.norm), RoPE (ops.rope) and the static KV cache (ops.kv_cache)."""

from __future__ import annotations

import pytest
import torch

from diffattn.ops.kv_cache import KVCache
from diffattn.ops.norm import RMSNorm
from diffattn.ops.rope import RotaryEmbedding, _rotate, _rotate_real, apply_rope


def _rope_interleaved_complex(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """GPT-J/official RoPE written as complex multiplication: (x[2i] + i·x[2i+1]) · e^{i·pos·θ^(-2i/D)}.
    x: (B, T, D), pos: (T,)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), d // 2, dtype=torch.float64), pos[:, None].double() * freqs[None])
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def test_rmsnorm():
    n = RMSNorm(6, eps=1e-5)
    with torch.no_grad():
        n.weight.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(3, 6)
    torch.testing.assert_close(n(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * n.weight)
    # a bf16 module keeps bf16 activations (the normalisation itself runs in fp32)
    assert n.bfloat16()(x.bfloat16()).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("d", [8, 16])
def test_rope_interleaved_matches_complex_formula(d):
    rope = RotaryEmbedding(d, 32, style="interleaved")
    pos = torch.tensor([0, 3, 17, 31])
    x = torch.randn(2, 3, 4, d)
    got = rope(pos)(x)
    want = _rope_interleaved_complex(x.reshape(6, 4, d), pos).reshape(2, 3, 4, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope(torch.tensor([0]))(x[:, :, :1]), x[:, :, :1])  # position 0: identity


def test_rope_neox_on_permuted_vector_equals_interleaved():
    d = 16
    # evens then odds: the interleaved pair (2i, 2i+1) lands on the neox pair (i, i + d/2)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    pos = torch.arange(10)
    x = torch.randn(2, 3, 10, d)
    inter = RotaryEmbedding(d, 16, style="interleaved")(pos)
    neox = RotaryEmbedding(d, 16, style="neox")(pos)
    torch.testing.assert_close(neox(x[..., perm]), inter(x)[..., perm], atol=1e-6, rtol=1e-6)
    assert (neox(x) - inter(x)).abs().max() > 1e-2  # and they are genuinely different layouts


@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_rope_scores_depend_only_on_relative_position(style):
    d = 16
    rope = RotaryEmbedding(d, 64, style=style)
    q, k = torch.randn(1, 1, 1, d, dtype=torch.float64), torch.randn(1, 1, 1, d, dtype=torch.float64)

    def score(m, n):
        qm = apply_rope(q, rope.cos[[m]].double(), rope.sin[[m]].double(), style)
        kn = apply_rope(k, rope.cos[[n]].double(), rope.sin[[n]].double(), style)
        return (qm * kn).sum().item()

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-5)
    assert score(9, 9) == pytest.approx(score(0, 0), abs=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-4  # ... but it does depend on the difference
    # rotations only: norms are preserved
    x = torch.randn(1, 1, 64, d)
    torch.testing.assert_close(rope(torch.arange(64))(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_rope_errors():
    with pytest.raises(ValueError, match="rope style"):
        RotaryEmbedding(8, 4, style="gptj")
    with pytest.raises(ValueError, match="even head dim"):
        RotaryEmbedding(7, 4)


# ------------------------------------------------------------------------------------------ KV cache
def test_kv_cache_buffer_writes_positions_in_place():
    c = KVCache((1, 2, 6, 3), (1, 2, 6, 4), dtype=torch.float32)
    k, v = torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 4)
    kk, vv = c.update(torch.tensor([2, 3]), k, v)
    assert kk is c.k and c.max_seq_len == 6
    torch.testing.assert_close(kk[:, :, 2:4], k)
    torch.testing.assert_close(vv[:, :, 2:4], v)
    assert kk[:, :, [0, 1, 4, 5]].abs().sum() == 0
    with pytest.raises(ValueError, match="batch size"):
        c.update(torch.tensor([0]), torch.randn(2, 2, 1, 3), torch.randn(2, 2, 1, 4))


@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_rope_real_form_used_under_compile_equals_complex_form(style):
    rope = RotaryEmbedding(16, 32, style=style)
    pos = torch.arange(5, 17)
    x = torch.randn(2, 3, len(pos), 16, dtype=torch.float64)
    cos, sin = rope.cos[pos].double(), rope.sin[pos].double()
    torch.testing.assert_close(_rotate_real(x, cos, sin, style), _rotate(x, torch.complex(cos, sin), style),
                               rtol=1e-12, atol=1e-12)
