"""shared_qk (the seeds' "Diff_Symmetry"): K from the query projection, a symmetric logit map, no k_proj."""

import pytest
import torch

from diffattn import ModelConfig, TransformerLM, matched_baseline
from diffattn.eval.probes import capture_maps, logit_maps

TYPES = ["standard", "diff", "distance", "diff_distance"]


def cfg(attention="diff", **kw):
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention=attention)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_parameter_count_drops_by_the_key_projection(attention, bias):
    c = cfg(attention, bias=bias)
    regular, shared = TransformerLM(c), TransformerLM(c.replace(shared_qk=True))
    e = c.d_model
    assert regular.num_params() - shared.num_params() == c.n_layers * (e * e + (e if bias else 0))
    assert not any("k_proj" in k for k in shared.state_dict())
    assert sum("k_proj" in k for k in regular.state_dict()) == c.n_layers * (2 if bias else 1)


@pytest.mark.parametrize("attention", TYPES)
@pytest.mark.parametrize("rope", ["none", "interleaved", "neox"])
def test_pre_softmax_logits_are_symmetric(attention, rope):
    """Before masking, logit(i, j) == logit(j, i) for every head and map, with RoPE too: query and key i get the
    same rotation R_i, so logit(i, j) = <R_i q_i, R_j q_j> = logit(j, i). A regular model is not symmetric."""
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (2, 12))
    shared = TransformerLM(cfg(attention, rope=rope, shared_qk=True))
    for layer in capture_maps(shared, ids):
        for lg in logit_maps(layer):
            assert lg.shape[-1] == lg.shape[-2] == 12
            torch.testing.assert_close(lg, lg.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    regular = TransformerLM(cfg(attention, rope=rope))
    lg = logit_maps(capture_maps(regular, ids)[0])[0]
    assert (lg - lg.transpose(-1, -2)).abs().max() > 1e-3


def test_keys_are_the_queries():
    """The module feeds its own query heads as keys: the same output as a regular module whose k_proj is a copy
    of q_proj (so nothing else changed)."""
    torch.manual_seed(1)
    shared = TransformerLM(cfg("diff", shared_qk=True))
    regular = TransformerLM(cfg("diff"))
    sd = dict(shared.state_dict())
    for i in range(2):
        sd[f"body.blocks.{i}.attn.k_proj.weight"] = sd[f"body.blocks.{i}.attn.q_proj.weight"].clone()
    regular.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 40, (2, 10))
    torch.testing.assert_close(shared(ids), regular(ids), atol=1e-5, rtol=0)


def test_matched_baseline_carries_the_flag():
    c = cfg("diff", n_heads=2, shared_qk=True)
    b = matched_baseline(c)
    assert b.attention == "standard" and b.n_heads == 4 and b.shared_qk
    diff, base = TransformerLM(c), TransformerLM(b)
    # the symmetric pair stays parameter-matched: only DIFF's λ vectors and norm gains differ (6·d per layer)
    d = c.d_model // (2 * c.n_heads)
    assert diff.num_params() - base.num_params() == c.n_layers * 6 * d
    assert matched_baseline(cfg("distance", shared_qk=True)).shared_qk


def test_kv_cache_decoding_matches_full_forward():
    torch.manual_seed(2)
    m = TransformerLM(cfg("diff", shared_qk=True)).eval()
    ids = torch.randint(0, 40, (1, 8))
    full = m(ids)
    m.setup_cache(1)
    steps = [m(ids[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(8)]
    m.clear_cache()
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(attention="diff_v2", shared_qk=True), "shared_qk is not defined for attention 'diff_v2'"),
        (dict(attention="diff", n_heads=2, n_kv_heads=1, shared_qk=True), "shared_qk needs n_kv_heads == n_heads"),
        (dict(attention="standard", n_heads=4, n_kv_heads=2, shared_qk=True), "shared_qk needs n_kv_heads"),
        (dict(shared_qk="yes"), "shared_qk must be true or false"),
    ],
)
def test_bad_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_config_round_trip():
    c = cfg("diff", shared_qk=True)
    assert ModelConfig.from_dict(c.to_dict()) == c


# ------------------------------------------------------------------------------- compare --variants
def _compare_args(argv):
    import argparse

    from diffattn.cli import compare

    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(argv)


def test_compare_variant_spelling():
    from diffattn.cli import compare
    from diffattn.experiments.needle import run as needle
    from diffattn.experiments.needle import settings

    s = compare.resolve(_compare_args(["--quick", "--variants", "diff+shared_qk,standard+shared_qk,distance"]))
    settings.check_variants(list(s.variants))
    cfgs = s.model_configs()
    names = [needle.variant_name(c) for c in cfgs]
    assert names == ["diff", "standard", "diff+shared_qk", "standard+shared_qk", "distance"]
    assert [c.shared_qk for c in cfgs] == [False, False, True, True, False]
    assert cfgs[3] == matched_baseline(cfgs[2])  # the symmetric pair is itself parameter-matched
    assert [settings.label(n) for n in names[2:4]] == ["DIFF-sym", "Transformer-sym"]


@pytest.mark.parametrize(
    "variants, match",
    [
        ("diff_v2+shared_qk", "shared_qk is not defined for that type"),
        ("nope+shared_qk", "unknown attention variant"),
        ("diff+shared_qk,diff+shared_qk", "listed twice"),
    ],
)
def test_compare_bad_variant_exits_2(variants, match, tmp_path, capsys):
    from diffattn.cli import compare

    assert compare.run(_compare_args(["--quick", "--variants", variants, "--out", str(tmp_path / "r")])) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_compare_trains_the_symmetric_variant(tmp_path):
    import json

    from diffattn.cli import compare

    out = tmp_path / "r"
    assert compare.run(_compare_args(["--quick", "--no-progress", "--variants", "diff+shared_qk",
                                      "--out", str(out)])) == 0
    models = json.loads((out / "results.json").read_text())["models"]
    assert [m["attention"] for m in models] == ["diff", "standard", "diff+shared_qk"]
    assert models[2]["label"] == "DIFF-sym" and models[2]["config"]["shared_qk"]
    e, n = models[0]["config"]["d_model"], models[0]["config"]["n_layers"]
    assert models[0]["params"] - models[2]["params"] == n * e * e
    assert (out / "runs" / "diff+shared_qk" / "ckpt").is_dir()
    assert "diff+shared_qk" in (out / "command.txt").read_text()


def test_counts_at_the_seed_nanogpt_shape():
    """GPT-2-small-like shape (12 layers, d_model 768, vocab 50304, 1024 context; DIFF with 6 diff-heads, its
    baseline 12 heads): shared_qk removes 12·768² = 7,077,888 parameters, 8.33% of the non-embedding ones."""
    c = ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=6, max_seq_len=1024, attention="diff")
    with torch.device("meta"):  # shapes only: no memory, no init cost
        counts = {(a, s): TransformerLM(x.replace(shared_qk=s)).num_params(exclude_embeddings=True)
                  for a, x in (("diff", c), ("standard", matched_baseline(c))) for s in (False, True)}
    assert counts[("diff", False)] - counts[("diff", True)] == 12 * 768 * 768 == 7_077_888
    assert counts[("standard", False)] - counts[("standard", True)] == 7_077_888
    # per layer: 4 projections 768², SwiGLU 3·768·2048, λ 4·64, subln 128, 2 norms 768; plus the final norm
    per_layer = 4 * 768**2 + 3 * 768 * 2048 + 4 * 64 + 128 + 2 * 768
    assert counts[("diff", False)] == 12 * per_layer + 768 == 84_958_464
    assert counts[("diff", True)] == 84_958_464 - 7_077_888 == 77_880_576
