"""One way to name a run: every command that reads a checkpoint takes the run folder or its ckpt/ folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import diffattn.checkpoint.format as C
from diffattn.checkpoint.format import CheckpointError, save_checkpoint
from diffattn.checkpoint.run_folder import resolve_checkpoint_dir
from diffattn.cli.main import main
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "the cat sat on the mat. the dog sat on the log.\n" * 20


def _run_folder(tmp_path: Path) -> Path:
    """runs/da: a distance-attention char LM trained on nothing, with its text data recorded."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    tok = build_tokenizer("char", TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, attention="distance",
                      max_seq_len=16)
    torch.manual_seed(0)
    run = tmp_path / "runs" / "da"
    save_checkpoint(run / "ckpt", TransformerLM(cfg), tokenizer=tok, train_state={"step": 3},
                    run_config={"task": "lm", "model": cfg.to_dict(), "train": {"seq_len": 16},
                                "data": {"path": str(tmp_path / "corpus.txt"), "tokenizer": "char"}})
    return run


def test_resolve_checkpoint_dir(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    assert resolve_checkpoint_dir(run) == run / "ckpt"
    assert resolve_checkpoint_dir(run / "ckpt") == run / "ckpt"
    assert resolve_checkpoint_dir(str(run)) == run / "ckpt"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint_dir(tmp_path / "empty")
    msg = str(e.value)  # what every reader says of a folder that holds no model: what a model folder holds
    assert msg.startswith(f"{tmp_path / 'empty'}: not a model folder (it is empty)")
    assert "manifest.json" in msg and "ckpt/" in msg and "config.json" in msg
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(tmp_path / "nope")
    # a damaged checkpoint is handed on, so that loading names the damage rather than "no checkpoint"
    (run / "ckpt" / "manifest.json").unlink()
    assert resolve_checkpoint_dir(run) == run / "ckpt"
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        C.load_checkpoint(resolve_checkpoint_dir(run))


def test_resolve_finds_a_checkpoint_moved_aside_by_a_crashed_save(tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    os.replace(run / "ckpt", run / f".ckpt.old-{os.getpid()}")  # what a save killed between its renames leaves
    assert resolve_checkpoint_dir(run) == run / "ckpt"
    with pytest.warns(UserWarning, match="previous checkpoint"):
        assert C.load_checkpoint(resolve_checkpoint_dir(run)).train_state["step"] == 3


@pytest.mark.parametrize("form", ["run", "ckpt"])
def test_every_command_takes_both_forms(tmp_path: Path, capsys, form: str) -> None:
    run = _run_folder(tmp_path)
    where = str(run if form == "run" else run / "ckpt")
    assert main(["info", where, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train_state"]["step"] == 3
    assert main(["heads", where]) == 0
    assert "prefers" in capsys.readouterr().out
    assert main(["generate", where, "--prompt", "the ", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert len(capsys.readouterr().out) == len("the ") + 5 + 1
    assert main(["eval", where, "--what", "ppl", "--batches", "1", "--batch-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"]["tokens"] == 2 * 16
    for cmd in ("info", "heads", "generate", "eval"):
        extra = ["--prompt", "a"] if cmd == "generate" else []
        assert main([cmd, str(tmp_path), *extra]) == 2  # neither tmp_path nor tmp_path/ckpt is a checkpoint
        assert f"{tmp_path}: not a model folder (it holds no manifest.json, ckpt/ or config.json)" in \
            capsys.readouterr().err
