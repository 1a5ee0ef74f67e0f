"""A newcomer's messages (issue 32): each bad input names the flag and what is wrong with it, in the words of the
command that was run, and `info` prints no empty section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from clirun import run_main

from diffattn.checkpoint.format import save_checkpoint
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerLM


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return f


def test_study_out_that_is_a_file_names_study(tmp_path: Path, corpus: Path) -> None:
    r = run_main("study", corpus, "--quick", "--out", corpus, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"study --out {corpus}" in r.stderr and "compare" not in r.stderr


@pytest.mark.parametrize("name, says", [
    ("emptydir", "'emptydir' is a folder without a tokenizer.json (it holds nothing)"),
    ("fulldir", "'fulldir' is a folder without a tokenizer.json (it holds config.json, model.safetensors)"),
    ("corpus.txt", "'corpus.txt' is a file but not a tokenizer.json"),
    ("missing.json", "'missing.json': no such file or folder"),
    ("bep", "unknown tokenizer 'bep'"),
])
def test_a_data_tokenizer_that_is_no_tokenizer_says_what_it_is(tmp_path: Path, corpus: Path, name: str,
                                                              says: str) -> None:
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "fulldir").mkdir()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / "fulldir" / f).write_text("{}")
    r = run_main("train", "--config", "tiny", "--data.path", corpus, "--data.tokenizer", name, "--out", "run",
                 cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr and "a Hugging Face tokenizer.json or a folder holding one" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_folder_holding_a_tokenizer_json_is_a_tokenizer(tmp_path: Path, corpus: Path) -> None:
    from diffattn.data.lm import named_tokenizer

    hf = tmp_path / "hf"
    hf.mkdir()
    build_tokenizer("bpe", corpus.read_text(), 300).tok.save(str(hf / "tokenizer.json"))
    tok = named_tokenizer(str(hf))
    assert tok.kind == "hf" and tok.decode(tok.encode("the lazy dog")) == "the lazy dog"


def test_a_missing_data_path_names_the_flag(tmp_path: Path) -> None:
    r = run_main("train", "--config", "tiny", "--out", "run", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--data.path FILE" in r.stderr
    assert not (tmp_path / "run").exists()


def test_info_prints_no_empty_classify_section_for_a_language_model(tmp_path: Path) -> None:
    tok = build_tokenizer("char", "abcdef ")
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", TransformerLM(cfg), tokenizer=tok, train_state={"step": 1},
                    run_config={"task": "lm", "model": cfg.to_dict(), "train": {}, "data": {"path": "x"},
                                "classify": {}})
    r = run_main("info", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert "[model]" in r.stdout and "[data]" in r.stdout
    assert "[classify]" not in r.stdout  # a language model's classify section is left out
    assert "[train]" in r.stdout  # recorded (as defaults: an empty table is the defaults of a typed section)
