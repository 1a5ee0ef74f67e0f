"""`--threads N` for train, eval and generate, as compare has it; the start line says how many (issue 25, item 4).
With another busy process on 2 cores, torch's default (one thread per core) made a tiny run 10-40x slower."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffattn.checkpoint.format import save_checkpoint
from diffattn.cli.main import main
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerLM

TEXT = "the cat sat on the mat. the dog sat on the log.\n" * 20


@pytest.fixture
def threads_used(monkeypatch) -> list[int]:
    """The thread counts the command set (and restored) while it ran."""
    calls: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    return calls


def test_train_runs_on_the_threads_asked_and_says_so(tmp_path: Path, capsys, threads_used) -> None:
    (tmp_path / "in.txt").write_text(TEXT)
    before = torch.get_num_threads()
    assert main(["train", "--config", "tiny", "--data.path", str(tmp_path / "in.txt"), "--out", str(tmp_path / "r"),
                 "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--train.steps", "1",
                 "--train.seq_len", "16", "--train.batch_size", "2", "--train.eval_every", "0", "--no-progress",
                 "--threads", "1"]) == 0
    start = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("training diff LM"))
    assert ", 1 thread; out " in start
    assert threads_used == [1, before] and torch.get_num_threads() == before  # restored for in-process callers


def test_the_default_is_torchs_and_the_start_line_says_it(tmp_path: Path, capsys, threads_used) -> None:
    (tmp_path / "in.csv").write_text("label,text\n" + "".join(f"{i % 2},row {i} {'ab' * (i % 3)}\n" for i in range(40)))
    assert main(["train", "--task", "classify", "--data.path", str(tmp_path / "in.csv"), "--out", str(tmp_path / "c"),
                 "--model.d_model", "16", "--model.n_layers", "1", "--model.n_heads", "2", "--train.steps", "1",
                 "--train.eval_every", "0", "--no-progress"]) == 0
    n = torch.get_num_threads()
    start = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("training diff classifier"))
    assert f", {n} thread{'' if n == 1 else 's'}; out " in start and threads_used == [n]


def test_eval_and_generate_take_threads_and_bad_values_are_one_line(tmp_path: Path, capsys, threads_used) -> None:
    tok = build_tokenizer("char", TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    save_checkpoint(tmp_path / "ckpt", TransformerLM(cfg), tokenizer=tok, train_state={"step": 1},
                    run_config={"task": "lm", "model": cfg.to_dict(), "train": {"seq_len": 16}, "data": {}})
    (tmp_path / "in.txt").write_text(TEXT)
    before = torch.get_num_threads()
    assert main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "3", "--threads", "1"]) == 0
    assert main(["eval", str(tmp_path), "--what", "ppl", "--data", str(tmp_path / "in.txt"), "--batches", "1",
                 "--batch-size", "2", "--threads", "1"]) == 0
    assert threads_used == [1, before, 1, before]
    for cmd in (["train", "--config", "tiny"], ["eval", str(tmp_path)], ["generate", str(tmp_path), "--prompt", "a"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--threads", "-1"])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--threads must be >= 0, got -1")
