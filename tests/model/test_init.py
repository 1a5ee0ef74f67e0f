"""Meta-device construction: a model built on the meta device and initialised in place (to_empty +
init_weights) equals the model built eagerly after the same seed, for every attention type."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffattn import ModelConfig, TransformerLM
from diffattn.attention.diff import lambda_init_fn
from diffattn.attention.registry import ATTENTION
from diffattn.model.init import is_meta, materialize, replay_init
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    for (na, x), (nb, y) in zip(a.named_buffers(), b.named_buffers()):  # non-persistent too (RoPE, λ scale)
        assert na == nb and torch.equal(x, y), na


def _both(build, seed: int = 7) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = build()
    rng_eager = torch.get_rng_state()
    with torch.device("meta"):
        meta = build()
    assert is_meta(meta)
    torch.manual_seed(seed)
    materialize(meta, "cpu")
    assert not is_meta(meta)
    assert torch.equal(torch.get_rng_state(), rng_eager)  # the same random numbers were drawn, in the same order
    return eager, meta


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("tie", [True, False])
def test_meta_built_lm_initialises_to_the_eager_weights(attention, tie):
    kw = dict(shared_qk=True) if ATTENTION[attention].supports_shared_qk and tie else {}
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=3, n_heads=2, attention=attention, max_seq_len=16,
                      tie_embeddings=tie, bias=not tie, **kw)
    eager, meta = _both(lambda: TransformerLM(cfg))
    _same(eager, meta)
    assert (meta.lm_head.weight is meta.body.tok_emb.weight) == tie  # to_empty unties; init_weights re-ties
    ids = torch.randint(0, 40, (2, 16))
    assert torch.equal(eager(ids), meta(ids))


@pytest.mark.parametrize(("attention", "shared_qk"), [
    (t, s) for t, cls in sorted(ATTENTION.items()) if "dual_lambda" in getattr(cls.Options, "__dataclass_fields__", {})
    for s in (False, True) if cls.supports_shared_qk or not s])
def test_meta_built_lm_with_timms_v1_options_initialises_to_the_eager_weights(attention, shared_qk):
    # dual_lambda (two scalars from 0) and qk_norm (two more RMSNorms) change what a V1-family module holds
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, attention=attention, max_seq_len=16,
                      shared_qk=shared_qk, attn_options={"dual_lambda": True, "qk_norm": True})
    eager, meta = _both(lambda: TransformerLM(cfg))
    _same(eager, meta)
    assert meta.blocks[0].attn.q_norm is not None and meta.blocks[0].attn.lambda_a.item() == 0.0
    ids = torch.randint(0, 40, (2, 16))
    assert torch.equal(eager(ids), meta(ids))


@pytest.mark.parametrize("attention", sorted(t for t, cls in ATTENTION.items() if cls.selects_heads))
def test_meta_built_head_selected_retrofit_initialises_its_head_mask(attention):
    # the head mask is a buffer built from the config, not in the checkpoint: to_empty leaves it without values
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=3, n_heads=4, attention=attention, max_seq_len=16, head_dim=8,
                      layer_attention=[attention, "standard", attention], diff_heads=[[0, 2], [], [3]])
    eager, meta = _both(lambda: TransformerLM(cfg))
    _same(eager, meta)
    assert meta.blocks[0].attn.head_mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert meta.blocks[2].attn.head_mask.tolist() == [0.0, 0.0, 0.0, 1.0]
    ids = torch.randint(0, 40, (2, 16))
    assert torch.equal(eager(ids), meta(ids))


def test_meta_built_diff_model_keeps_lambda_init_per_depth():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=5, n_heads=2, attention="diff", max_seq_len=16)
    eager, meta = _both(lambda: TransformerLM(cfg), seed=3)
    want = [lambda_init_fn(i) for i in range(5)]
    assert [b.attn.lambda_init for b in meta.blocks] == want == [b.attn.lambda_init for b in eager.blocks]
    assert want[:2] == pytest.approx([0.2, 0.3555], abs=1e-4)
    lam = [b.attn.lambda_full().item() for b in meta.blocks]
    assert lam == [b.attn.lambda_full().item() for b in eager.blocks]
    assert all(b.attn.lambda_q1.std() > 0 for b in meta.blocks)  # drawn, not left at zero


def test_meta_built_classifier_and_encoder_initialise_to_the_eager_weights():
    cfg = ModelConfig(vocab_size=30, d_model=32, n_layers=2, n_heads=2, attention="diff", max_seq_len=16)
    _same(*_both(lambda: TransformerClassifier(cfg, 3)))
    _same(*_both(lambda: TransformerEncoder(cfg)))


def test_init_weights_restores_a_trained_model_to_its_seed():
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, attention="diff", max_seq_len=16)
    torch.manual_seed(1)
    fresh = TransformerLM(cfg)
    model = TransformerLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.blocks[0].attn.lambda_scale.fill_(0.0)
    torch.manual_seed(1)
    model.init_weights()
    _same(fresh, model)


def test_a_module_with_tensors_but_no_reset_parameters_cannot_be_initialised_in_place():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    with pytest.raises(TypeError, match=r"Odd holds w but has no reset_parameters"):
        replay_init(nn.Sequential(nn.Linear(2, 2), Odd()))


def test_a_module_that_replays_its_own_subtree_is_not_walked():
    calls = []

    class Inner(nn.Linear):
        def reset_parameters(self):
            calls.append("inner")

    class Whole(nn.Module):  # replaced a child its constructor first built: it replays everything itself
        def __init__(self):
            super().__init__()
            self.inner = Inner(2, 2)

        def reset_subtree(self):
            calls.append("whole")

    model = nn.Sequential(Whole(), Inner(2, 2))
    calls.clear()  # the constructors reset too
    replay_init(model)
    assert calls == ["whole", "inner"]  # its child's reset is its own business; a sibling's still runs
