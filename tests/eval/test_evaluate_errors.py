"""Standard errors and paired changes recorded by the evaluation functions (the report's verdicts use them)."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn.data.synthetic import make_synthetic
from diffattn.eval.needles import default_cells, multi_needle_cells
from diffattn.eval.noise import noise_analysis
from diffattn.eval.outliers import activation_outliers, outlier_spread
from diffattn.eval.perplexity import perplexity, token_losses
from diffattn.eval.quantization import quantization_sweep
from diffattn.model.transformer import TransformerLM


@pytest.fixture
def setup(make_config, one_thread):
    task = make_synthetic("needle", 32, max_needles=3, max_queries=2)
    model = TransformerLM(make_config(vocab_size=task.vocab_size, n_layers=1)).eval()
    return task, model


def test_perplexity_standard_error_is_the_token_spread(setup):
    task, model = setup
    tok = token_losses(model, task, n_batches=2, batch_size=8, seed=5)
    assert torch.equal(tok, token_losses(model, task, n_batches=2, batch_size=8, seed=5))  # same tokens
    p = perplexity(model, task, n_batches=2, batch_size=8, seed=5)
    assert p["tokens"] == tok.numel() and p["loss"] == pytest.approx(tok.mean().item())
    assert p["loss_se"] == pytest.approx(tok.std().item() / math.sqrt(tok.numel())) and p["loss_se"] > 0


def test_quantization_sweep_paired_changes(setup):
    task, model = setup
    cells = default_cells(task, depths=(0.0, 1.0), n_needles=2, n_samples=4, seed=1)
    multi = multi_needle_cells(task, 32, 3, 2, 10, seed=2)
    rows = quantization_sweep(model, cells, task, bits=(16, 2), ppl_batches=1, batch_size=8, multi_cells=multi)
    ref = rows[0]
    assert "ppl_rise" not in ref and ref["multi_queries"] == 10 // 5 * 5 * 2
    for r in rows[1:]:
        assert r["ppl_rise"] == pytest.approx(r["ppl_loss"] - ref["ppl_loss"], abs=1e-9)
        assert r["needle_drop"] == pytest.approx(ref["needle_acc"] - r["needle_acc"], abs=1e-9)
        assert r["multi_drop"] == pytest.approx(ref["multi_acc"] - r["multi_acc"], abs=1e-9)
        assert r["ppl_rise_se"] >= 0 and r["multi_drop_se"] >= 0
    assert abs(rows[1]["ppl_rise"]) < 1e-3  # 16-bit logits change almost nothing
    assert rows[2]["ppl_rise_se"] > 0  # 2-bit logits move every token's loss by a different amount


def test_noise_analysis_standard_errors(setup):
    task, model = setup
    cells = default_cells(task, depths=(0.0, 0.5), n_samples=3, seed=1)
    res = noise_analysis(model, cells)
    assert res["sequences"] == 3 * len(cells) == 18  # 2 depths x 3 lengths x 3 sequences
    k = "answer_pos_share"
    per_layer = torch.tensor(res["per_layer_head"][k])
    assert res["mean"][k] == pytest.approx(per_layer.mean().item(), abs=1e-6)
    assert 0 < res["mean_se"][k] < 1 and 0 < res["last_layer_se"][k] < 1


def test_outlier_spread_is_over_batches(setup):
    task, model = setup
    batches = [task.get_batch("val", 4, torch.Generator().manual_seed(i))[0] for i in range(3)]
    spread = outlier_spread(model, batches)
    tops = [activation_outliers(model, x)["attn_logits"]["top1"] for x in batches]
    s = spread["attn_logits_top1"]
    assert s["n"] == 3 and s["mean"] == pytest.approx(sum(tops) / 3)
    assert s["se"] == pytest.approx(torch.tensor(tops).std().item() / math.sqrt(3), rel=1e-5)
    with pytest.raises(ValueError, match="at least one batch"):
        outlier_spread(model, [])
