"""Shared attention math in diffattn.ops.core: mask semantics and GQA head repetition."""

import torch

from diffattn.ops.core import build_mask, repeat_kv


def test_build_mask_semantics():
    m = build_mask(2, 4, causal=True, offset=2)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    pad = torch.tensor([[True, False, True, True]])
    m = build_mask(2, 4, causal=True, offset=2, attn_mask=pad)
    assert m.shape == (1, 1, 2, 4)
    assert m[0, 0].tolist() == [[True, False, True, False], [True, False, True, True]]
    assert build_mask(3, 3, causal=False) is None


def test_repeat_kv_maps_query_head_i_to_kv_head_i_div_nrep():
    x = torch.arange(3.0).view(1, 3, 1, 1)
    assert repeat_kv(x, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert repeat_kv(x, 1) is x
