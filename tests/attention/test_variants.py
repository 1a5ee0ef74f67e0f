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
# the types that select heads, with a head mask (ModelConfig.diff_heads) on both layers: "diff+heads"
MASKED = TYPES + [f"{t}+heads" for t in TYPES if ATTENTION[t].selects_heads]


def _cfg(attention: str, **kw) -> ModelConfig:
    """4 query heads of width 8 for every type (2 diff-heads with 2 sub-heads each), GQA with 2 KV heads;
    "TYPE+heads": the first head selected in layer 0, the last in layer 1 (the others standard heads)."""
    attention, masked = attention.removesuffix("+heads"), attention.endswith("+heads")
    split = ATTENTION[attention].head_split
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=4 // split, n_kv_heads=2 // split,
                max_seq_len=24, attention=attention, init_std=0.2)
    if masked:
        base["diff_heads"] = [[0], [4 // split - 1]]
    return ModelConfig(**{**base, **kw})


def _perturb_norms(model: torch.nn.Module) -> None:
    """Move 1-D parameters (norm gains, λ vectors, per-head scalars) off their init so they take part."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("attention", MASKED)
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


@pytest.mark.parametrize("attention", MASKED)
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


@pytest.mark.parametrize("attention", MASKED)
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



# The pretrained families' options (ModelConfig; attention/base.HeadOptions), all at once on every type: biases on
# q/k/v and not o, QK-norm, a window on layer 1 shorter than the sequences below, a logit scalar, Gemma's norms
# ((1 + w), after attention and MLP), GeGLU, scaled embeddings, a local RoPE base for the window layer.
FAMILY = dict(qkv_bias=True, out_bias=False, qk_norm=True, sliding_window=3, window_layers=[1],
              query_pre_attn_scalar=5.0, post_attn_norm=True, post_ffn_norm=True, norm_unit_offset=True,
              mlp_activation="gelu_tanh", scale_embeddings=True, rope_local_theta=100.0)


def _family_options(attention: str) -> dict:
    """FAMILY, less the window where a type does not define one (its ``window_note`` says why)."""
    if ATTENTION[attention].window_note is None:
        return FAMILY
    return {**FAMILY, "sliding_window": None, "window_layers": None, "rope_local_theta": None}


def _family_model(attention: str, **kw) -> TransformerLM:
    cfg = _cfg(attention, **{**_family_options(attention), **kw})
    torch.manual_seed(0)
    model = TransformerLM(cfg).double()
    _perturb_norms(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # biases start at 0: move them so that they take part
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    return model.eval()


@pytest.mark.parametrize("attention", TYPES)
def test_family_options_causal_fast_equals_reference_and_kv_cache(attention):
    """Every type with the families' options: causal on both paths, fast == reference (forward and gradients),
    KV-cache decoding == the full forward (the window then masks cached keys), and the bidirectional
    classifier's fast == reference."""
    model = _family_model(attention)
    assert model.blocks[1].attn.window == _family_options(attention)["sliding_window"]
    assert model.blocks[0].attn.window is None
    assert model.blocks[0].attn.q_norm is not None and model.blocks[0].attn.out_proj.bias is None
    ids = torch.randint(0, 50, (2, 11))
    outs = {}
    for reference in (False, True):
        for b in model.blocks:
            b.attn.use_reference = reference
        with torch.no_grad():
            base = model(ids)
            later = ids.clone()
            later[:, 8:] = (later[:, 8:] + 1) % 50
            torch.testing.assert_close(model(later)[:, :8], base[:, :8], rtol=0, atol=1e-12)
            model.setup_cache(2, 12)  # decoding past the window of 3: cached keys behind it are masked
            steps = [model(ids[:, :7], input_pos=torch.arange(7))]
            steps += [model(ids[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(7, 11)]
            model.clear_cache()
        torch.testing.assert_close(torch.cat(steps, 1), base, rtol=1e-10, atol=1e-10)
        model.zero_grad()
        model(ids).square().mean().backward()
        outs[reference] = base, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=1e-9, atol=1e-9)
    for n, grad in outs[False][1].items():
        torch.testing.assert_close(outs[True][1][n], grad, rtol=1e-7, atol=1e-9, msg=n)

    clf = TransformerClassifier(_cfg(attention, **_family_options(attention)), num_classes=3).double()
    _perturb_norms(clf)
    pad = torch.ones(2, 11, dtype=torch.bool)
    pad[0, 8:] = False
    fast = clf(ids, pad)
    for b in clf.encoder.body.blocks:
        b.attn.use_reference = True
    torch.testing.assert_close(clf(ids, pad), fast, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("attention", TYPES)
def test_a_window_layer_does_not_see_keys_behind_its_window(attention):
    """One layer, a window of 3: the output at position t depends on tokens t-2..t only (fast and reference). A
    type that does not define a window refuses it, in one line saying why."""
    note = ATTENTION[attention].window_note
    if note is not None:
        with pytest.raises(ValueError, match=f"sliding_window is not defined for attention '{attention}'"):
            _cfg(attention, sliding_window=3)
        return
    model = _family_model(attention, n_layers=1, window_layers=None)
    ids = torch.randint(0, 50, (1, 12))
    for reference in (False, True):
        for b in model.blocks:
            b.attn.use_reference = reference
        with torch.no_grad():
            base = model(ids)
            for t in (5, 9):
                changed = ids.clone()
                changed[:, : t - 2] = (changed[:, : t - 2] + 7) % 50  # everything behind the window of t
                out = model(changed)
                torch.testing.assert_close(out[:, t], base[:, t], rtol=0, atol=1e-12)
                assert (out[:, t - 1] - base[:, t - 1]).abs().max() > 1e-6  # t-1's window reaches t-3
