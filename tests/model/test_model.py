"""Models in diffattn.model: config validation, the parameter-matched baseline, KV-cache decoding against the
full forward, the encoder/classifier with padding, and RoPE-free position behaviour."""

from __future__ import annotations

import pytest
import torch

from diffattn.attention.registry import ATTENTION
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM

ATTNS = ("standard", "diff", "diff_v2")


def cfg_for(attention: str, **kw) -> ModelConfig:
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, attention=attention)
    if attention == "standard":
        base["n_heads"] = 4  # the matched-width baseline of the diff config
    base.update(kw)
    return ModelConfig(**base)


def _randomize_norms(model: torch.nn.Module) -> None:
    """Move 1-D parameters (norm gains, λ vectors) off their init so they actually take part."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)


@pytest.mark.parametrize("attention", ATTNS)
def test_lm_logits_shape_and_finite(attention):
    m = TransformerLM(cfg_for(attention))
    ids = torch.randint(0, 50, (3, 11))
    out = m(ids)
    assert out.shape == (3, 11, 50)
    assert torch.isfinite(out).all()
    out.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


# ---------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("kw,match", [
    (dict(attention="diff", d_model=30, n_heads=2), r"divisible by 2·n_heads \(4\)"),
    (dict(attention="standard", d_model=30, n_heads=4), r"divisible by n_heads \(4\)"),
    (dict(rope="rotary"), "rope must be interleaved|neox|none"),
    (dict(n_heads=4, n_kv_heads=3), r"multiple of n_kv_heads \(3\)"),
    (dict(attention="flash"), "unknown attention 'flash'"),
    (dict(d_model=0), "d_model must be a positive int"),
    (dict(n_layers=2.0), "n_layers must be a positive int"),
    (dict(d_model=20, n_heads=2, attention="diff"), "RoPE needs an even head dim"),  # d = 5
    (dict(dropout=1.0), "dropout"),
    (dict(attn_options={"lambda_init": -0.1}), "lambda_init"),
])
def test_config_validation_messages(kw, match):
    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2)
    base.update(kw)
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig(**base)
    assert str(e.value).startswith("ModelConfig:")


def test_config_dict_round_trip_and_unknown_key():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, rope="neox",
                      attn_options={"qk_norm": True})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['d_modle'\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "d_modle": 64})
    assert cfg.replace(d_model=64).d_model == 64 and cfg.d_model == 32


def test_old_run_folders_configs_still_load():
    """config.json / resolved.toml written before options were typed: distance options on a distance model, and
    the classify template's distance options left on a standard model (another type's options: kept, unused)."""
    old = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, rope="none")
    da = ModelConfig.from_dict({**old, "attention": "distance", "attn_options": {"distance_w_init": [0.1, -0.2],
                                                                               "distance_block": 8}})
    assert da.options.distance_block == 8 and da.options.distance_w_init == [0.1, -0.2]
    std = ModelConfig.from_dict({**old, "attention": "standard", "attn_options": {"distance_w_init": 0.5}})
    assert std.options is None and ModelConfig.from_dict(std.to_dict()) == std
    TransformerLM(std)
    with pytest.raises(ValueError, match=r"distance_block must be int, got 8.5"):
        da.replace(attn_options={"distance_block": 8.5})


def test_rope_none_is_allowed_with_odd_head_dim():
    cfg = ModelConfig(vocab_size=50, d_model=20, n_layers=1, n_heads=2, rope="none")  # d = 5
    assert TransformerLM(cfg).body.rope is None


# ------------------------------------------------------------------------------------- matched baseline
def _num_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):  # counts only: no memory, no init cost
        return TransformerLM(cfg).num_params()


@pytest.mark.parametrize("shape", [
    dict(d_model=256, n_heads=4),
    dict(d_model=512, n_heads=8, n_kv_heads=4),
    dict(d_model=384, n_heads=3, n_layers=6),
    dict(d_model=1024, n_heads=8, n_kv_heads=2, tie_embeddings=False),
])
def test_matched_baseline_parameter_counts(shape):
    cfg = ModelConfig(vocab_size=512, n_layers=shape.pop("n_layers", 2), attention="diff", **shape)
    base = matched_baseline(cfg)
    assert base.attention == "standard"
    assert base.n_heads == 2 * cfg.n_heads
    assert base.kv_heads == 2 * cfg.kv_heads
    assert base.d_model == cfg.d_model and base.n_layers == cfg.n_layers and base.ffn_dim == cfg.ffn_dim
    n_diff, n_base = _num_params(cfg), _num_params(base)
    d = cfg.d_model // cfg.n_heads // 2
    # exactly the λ vectors (4d) and the subln gains (2d) per layer
    assert n_diff - n_base == cfg.n_layers * 6 * d
    assert abs(n_diff - n_base) / n_base < 1e-3


def test_matched_baseline_of_v2_and_standard():
    v2 = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, attention="diff_v2")
    b = matched_baseline(v2)
    assert (b.attention, b.n_heads, b.n_kv_heads) == ("standard", 2, 1)
    std = v2.replace(attention="standard")
    assert matched_baseline(std) == std


def test_tied_and_untied_embeddings():
    tied = TransformerLM(cfg_for("diff"))
    assert tied.lm_head.weight is tied.body.tok_emb.weight
    untied = TransformerLM(cfg_for("diff", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.body.tok_emb.weight
    assert untied.num_params() - tied.num_params() == 50 * 32
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - 50 * 32


# -------------------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("attention", ATTNS)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("rope", ["interleaved", "neox", "none"])
def test_kv_cache_decode_reproduces_full_forward(attention, gqa, rope):
    kv = {"standard": 2, "diff": 1, "diff_v2": 1}[attention] if gqa else None
    m = TransformerLM(cfg_for(attention, n_kv_heads=kv, rope=rope)).eval()
    _randomize_norms(m)
    b, t = 2, 10
    ids = torch.randint(0, 50, (b, t))
    with torch.no_grad():
        full = m(ids)
        # token by token
        m.setup_cache(b, 16)
        steps = [m(ids[:, i: i + 1], input_pos=torch.tensor([i])) for i in range(t)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        # chunked prefill (4), a chunk of 3, then single tokens — in a fresh cache
        m.setup_cache(b, 16)
        parts = [m(ids[:, :4], input_pos=torch.arange(4)), m(ids[:, 4:7], input_pos=torch.arange(4, 7))]
        parts += [m(ids[:, i: i + 1], input_pos=torch.tensor([i])) for i in range(7, t)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
        m.clear_cache()
        torch.testing.assert_close(m(ids), full)


def test_kv_cache_reference_path_matches_too():
    m = TransformerLM(cfg_for("diff", n_kv_heads=1)).eval()
    _randomize_norms(m)
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        full = m(ids)
        for blk in m.blocks:
            blk.attn.capture = []
        m.setup_cache(1, 8)
        steps = [m(ids[:, :3], input_pos=torch.arange(3))] + [
            m(ids[:, i: i + 1], input_pos=torch.tensor([i])) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert len(m.blocks[0].attn.capture) == 4
    last = m.blocks[0].attn.capture[-1]["attn"]  # (1, h, 1, S): cache slots beyond position 5 get no weight
    assert last.shape[-1] == 8 and torch.all(last[..., 6:] == 0)


def test_kv_cache_errors():
    m = TransformerLM(cfg_for("diff"))
    m.setup_cache(2, 8)
    with pytest.raises(ValueError, match="input_pos"):
        m(torch.randint(0, 50, (2, 3)))
    with pytest.raises(ValueError, match="batch size"):
        m(torch.randint(0, 50, (1, 1)), input_pos=torch.tensor([0]))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m.setup_cache(1, 1000)
    m.clear_cache()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m(torch.randint(0, 50, (1, 25)))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        m(torch.randint(0, 50, (5,)))
    with pytest.raises(ValueError, match="causal"):
        TransformerLM(cfg_for("diff", causal=False))


def test_kv_cache_batch_rows_are_independent():
    # rows of a batch must not read each other's cache: decode a batch vs each row alone
    m = TransformerLM(cfg_for("diff", n_kv_heads=1)).eval()
    ids = torch.randint(0, 50, (3, 5))
    with torch.no_grad():
        m.setup_cache(3, 8)
        batched = torch.cat([m(ids[:, i: i + 1], input_pos=torch.tensor([i])) for i in range(5)], 1)
        m.setup_cache(1, 8)
        alone = torch.cat([m(ids[1:2, i: i + 1], input_pos=torch.tensor([i])) for i in range(5)], 1)
    torch.testing.assert_close(batched[1:2], alone, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- encoder and classifier
@pytest.mark.parametrize("attention", ATTNS)
@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_classifier_padding_invariance(attention, pooling):
    cfg = cfg_for(attention)
    clf = TransformerClassifier(cfg, num_classes=3, pooling=pooling).eval()
    assert clf.config.causal is False
    _randomize_norms(clf)
    lengths = [7, 4, 9]
    t = 9
    ids = torch.randint(1, 50, (3, t))
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # right padding, True = token
    with torch.no_grad():
        out = clf(ids, mask)
        assert out.shape == (3, 3)
        junk = torch.where(mask, ids, torch.randint(1, 50, ids.shape))  # different tokens under the padding
        torch.testing.assert_close(clf(junk, mask), out, atol=1e-5, rtol=1e-5)
        for i, n in enumerate(lengths):  # and the same as the unpadded sequence on its own
            torch.testing.assert_close(clf(ids[i: i + 1, :n]), out[i: i + 1], atol=1e-5, rtol=1e-5)
    # without the mask the padding does leak in (so the check above is meaningful)
    with torch.no_grad():
        assert (clf(junk) - clf(ids)).abs().max() > 1e-4


def test_encoder_is_bidirectional_and_classifier_errors():
    enc = TransformerEncoder(cfg_for("diff")).eval()
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        h = enc(ids)
        ids2 = ids.clone()
        ids2[0, -1] = (ids[0, -1] + 1) % 50
        h2 = enc(ids2)
    assert h.shape == (1, 6, 32)
    assert (h[0, 0] - h2[0, 0]).abs().max() > 1e-5  # the first position sees the last token
    with pytest.raises(ValueError, match="pooling"):
        TransformerClassifier(cfg_for("diff"), 2, pooling="max")
    with pytest.raises(ValueError, match="num_classes"):
        TransformerClassifier(cfg_for("diff"), 1)


@pytest.mark.parametrize("rope", ["none", "interleaved"])
def test_encoder_permutation_equivariance_depends_on_rope(rope):
    # no positional signal at all with rope="none": permuting tokens permutes the outputs
    enc = TransformerEncoder(cfg_for("diff", rope=rope)).eval()
    ids = torch.randint(0, 50, (1, 8))
    perm = torch.randperm(8)
    with torch.no_grad():
        diff = (enc(ids)[:, perm] - enc(ids[:, perm])).abs().max()
    if rope == "none":
        assert diff < 1e-5
    else:
        assert diff > 1e-4


def test_every_registered_type_builds():
    # attention types registered by other modules must at least build and run a tiny LM
    for name in sorted(ATTENTION):
        cls = ATTENTION[name]
        cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2 if cls.head_split == 2 else 4,
                          attention=name, max_seq_len=8)
        assert TransformerLM(cfg)(torch.randint(0, 50, (1, 5))).shape == (1, 5, 50)
