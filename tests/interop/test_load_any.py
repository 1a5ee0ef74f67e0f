"""One loader: diffattn.load_pretrained / load_pretrained_tokenizer read every folder diffattn writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import diffattn
from diffattn import ModelConfig, TransformerClassifier, TransformerLM
from diffattn.checkpoint.format import save_checkpoint
from diffattn.checkpoint.model_folders import PretrainedError, load_pretrained_tokenizer
from diffattn.cli.main import main as cli_main
from diffattn.cli.train import main as train_main
from diffattn.interop.convert import convert, pretrained_files, write_pretrained_into
from diffattn.model.tokenizer import build_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=30, d_model=32, n_layers=1, n_heads=2, max_seq_len=16), **kw})


def _ids() -> torch.Tensor:
    return torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert type(a) is type(b)
    with torch.no_grad():
        assert torch.equal(a.eval()(_ids()), b.eval()(_ids()))


def _checkpoint(folder: Path, model: torch.nn.Module, task: str = "lm", **run) -> None:
    tok = build_tokenizer("char", TEXT)
    save_checkpoint(folder, model, run_config={"task": task, "model": model.config.to_dict(), **run},
                    tokenizer=tok, train_state={"step": 1})


def test_run_folder_and_its_ckpt(tmp_path: Path, one_thread) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "run"
    assert train_main(["--config", "tiny", "--out", str(out), "--data.path", str(corpus), "--no-progress",
                       "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                       "--model.max_seq_len", "16", "--train.seq_len", "16", "--train.batch_size", "2",
                       "--train.steps", "2", "--train.eval_every", "0", "--train.log_every", "1",
                       "--train.warmup_steps", "1"]) == 0
    a, b = diffattn.load_pretrained(out), diffattn.load_pretrained(out / "ckpt")
    assert isinstance(a, TransformerLM) and not a.training
    _same(a, b)
    for where in (out, out / "ckpt"):
        tok = diffattn.load_pretrained_tokenizer(where)
        assert tok.decode(tok.encode("lazy fox")) == "lazy fox"


def test_save_pretrained_convert_cell_and_compare_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    lm = TransformerLM(_cfg())
    # a save_pretrained folder
    lm.save_pretrained(tmp_path / "hub", tokenizer=build_tokenizer("char", TEXT))
    _same(diffattn.load_pretrained(tmp_path / "hub"), lm)
    # a convert output (a checkpoint folder), and the same conversion as a save_pretrained folder (--format hub)
    base = TransformerLM(_cfg(attention="standard"))
    _checkpoint(tmp_path / "base", base)
    assert cli_main(["convert", str(tmp_path / "base"), "--to", "diff", "--out", str(tmp_path / "converted")]) == 0
    conv = convert(base, "diff")
    _same(diffattn.load_pretrained(tmp_path / "converted"), conv)
    assert write_pretrained_into(tmp_path / "converted-hub", conv, build_tokenizer("char", TEXT)) == []
    assert {p.name for p in (tmp_path / "converted-hub").iterdir()} == set(pretrained_files())
    _same(diffattn.load_pretrained(tmp_path / "converted-hub"), conv)
    assert load_pretrained_tokenizer(tmp_path / "converted-hub").encode("fox") == \
        load_pretrained_tokenizer(tmp_path / "converted").encode("fox")
    # the command writes the same save_pretrained folder with --format hub, and refuses to write it twice
    hub = tmp_path / "cli-hub"
    assert cli_main(["convert", str(tmp_path / "base"), "--to", "diff", "--out", str(hub), "--format", "hub"]) == 0
    assert {p.name for p in hub.iterdir()} == set(pretrained_files())
    assert (hub / "README.md").read_text().count("load_pretrained") >= 1
    _same(diffattn.load_pretrained(hub), conv)
    assert cli_main(["convert", str(tmp_path / "base"), "--to", "diff", "--out", str(hub), "--format", "hub"]) == 2
    # a compare --data cell (DIR/cells/<cell>/ckpt) and a compare model run (DIR/runs/<model>/ckpt)
    study, comp = tmp_path / "study", tmp_path / "cmp"
    (study / "cells" / "diff-lr1e-3-s0").mkdir(parents=True)
    (study / "study.json").write_text("{}")
    _checkpoint(study / "cells" / "diff-lr1e-3-s0" / "ckpt", lm)
    (comp / "runs" / "DIFF").mkdir(parents=True)
    (comp / "results.json").write_text("{}")
    (comp / "config.json").write_text("{}")
    _checkpoint(comp / "runs" / "DIFF" / "ckpt", lm)
    for folder in (study / "cells" / "diff-lr1e-3-s0", comp / "runs" / "DIFF"):
        _same(diffattn.load_pretrained(folder), lm)
        assert diffattn.load_pretrained_tokenizer(folder).vocab_size == len(set(TEXT))
    # the comparison folder itself holds several models: the error names them
    with pytest.raises(PretrainedError, match="comparison folder holding 1 models.*DIFF"):
        diffattn.load_pretrained(comp)


def test_classifier_checkpoint_and_no_tokenizer(tmp_path: Path) -> None:
    torch.manual_seed(1)
    clf = TransformerClassifier(_cfg(rope="none", attention="distance"), num_classes=3, pooling="mean")
    _checkpoint(tmp_path / "cls" / "ckpt", clf, task="classify", classify={"num_classes": 3, "pooling": "mean"})
    back = diffattn.load_pretrained(tmp_path / "cls")
    assert type(back) is TransformerClassifier and back.head.out_features == 3
    with torch.no_grad():
        assert torch.equal(back(_ids()), clf.eval()(_ids()))
    lm = TransformerLM(_cfg())
    save_checkpoint(tmp_path / "bare", lm, run_config={"task": "lm", "model": lm.config.to_dict()})
    assert diffattn.load_pretrained_tokenizer(tmp_path / "bare") is None


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PretrainedError, match=r"missing: not a model folder \(it does not exist"):
        diffattn.load_pretrained(tmp_path / "missing")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a transformers folder
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    # read as one (issue 32: the Llama a user converted from), and this one is incomplete
    with pytest.raises(PretrainedError, match="a transformers folder diffattn cannot read: config.json lacks"):
        diffattn.load_pretrained(tmp_path / "hf")
    lm = TransformerLM(_cfg())
    _checkpoint(tmp_path / "run" / "ckpt", lm)
    (tmp_path / "run" / "ckpt" / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(PretrainedError, match="model.safetensors is truncated or altered"):
        diffattn.load_pretrained(tmp_path / "run")


def test_info_generate_and_eval_read_a_save_pretrained_folder(tmp_path: Path, capsys) -> None:
    """The commands read what load_pretrained reads: a save_pretrained folder too, not only checkpoints."""
    from clirun import run_main

    torch.manual_seed(0)
    lm = TransformerLM(_cfg(n_layers=1))
    hub, corpus = tmp_path / "hub", tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    lm.save_pretrained(hub, tokenizer=build_tokenizer("char", TEXT))
    _checkpoint(tmp_path / "ck", lm)  # the same weights and tokenizer as a checkpoint folder
    info = run_main("info", hub)
    assert info.returncode == 0, info.stderr
    assert f"checkpoint: {hub}\ntask: lm\n[model]\n" in info.stdout and "  attention = 'diff'" in info.stdout
    assert f"  {'total':<16} {lm.num_params():>14,}" in info.stdout
    assert "lm_head.weight tied to body.tok_emb.weight (counted once)" in info.stdout
    assert "tokenizer: CharTokenizer" in info.stdout and "training state: none recorded" in info.stdout
    gen = [run_main("generate", where, "--prompt", "the ", "--max-new-tokens", "8", "--seed", "1")
           for where in (hub, tmp_path / "ck")]
    assert gen[0].returncode == 0, gen[0].stderr
    assert gen[0].stdout == gen[1].stdout and gen[0].stdout.startswith("the ")
    ev = run_main("eval", hub, "--what", "ppl", "--data", corpus, "--batches", "1", "--batch-size", "2",
                      "--json")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["ppl"]["loss"] > 0

    # a classifier's folder shows its head; an encoder's has nothing to generate or evaluate
    clf = TransformerClassifier(_cfg(rope="none"), num_classes=3, pooling="first")
    clf.save_pretrained(tmp_path / "clf")
    assert cli_main(["info", str(tmp_path / "clf")]) == 0
    out = capsys.readouterr().out
    assert "task: classify" in out and "[classify]\n  pooling = 'first'\n  num_classes = 3" in out  # typed: field order
    diffattn.TransformerEncoder(_cfg()).save_pretrained(tmp_path / "enc")
    assert cli_main(["info", str(tmp_path / "enc")]) == 0
    assert "task: encoder" in capsys.readouterr().out
    assert cli_main(["generate", str(tmp_path / "enc"), "--prompt", "a"]) == 2
    assert "is a 'encoder' checkpoint; generate needs a language model" in capsys.readouterr().err
    assert cli_main(["eval", str(tmp_path / "enc")]) == 2
    assert "holds a encoder" in capsys.readouterr().err
