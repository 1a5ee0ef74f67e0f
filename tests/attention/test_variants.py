"""Every registered attention type, as a module inside a model: no causal output depends on a later token (fast
and reference path), the fast path equals the reference path (causal LM with GQA, bidirectional classifier with
padding), and KV-cache decoding equals the full forward. Each variant's own op tests live in its test file;
these hold for any file added to ``attention/`` (so a new variant is checked without editing this file)."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.registry import ATTENTION
from diffattn.interop.hf import to_hf_config
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerClassifier, TransformerLM

TYPES = sorted(ATTENTION)


def _cfg(attention: str, **kw) -> ModelConfig:
    """4 query heads of width 8 for every type (2 diff-heads with 2 sub-heads each), GQA with 2 KV heads."""
    split = ATTENTION[attention].head_split
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4 // split, n_kv_heads=2 // split,
                max_seq_len=24, attention=attention, init_std=0.2)
    return ModelConfig(**{**base, **kw})


def _perturb_norms(model: torch.nn.Module) -> None:
    """Move 1-D parameters (norm gains, λ vectors, per-head scalars) off their init so they take part."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_no_causal_output_depends_on_a_later_token(attention, reference):
    torch.manual_seed(0)
    model = TransformerLM(_cfg(attention)).double().eval()
    _perturb_norms(model)
    for b in model.blocks:
        b.attn.use_reference = reference
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        base = model(ids)
        for t in (4, 11):
            later = ids.clone()
            later[:, t:] = torch.randint(0, 50, later[:, t:].shape)
            out = model(later)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-6  # the later positions do see the change


@pytest.mark.parametrize("attention", TYPES)
def test_fast_path_equals_reference_path_causal_and_bidirectional(attention):
    torch.manual_seed(0)
    lm = TransformerLM(_cfg(attention))
    _perturb_norms(lm)
    ids = torch.randint(0, 50, (2, 13))
    fast = lm(ids)
    fast.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    for b in lm.blocks:
        b.attn.use_reference = True
    ref = lm(ids)
    torch.testing.assert_close(ref, fast, rtol=1e-5, atol=1e-5)
    ref.square().mean().backward()
    for n, p in lm.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)

    clf = TransformerClassifier(_cfg(attention), num_classes=3)
    _perturb_norms(clf)
    pad = torch.ones(2, 13, dtype=torch.bool)
    pad[0, 9:] = False
    fast = clf(ids, pad)
    for b in clf.encoder.body.blocks:
        b.attn.use_reference = True
    torch.testing.assert_close(clf(ids, pad), fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_kv_cache_decode_equals_full_forward(attention, reference):
    torch.manual_seed(0)
    model = TransformerLM(_cfg(attention)).double().eval()
    _perturb_norms(model)
    for b in model.blocks:
        b.attn.use_reference = reference
    ids = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        full = model(ids)
        model.setup_cache(2, 16)  # slots past the sequence stay unwritten: they must not count
        outs = [model(ids[:, :8], input_pos=torch.arange(8))]
        outs += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(8, 14)]
        model.clear_cache()
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attention", [t for t in TYPES if t not in ("standard", "diff")])
def test_hf_export_refuses_a_type_without_a_counterpart_naming_why(attention):
    with pytest.raises(ValueError, match=f"attention '{attention}' has no transformers counterpart") as e:
        to_hf_config(_cfg(attention, n_kv_heads=None))
    note = ATTENTION[attention].unsupported.get("export")
    assert note is None or note in str(e.value)

