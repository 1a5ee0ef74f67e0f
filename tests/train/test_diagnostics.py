"""DIFF diagnostics: the per-layer columns exist, are finite and mean what the docstring says; the training
loop writes them to diagnostics.csv at each evaluation; a resumed run drops rows past its checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn.configs.run_config import TrainConfig
from diffattn.data.lm import TokenWindows
from diffattn.model.transformer import TransformerLM
from diffattn.train.diagnostics import DiagnosticsLog, attention_diagnostics, probe_batch, read_diagnostics
from diffattn.train.loop import train

COLUMNS = {
    "diff": ("lambda", "neg_mass", "entropy1", "entropy2"),
    "diff_distance": ("lambda", "neg_mass", "entropy1", "entropy2"),
    "diff_v2": ("sigma", "neg_mass", "entropy1", "entropy2"),
    "standard": ("entropy1",),
}


@pytest.mark.parametrize("attention", list(COLUMNS))
def test_columns_exist_and_are_finite(make_config, attention, one_thread):
    model = TransformerLM(make_config(attention=attention)).train()
    cols = attention_diagnostics(model, torch.randint(0, 50, (2, 16)))
    assert set(cols) == {f"layer{i}.{c}" for i in range(2) for c in COLUMNS[attention]}
    assert all(math.isfinite(v) for v in cols.values())
    assert all(0 <= v <= math.log(16) for k, v in cols.items() if "entropy" in k)
    assert model.training and all(b.attn.capture is None for b in model.blocks)  # state restored


def test_values_on_uniform_maps(make_config, one_thread):
    """Zero query weights make every map uniform over the causal prefix: row i has entropy ln(i + 1), and with
    λ = 1.5 the negative part of A1 − λA2 = −0.5/(i + 1) on i + 1 keys sums to 0.5 on every row."""
    model = TransformerLM(make_config(attention="diff", attn_options={"lambda_init": 0.0}))
    t = 12
    with torch.no_grad():
        for b in model.blocks:
            b.attn.q_proj.weight.zero_()
            for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(b.attn, n).zero_()
            b.attn.lambda_q1.fill_(1.0)
            b.attn.lambda_k1[0] = math.log(2.5)  # λ = e^{ln 2.5} − e^0 + 0 = 1.5
    cols = attention_diagnostics(model, torch.randint(0, 50, (2, t)))
    expected_entropy = sum(math.log(i + 1) for i in range(t)) / t
    for i in range(2):
        assert cols[f"layer{i}.lambda"] == pytest.approx(1.5, abs=1e-6)
        assert cols[f"layer{i}.neg_mass"] == pytest.approx(0.5, abs=1e-5)
        assert cols[f"layer{i}.entropy1"] == pytest.approx(expected_entropy, abs=1e-5)
        assert cols[f"layer{i}.entropy2"] == pytest.approx(expected_entropy, abs=1e-5)


def test_sigma_is_the_mean_gate(make_config, one_thread):
    model = TransformerLM(make_config(attention="diff_v2"))
    with torch.no_grad():
        for b in model.blocks:
            b.attn.lambda_proj.weight.zero_()
            b.attn.lambda_scale.fill_(0.5)  # the warm-up knob is part of the reported gate
    cols = attention_diagnostics(model, torch.randint(0, 50, (2, 8)))
    assert cols["layer0.sigma"] == pytest.approx(0.25) and cols["layer1.sigma"] == pytest.approx(0.25)


def test_training_writes_diagnostics_at_each_eval(tmp_path, make_config, one_thread):
    source = TokenWindows(torch.randint(0, 50, (2000,)), 16, 50, val_fraction=0.2)
    tcfg = TrainConfig(steps=4, batch_size=2, seq_len=16, warmup_steps=0, eval_every=2, eval_batches=1,
                       log_every=1)
    train(TransformerLM(make_config(attention="diff_v2")), source, tcfg, out_dir=tmp_path, progress=False)
    rows = read_diagnostics(tmp_path / "diagnostics.csv")
    assert [r["step"] for r in rows] == [2, 4]
    assert {"layer0.sigma", "layer1.neg_mass", "layer1.entropy2"} <= set(rows[0])
    assert all(math.isfinite(v) for r in rows for v in r.values())
    p1, p2 = probe_batch(source, seed=tcfg.seed), probe_batch(source, seed=tcfg.seed)
    assert torch.equal(p1, p2) and p1.shape == (2, 16)


def test_log_on_resume_drops_rows_past_the_checkpoint(tmp_path):
    path = tmp_path / "diagnostics.csv"
    log = DiagnosticsLog(path)
    for step in (2, 4, 6):
        log.append(step, {"layer0.lambda": 0.1 * step})
    log = DiagnosticsLog(path, start_step=4)
    log.append(6, {"layer0.lambda": 9.0})
    rows = read_diagnostics(path)
    assert [(r["step"], r["layer0.lambda"]) for r in rows] == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4)),
                                                                (6, 9.0)]


def test_probe_falls_back_to_train_without_a_val_split():
    source = TokenWindows(torch.arange(200) % 50, 16, 50, val_fraction=0.0)
    assert probe_batch(source, n=3, max_len=8).shape == (3, 8)
