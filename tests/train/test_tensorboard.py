"""TensorBoard logging of a training run, read back with TensorBoard's own event reader; and the one-line notice
when TensorBoard cannot be imported."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the `test` extra has it

from diffattn.configs.run_config import TrainConfig
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train import runlog as train_mod
from diffattn.train.loop import train
from diffattn.train.optim import lr_at
from diffattn.train.runlog import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingSource:
    """Rows count up mod V from a random start: a tiny learnable LM task."""

    vocab_size, seq_len = 16, 12

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator):
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        seq = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].clone(), seq[:, 1:].clone()


def _train(out: Path, steps: int = 6, eval_every: int = 3) -> TrainConfig:
    model = TransformerLM(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, max_seq_len=12,
                                      attention="diff"))
    tcfg = TrainConfig(steps=steps, batch_size=4, seq_len=12, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                       eval_every=eval_every, eval_batches=1, log_every=1, seed=0)
    train(model, CountingSource(), tcfg, out_dir=out, progress=False, quiet=True)
    return tcfg


def test_scalars_read_back_with_tensorboard(tmp_path: Path) -> None:
    tcfg = _train(tmp_path)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def series(tag: str) -> dict[int, float]:
        assert tag in tags, f"{tag} not logged; logged: {sorted(tags)}"
        return {e.step: e.value for e in acc.Scalars(tag)}

    metrics = read_metrics(tmp_path / "metrics.csv")
    loss = series("train_loss")
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    for row in metrics:
        assert loss[int(row["step"])] == pytest.approx(row["train_loss"], rel=1e-6)
    lr = series("lr")
    assert sorted(lr) == [1, 2, 3, 4, 5, 6]
    for step, value in lr.items():  # the lr used for the update that made step `step`
        assert value == pytest.approx(lr_at(step - 1, tcfg), rel=1e-6)
    assert sorted(series("val_loss")) == [3, 6]
    assert sorted(series("grad_norm")) == [1, 2, 3, 4, 5, 6]

    # λ diagnostics: one λ per layer of the V1 model, at each evaluation, equal to diagnostics.csv's
    with open(tmp_path / "diagnostics.csv", newline="") as f:
        diag = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(diag) == [3, 6]
    for layer in (0, 1):
        lam = series(f"diag/layer{layer}.lambda")
        assert sorted(lam) == [3, 6]
        for step, value in lam.items():
            assert value == pytest.approx(float(diag[step][f"layer{layer}.lambda"]), rel=1e-6)
        for col in ("neg_mass", "entropy1", "entropy2"):
            assert sorted(series(f"diag/layer{layer}.{col}")) == [3, 6]


def test_without_tensorboard_one_line_notice(tmp_path: Path, monkeypatch, capsys) -> None:
    # None in sys.modules makes `from torch.utils.tensorboard import ...` raise ImportError, as when the
    # tensorboard package is missing
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(train_mod, "_tb_notice_shown", False)
    _train(tmp_path / "a", steps=2, eval_every=0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "TensorBoard" in line]
    assert len(lines) == 1, err
    assert "TensorBoard logging is off" in lines[0] and "pip install tensorboard" in lines[0]
    assert not (tmp_path / "a" / "tb").exists()
    assert len(read_metrics(tmp_path / "a" / "metrics.csv")) == 2  # training itself went on

    _train(tmp_path / "b", steps=1, eval_every=0)  # once per process: a study trains many models
    assert "TensorBoard" not in capsys.readouterr().err
