"""Evaluation metrics on hand-built maps and tiny models with known answers."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn as nn

from diffattn.cli.eval import parse_bits, parse_what
from diffattn.data.synthetic import make_synthetic, needle_eval_set
from diffattn.eval.noise import attention_shares, noise_analysis
from diffattn.eval.outliers import activation_outliers, outlier_stats
from diffattn.eval.perplexity import perplexity
from diffattn.eval.probes import capture_maps, probes
from diffattn.eval.quantization import absmax_quantize, quant_score_mod, quantization_sweep
from diffattn.model.transformer import TransformerLM


def test_attention_shares_hand_built():
    # T = 6: BOS(0) ctx(1) needle(2,3,4) | query block starts at 5; the query position is 5.
    attn = torch.zeros(1, 2, 6, 6)
    attn[0, 0, 5] = torch.tensor([0.1, 0.2, 0.2, 0.2, 0.1, 0.2])  # softmax-like, sums to 1
    attn[0, 1, 5] = torch.tensor([-0.1, 0.05, 0.3, 0.1, 0.05, -0.1])  # DIFF-like, negative entries
    s = attention_shares(attn, torch.tensor([5]), torch.tensor([2]), 3, torch.tensor([5]))
    torch.testing.assert_close(s["answer_signed"], torch.tensor([0.5, 0.45]))
    torch.testing.assert_close(s["noise_signed"], torch.tensor([0.3, -0.05]))
    torch.testing.assert_close(s["query_signed"], torch.tensor([0.2, -0.1]))
    torch.testing.assert_close(s["row_sum"], torch.tensor([1.0, 0.3]))
    torch.testing.assert_close(s["neg_mass"], torch.tensor([0.0, -0.2]))
    # Positive mass of head 1: 0.05 + 0.3 + 0.1 + 0.05 = 0.5; answer's share 0.45 / 0.5, noise 0.05 / 0.5.
    torch.testing.assert_close(s["answer_pos_share"], torch.tensor([0.5, 0.9]))
    torch.testing.assert_close(s["noise_pos_share"], torch.tensor([0.3, 0.1]))


def test_outlier_stats_known_values():
    v = torch.arange(
        -200, 201, dtype=torch.float32
    )  # |v|: 0, 1, 1, ..., 200, 200; k-th largest = 200 − (k−1)//2
    s = outlier_stats(v)
    assert s["top1"] == 200 and s["top2"] == 200 and s["top3"] == 199 and s["top10"] == 196
    assert s["top100"] == 151 and s["median"] == 100
    assert set(outlier_stats(torch.tensor([3.0, -4.0]))) == {
        "top1",
        "top2",
        "median",
    }  # k beyond size skipped


@pytest.mark.parametrize("bits", [4, 6, 8, 16])
def test_absmax_quantize_error_bound(bits):
    x = torch.randn(3, 4, 9, 9) * torch.rand(3, 4, 1, 1) * 20
    q = absmax_quantize(x, bits)
    absmax = x.abs().amax(dim=(-2, -1), keepdim=True)
    step = absmax / (2 ** (bits - 1) - 1)
    # Exact arithmetic gives step/2; fp32 adds a few ulps of the absmax (x/s, round, ·s).
    ulp = 4 * torch.finfo(torch.float32).eps * absmax
    assert ((q - x).abs() <= step / 2 + ulp).all()
    levels = torch.round(q / step)
    assert torch.allclose(levels * step, q, atol=1e-5)  # values lie on the grid
    assert (levels.abs() <= 2 ** (bits - 1) - 1).all()
    if bits == 16:
        assert ((q - x).abs() / absmax).max() < 2e-5  # ~lossless


def test_absmax_mask_and_zero():
    x = torch.tensor([[[[1.0, 100.0], [2.0, -3.0]]]])
    keep = torch.tensor([[True, False], [True, True]])
    q = absmax_quantize(x, 4, keep)  # absmax over kept entries = 3, step 3/7
    step = 3 / 7
    assert (
        abs(q[0, 0, 1, 1].item() + 3.0) < 1e-6 and abs(q[0, 0, 0, 0].item() - round(1 / step) * step) < 1e-6
    )
    assert torch.equal(absmax_quantize(torch.zeros(1, 1, 2, 2), 4), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="bits"):
        absmax_quantize(x, 1)


def _tiny(attention: str, vocab: int = 40, **kw) -> TransformerLM:
    from diffattn.model.config import ModelConfig

    base = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, attention=attention)
    cfg = ModelConfig(**{**base, **kw})
    return TransformerLM(cfg).eval()


def test_probes_are_removed_and_fast_path_untouched():
    m = _tiny("diff")
    x = torch.randint(0, 40, (2, 12))
    fast = m(x)
    with pytest.raises(RuntimeError), probes(m, capture=True, score_mod=quant_score_mod(4)):
        raise RuntimeError("boom")
    assert all(b.attn.capture is None and b.attn.score_mod is None for b in m.blocks)
    assert torch.equal(m(x), fast)
    maps = capture_maps(m, x)
    assert len(maps) == 2 and {"logits1", "logits2", "attn"} <= set(maps[0])


def test_quantized_forward_16_bit_close_and_logits_really_quantized():
    m = _tiny("standard", n_heads=4)
    x = torch.randint(0, 40, (2, 16))
    ref = m(x)
    with torch.no_grad(), probes(m, score_mod=quant_score_mod(16)):
        q16 = m(x)
    assert (q16 - ref).abs().max() < 1e-4
    ref_logits = capture_maps(m, x)[0]["logits"]  # layer 0 sees the same input either way
    with torch.no_grad(), probes(m, capture=True, score_mod=quant_score_mod(3)) as lists:
        m(x)
    got = lists[0][0]["logits"]
    keep = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.testing.assert_close(got, absmax_quantize(ref_logits, 3, keep))
    assert len(torch.unique(got[0, 0][keep])) <= 7  # 3 bits symmetric: levels -3..3


@pytest.mark.parametrize("attention", ["standard", "diff", "diff_v2"])
def test_noise_analysis_row_sums(attention):
    """Standard rows sum to 1 over the three regions; DIFF V1 rows to 1 − λ of the layer."""
    task = make_synthetic("needle", 32, max_needles=2)
    m = _tiny(attention, vocab=task.vocab_size)
    cells = needle_eval_set(task, [0.0, 1.0], [24, 32], n_needles=2, n_samples=3, seed=0)
    res = noise_analysis(m, cells)
    per = {k: torch.tensor(v) for k, v in res["per_layer_head"].items()}
    assert per["answer_signed"].shape == (2, m.blocks[0].attn.num_heads)
    regions = per["answer_signed"] + per["noise_signed"] + per["query_signed"]
    torch.testing.assert_close(regions, per["row_sum"])
    if attention == "standard":
        torch.testing.assert_close(per["row_sum"], torch.ones_like(per["row_sum"]))
        torch.testing.assert_close(per["answer_pos_share"], per["answer_signed"])
    if attention == "diff":
        lam = torch.stack([b.attn.lambda_full().detach() for b in m.blocks])
        torch.testing.assert_close(per["row_sum"], (1 - lam)[:, None].expand_as(per["row_sum"]))
    assert ((per["answer_pos_share"] >= 0) & (per["answer_pos_share"] <= 1)).all()


def test_activation_outliers_covers_both_diff_logits():
    m = _tiny("diff")
    x = torch.randint(0, 40, (2, 10))
    res = activation_outliers(m, x)
    maps = capture_maps(m, x)
    keep = torch.ones(10, 10, dtype=torch.bool).tril()
    top = max(t[..., keep].abs().max().item() for mp in maps for t in (mp["logits1"], mp["logits2"]))
    assert math.isclose(res["attn_logits"]["top1"], top, rel_tol=1e-6)
    hidden = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: hidden.append(o.abs().max().item())) for b in m.blocks]
    with torch.no_grad():
        m(x)
    for h in hooks:
        h.remove()
    assert math.isclose(res["hidden"]["top1"], max(hidden), rel_tol=1e-6)
    assert len(res["hidden_top1_per_layer"]) == 2


class _Uniform(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab) + self.w


def test_perplexity_of_uniform_model():
    task = make_synthetic("needle", 32)
    res = perplexity(_Uniform(task.vocab_size), task, n_batches=2, batch_size=4)
    assert math.isclose(res["loss"], math.log(task.vocab_size), rel_tol=1e-5)
    assert math.isclose(res["ppl"], task.vocab_size, rel_tol=1e-4)
    assert math.isclose(res["bits_per_token"], math.log2(task.vocab_size), rel_tol=1e-5)


def test_quantization_sweep_rows():
    task = make_synthetic("needle", 32, max_needles=2)
    m = _tiny("diff", vocab=task.vocab_size)
    cells = needle_eval_set(task, [0.5], [32], n_samples=4, seed=0)
    rows = quantization_sweep(m, cells, task, bits=(16, 4), ppl_batches=1, batch_size=4)
    assert [r["bits"] for r in rows] == [None, 16, 4]
    assert abs(rows[1]["ppl_loss"] - rows[0]["ppl_loss"]) < 1e-3
    assert all(not b.attn.use_reference and b.attn.score_mod is None for b in m.blocks)


def test_cli_parsers_reject_bad_values():
    assert parse_what("ppl,quant") == ["ppl", "quant"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        parse_what("ppl,speed")
    assert parse_bits("8,4") == [8, 4]
    for bad in ("8,x", "1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bits(bad)


def test_eval_cli_missing_checkpoint(tmp_path, capsys):
    from diffattn.cli import eval as evaluate

    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    assert evaluate.run(p.parse_args([str(tmp_path / "nope")])) == 2
    assert "does not exist" in capsys.readouterr().err


def _needle_run(tmp_path):
    """A run folder holding an (untrained) LM of the synthetic needle task."""
    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.data.lm import make_source

    data = {"synthetic": "needle", "params": {"max_needles": 4, "max_queries": 2}}
    task, _ = make_source(data, 32)
    from diffattn.model.config import ModelConfig

    mcfg = ModelConfig(vocab_size=task.vocab_size, d_model=32, n_layers=2, n_heads=2, attention="diff",
                       max_seq_len=32)
    torch.manual_seed(0)
    run = tmp_path / "runs" / "needle"
    save_checkpoint(run / "ckpt", TransformerLM(mcfg),
                    run_config={"task": "lm", "model": mcfg.to_dict(), "train": {"seq_len": 32}, "data": data})
    return run


def test_eval_cli_prints_tables_and_json_through_a_subprocess(tmp_path, capsys, one_thread):
    from clirun import run_diffattn

    run = _needle_run(tmp_path)
    args = ["--samples", "2", "--batches", "2", "--batch-size", "4", "--bits", "8,4"]
    res = run_diffattn("eval", run, *args)  # the run folder
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert not text.lstrip().startswith("{")
    for title in ("perplexity", "needle: 1-needle accuracy", "multi-needle", "noise:", "outliers:", "quant:"):
        assert title in text
    from diffattn.cli.main import main

    assert main(["eval", str(run / "ckpt"), *args, "--json"]) == 0  # its ckpt/ folder, machine output
    res = json.loads(capsys.readouterr().out)
    assert set(res) >= {"ppl", "needle", "noise", "outliers", "quant"}
    # the one line that explains the different token counts quotes each section's count, as computed
    why = [line for line in text.splitlines() if line.startswith("why the counts differ:")]
    assert len(why) == 1
    assert f"only the answer tokens (a synthetic task puts its loss on answers) of 2 random val batches of 4:" \
           f" {res['ppl']['tokens']:,} tokens" in why[0]
    assert res["ppl"]["tokens"] < 2 * 4 * 32  # answers only, not every position
    assert f"one answer token per query on a fixed grid ({res['needle']['queries']:,})" in why[0]
    grid = res["needle"]["grid"]
    assert res["needle"]["queries"] == sum(g["queries"] for g in grid) == 2 * len(grid)
    assert f"one attention row per sequence ({res['noise']['sequences']:,})" in why[0]
    # tables carry the same numbers as the JSON
    assert f"{res['ppl']['ppl']:.3f}" in text and f"{res['ppl']['tokens']:,}" in text
    fp32 = next(r for r in res["quant"] if r["bits"] is None)
    assert [line.split() for line in text.splitlines() if line.strip().startswith("fp32")][0][1] == \
        f"{fp32['needle_acc']:.3f}"


def test_eval_text_counts_every_predicted_token(tmp_path, capsys):
    """On text data ppl counts every position of each window: batches · batch size · seq_len tokens."""
    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.cli.main import main
    from diffattn.model.config import ModelConfig
    from diffattn.model.tokenizer import build_tokenizer

    text = "abcdefgh" * 40
    (tmp_path / "t.txt").write_text(text)
    tok = build_tokenizer("char", text)
    mcfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    save_checkpoint(tmp_path / "ckpt", TransformerLM(mcfg), tokenizer=tok,
                    run_config={"task": "lm", "model": mcfg.to_dict(), "train": {"seq_len": 16},
                                "data": {"path": str(tmp_path / "t.txt")}})
    assert main(["eval", str(tmp_path), "--what", "ppl,outliers,quant", "--batches", "3", "--batch-size", "2",
                 "--bits", "4"]) == 0
    out = capsys.readouterr().out
    why = next(line for line in out.splitlines() if line.startswith("why the counts differ:"))
    assert "needle" not in why and "quant's ppl uses half the batches (1: 32 tokens)" in why
    assert "every predicted token (each position of a window predicts the next one) of 3 random val batches" \
           " of 2: 96 tokens" in out
    assert "outliers pool every causally visible logit and every hidden value of 2 sequences" in out
