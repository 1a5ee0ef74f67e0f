"""train.tracker (issue 23, item 3): Weights & Biases receives the same scalars as metrics.csv, diagnostics.csv and
TensorBoard (loss, lr, grad norm, tokens/s, val loss, λ and the other diagnostics), in its offline mode, read back
from the run file W&B writes; a resumed run continues the same W&B run; a missing extra is one line."""

from __future__ import annotations

import csv
import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from diffattn.cli.main import main
from diffattn.configs.run_config import TrainConfig, parse_trackers
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.loop import train
from diffattn.train.runlog import read_metrics
from diffattn.train.trackers import WANDB_ID_FILE

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingSource:
    """Rows count up mod V from a random start: a tiny learnable LM task."""

    vocab_size, seq_len = 16, 12

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator):
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        seq = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].clone(), seq[:, 1:].clone()


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="Weights & Biases is not installed (pip install -e '.[wandb]')")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))  # nothing written to ~/.config or ~/.cache
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "diffattn-test")


def _train(out: Path, steps: int, *, resume: bool = False, tracker: str = "tensorboard,wandb") -> TrainConfig:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, max_seq_len=12,
                                      attention="diff"))
    tcfg = TrainConfig(steps=steps, batch_size=4, seq_len=12, lr=3e-3, min_lr=3e-4, warmup_steps=2, eval_every=3,
                       eval_batches=1, log_every=1, seed=0, tracker=tracker, deterministic=True)
    train(model, CountingSource(), tcfg, out_dir=out, progress=False, quiet=True, resume=resume)
    return tcfg


# ------------------------------------------------------------------------- reading W&B's run file back
def _records(path: Path) -> list[bytes]:
    """The records of a W&B run file (``run-<id>.wandb``): a 7-byte file header (":W&B", magic, version), then
    LevelDB-log records of 32 KiB blocks, each record a 7-byte header (crc32c, length, type: 1 full, 2 first,
    3 middle, 4 last) and a slice of a protobuf Record; a block's tail under 7 bytes is padding."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(part)
            part = b""
    return out


def _complete_records(path: Path, pb) -> list:
    """The run file's records once W&B has written its last one (``exit``): its service process finishes writing
    the file shortly after ``finish()`` returns (within a second here; a process that exits waits for it)."""
    deadline = time.monotonic() + 30
    while True:
        recs = []
        for raw in _records(path):
            rec = pb.Record()
            rec.ParseFromString(raw)
            recs.append(rec)
        if (recs and recs[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def wandb_history(out: Path) -> tuple[list[dict], dict, set[str]]:
    """(every history row W&B recorded, the run config, the run ids) over all of the run's W&B files."""
    from wandb.proto import wandb_internal_pb2 as pb  # the test reads W&B's own protobuf schema

    rows, config, ids = [], {}, set()
    for f in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in _complete_records(f, pb):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
            elif kind == "run":
                ids.add(rec.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    return rows, config, ids


def _series(rows: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in rows if key in r}


def test_wandb_gets_the_same_scalars_as_the_csv_files_and_tensorboard(tmp_path, wandb_offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the `test` extra

    _train(tmp_path, 6)
    rows, config, ids = wandb_history(tmp_path)
    assert len(ids) == 1 and config["train"]["tracker"] == "tensorboard,wandb"
    assert config["model"]["attention"] == "diff"
    metrics = read_metrics(tmp_path / "metrics.csv")
    for key in ("train_loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
        want = {int(r["step"]): r[key] for r in metrics if r[key] is not None}
        got = _series(rows, key)
        assert sorted(got) == sorted(want) and want, key
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=1e-6), (key, step)
    with open(tmp_path / "diagnostics.csv", newline="") as f:
        diag = {int(r["step"]): r for r in csv.DictReader(f)}
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tb_tags = {t for t in acc.Tags()["scalars"]}
    for col in ("layer0.lambda", "layer1.lambda", "layer0.neg_mass", "layer1.entropy2"):
        got = _series(rows, f"diag/{col}")
        assert sorted(got) == sorted(diag) == [3, 6]
        for step, value in got.items():
            assert value == pytest.approx(float(diag[step][col]), rel=1e-6)
    wandb_keys = {k for r in rows for k in r if k not in ("step", "_step", "_runtime", "_timestamp")}
    assert wandb_keys == tb_tags  # the same scalars under the same names


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_offline):
    _train(tmp_path, 3)
    run_id = (tmp_path / "wandb" / WANDB_ID_FILE).read_text().strip()
    _train(tmp_path, 6, resume=True)
    rows, _, ids = wandb_history(tmp_path)
    assert ids == {run_id}
    assert sorted(_series(rows, "train_loss")) == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in read_metrics(tmp_path / "metrics.csv")] == [1, 2, 3, 4, 5, 6]


def test_tracker_none_writes_no_tb(tmp_path):
    _train(tmp_path, 2, tracker="none")
    assert not (tmp_path / "tb").exists() and not (tmp_path / "wandb").exists()
    assert len(read_metrics(tmp_path / "metrics.csv")) == 2


def test_bad_or_missing_tracker_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="unknown"):
        parse_trackers("tensorboard,mlflow")
    assert parse_trackers("none") == () and parse_trackers(" tensorboard,tensorboard") == ("tensorboard",)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when the package is not installed
    with pytest.raises(ValueError, match=r"pip install 'diffattn\[wandb\]'"):
        parse_trackers("wandb")  # what a run asks before it starts
    # the run config itself checks the names only: a checkpoint of a W&B run reads back on a machine without it
    assert TrainConfig(tracker="wandb").tracker == "wandb"
    (tmp_path / "input.txt").write_text("the cat sat on the mat. " * 40)
    rc = main(["train", "--config", "tiny", "--data.path", str(tmp_path / "input.txt"), "--out",
               str(tmp_path / "run"), "--train.tracker", "wandb"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "wandb" in err and "pip install" in err
    assert not (tmp_path / "run").exists()
