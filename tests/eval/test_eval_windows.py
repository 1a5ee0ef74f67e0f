"""`diffattn eval`'s windows (issue 32): `--seq-len`, a default a CPU finishes for a model that records no training
length, an estimate line before the work and a progress bar over it, and a run evaluated on its own data reading
the validation sample its training read, so the loss eval prints is the run's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clirun import run_main

from diffattn.checkpoint.format import save_checkpoint
from diffattn.eval.windows import FLOP_BUDGET, default_seq_len, forward_flops_per_token, progress, windows_read
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

TEXT = "to be or not to be, that is the question: whether tis nobler in the mind to suffer. " * 60


def _model(d_model: int, n_layers: int, context: int, vocab: int = 64) -> TransformerLM:
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=4, max_seq_len=context,
                      attention="standard")
    with torch.device("meta"):  # only its shape is read
        return TransformerLM(cfg)


def test_the_default_window_fits_the_budget_and_never_exceeds_the_context() -> None:
    windows = windows_read(["ppl", "outliers", "quant"], ppl_batches=8, batch_size=16, bits=[16, 8, 6, 4])
    assert windows == 8 * 16 + 5 * 4 * 16 + 16
    small = _model(32, 2, 512)
    assert default_seq_len(small, windows) == 512  # a tiny model: its whole context
    big = _model(512, 8, 8192, vocab=32000)  # ~41M parameters, an 8,192-token context
    t = default_seq_len(big, 128)
    assert 128 < t < 8192 and t & (t - 1) == 0
    assert 128 * t * forward_flops_per_token(big, t) <= FLOP_BUDGET < 128 * 2 * t * forward_flops_per_token(big, 2 * t)
    assert default_seq_len(_model(512, 8, 96, vocab=32000), 10**6) == 96  # never past the context
    assert default_seq_len(_model(768, 12, 8192, vocab=32000), 128) == 128  # ~110M: the floor, past the budget


def test_the_progress_bar_counts_the_windows_and_the_first_batch_corrects_the_estimate(capsys) -> None:
    model = TransformerLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    x = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        want = model(x)
        with progress(model, 10, estimate_s=1e-9, tty=True):  # an estimate far below the real pace
            for _ in range(5):
                assert torch.equal(model(x), want)  # the hook leaves the output alone
    err = capsys.readouterr().err
    assert "estimate after the first 2 windows: about" in err and "10/10" in err  # a terminal: the bar
    with progress(model, 10, estimate_s=1e9, tty=False), torch.no_grad():  # far above; short work, no terminal
        model(x)
    err = capsys.readouterr().err
    assert err.startswith("estimate after the first 2 windows: about 1 s in all") and "window/s" not in err
    assert not model._forward_hooks  # no hook left behind


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run (4 steps, evaluated at 2 and 4) and a copy of its model that records no training."""
    here = tmp_path_factory.mktemp("eval-windows")
    (here / "text.txt").write_text(TEXT)
    r = run_main("train", "--config", "tiny", "--data.path", "text.txt", "--out", "run", "--no-progress",
                 "--model.d_model", "16", "--model.n_layers", "1", "--model.n_heads", "2", "--train.steps", "4",
                 "--train.seq_len", "24", "--train.batch_size", "3", "--train.eval_every", "2",
                 "--train.eval_batches", "2", "--train.warmup_steps", "0", "--train.tracker", "none", cwd=here)
    assert r.returncode == 0, r.stderr
    return here


def test_a_run_on_its_own_data_reports_its_own_validation_loss(run: Path) -> None:
    from diffattn.checkpoint.format import load_checkpoint

    recorded = load_checkpoint(run / "run" / "ckpt").train_state["history"][-1]["val_loss"]
    r = run_main("eval", run / "run", "--what", "ppl", "--json")
    assert r.returncode == 0, r.stderr
    ppl = json.loads(r.stdout)["ppl"]
    assert ppl["seq_len"] == 24 and ppl["tokens"] == 2 * 3 * 24 and ppl["run_sample"]["same"]
    assert abs(ppl["loss"] - recorded) < 1e-5  # the same measure: the same windows, the same weights
    r = run_main("eval", run / "run", "--what", "ppl")
    assert r.returncode == 0
    assert f"this is that sample: the run's validation loss at step 4 was {recorded:.4f}" in r.stdout
    assert r.stderr.startswith("estimate: ppl read 6 windows of 24 tokens")
    r = run_main("eval", run / "run", "--what", "ppl", "--batches", "3")
    assert r.returncode == 0, r.stderr
    assert f"the run's validation loss at step 4 was {recorded:.4f}" in r.stdout and "this reads another sample" \
        in r.stdout


def test_seq_len_chooses_the_window_and_a_model_without_a_training_length_gets_the_default(run: Path) -> None:
    from diffattn.checkpoint.format import load_checkpoint

    ck = load_checkpoint(run / "run" / "ckpt")
    cfg = ck.model_config.replace(max_seq_len=4096)
    model = TransformerLM(cfg)
    model.load_state_dict(ck.state_dict, strict=False)  # RoPE tables differ in length: weights are what count
    save_checkpoint(run / "bare", model, tokenizer=ck.tokenizer, run_config={"task": "lm", "model": cfg.to_dict()})
    r = run_main("eval", run / "bare", "--data", run / "text.txt", "--what", "ppl", "--seq-len", "20", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ppl"]["tokens"] == 8 * 16 * 20
    assert "estimate: ppl read 128 windows of 20 tokens" in r.stderr
    r = run_main("eval", run / "bare", "--data", run / "text.txt", "--what", "ppl", "--batches", "1",
                 "--batch-size", "1", "--json")
    from diffattn.data.lm import make_source

    split = make_source({"path": str(run / "text.txt")}, 1, tokenizer=ck.tokenizer)[0].split_size("val")
    assert default_seq_len(model, 1) == 4096 > split  # a tiny model could read its whole context: the data cannot
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ppl"]["seq_len"] == split - 1
    r = run_main("eval", run / "bare", "--data", run / "text.txt", "--seq-len", "0")
    assert r.returncode == 2 and "--seq-len must be >= 1" in r.stderr
