"""Classification on real files: column layouts and header-less CSVs, a fixed test file reported as *test*,
the tokenizer fit on training rows only, the stratified split fixed by data.split_seed, and the packaged
default config through the CLI."""

from __future__ import annotations

import csv
from collections import Counter

import pytest
import torch

from diffattn.checkpoint.format import load_checkpoint
from diffattn.configs.run_config import RunConfig
from diffattn.data.classification import ClassifyDataError, read_examples, stratified_split
from diffattn.model.tokenizer import build_tokenizer
from diffattn.train.classify import build_classifier, encode_texts, predict, prepare_data
from diffattn.train.launch import RunRequest, launch
from diffattn.train.runlog import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def _csv(path, rows, header=None):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if header:
            w.writerow(header)
        w.writerows(rows)
    return path


def _ag_news(path, n=60, seed=0, extra=""):
    """AG News layout: no header; class index, title, description. The class is the title's first word."""
    g = torch.Generator().manual_seed(seed)
    words = ["world", "sports", "business", "science"]
    rows = []
    for i in range(n):
        c = int(torch.randint(4, (1,), generator=g))
        rows.append((str(c + 1), f"{words[c]} news {i}", f"about {words[c]}{extra}"))
    return _csv(path, rows)


def _cfg(path, **data):
    return {"task": "classify",
            "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "attention": "diff", "max_seq_len": 32},
            "train": {"steps": 2, "batch_size": 8, "warmup_steps": 0, "eval_every": 0, "seed": 0},
            "data": {"path": str(path), **data}, "classify": {}}


def run_classify(cfg: dict, out, progress: bool = False) -> int:
    """``diffattn train`` on the run config ``cfg`` (its dict layout), in this process."""
    return launch(RunRequest(config=RunConfig.from_dict(cfg), out=out, progress=progress))


# ------------------------------------------------------------------------------------------ layouts
def test_other_columns_and_no_header(tmp_path):
    p = _csv(tmp_path / "named.csv", [("World", "Peace talks", "in Geneva"), ("Sports", "A goal", "late on")],
             header=("class", "title", "description"))
    got = read_examples(p, text_columns="title,description", label_column="class")
    assert got == [("World", "Peace talks in Geneva"), ("Sports", "A goal late on")]  # joined with one space
    assert read_examples(p, text_columns=["description"], label_column="CLASS") == [("World", "in Geneva"),
                                                                                  ("Sports", "late on")]
    with pytest.raises(ClassifyDataError, match="no column 'text' for data.text_columns.*no_header"):
        read_examples(p, label_column="class")
    # AG News: no header, columns by 0-based index; the first row is data, not a header
    ag = _csv(tmp_path / "ag.csv", [("3", "Wall St. Bears", "Short-sellers, ..."), ("1", "Peace", "talks")])
    assert read_examples(ag, no_header=True, label_column=0, text_columns="1,2") == [
        ("3", "Wall St. Bears Short-sellers, ..."), ("1", "Peace talks")]
    assert read_examples(ag, no_header=True, label_column="0", text_columns=[2]) == [
        ("3", "Short-sellers, ..."), ("1", "talks")]
    with pytest.raises(ClassifyDataError, match="with data.no_header, columns are 0-based indexes"):
        read_examples(ag, no_header=True)
    with pytest.raises(ClassifyDataError, match="line 1: 3 fields, column index 3 is needed"):
        read_examples(ag, no_header=True, label_column=0, text_columns="1,3")
    j = tmp_path / "d.jsonl"
    j.write_text('{"y": 2, "title": "a", "body": "b"}\n{"y": "neg", "title": "c", "body": "d"}\n')
    assert read_examples(j, label_column="y", text_columns="title,body") == [("2", "a b"), ("neg", "c d")]
    with pytest.raises(ClassifyDataError, match="no_header applies to CSV"):
        read_examples(j, no_header=True, label_column=0, text_columns=1)


# ------------------------------------------------------------------------------------------ leakage
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_is_fit_on_training_rows_only(tmp_path, kind):
    # every row carries one character of its own, so the tokenizer's vocabulary shows which rows it read
    rows = [("pos" if i % 3 else "neg", f"row {chr(0x3b1 + i)} text") for i in range(24)]
    p = _csv(tmp_path / "d.csv", rows, header=("label", "text"))
    test = _csv(tmp_path / "t.csv", [("pos", "only in test: Ж")], header=("label", "text"))
    cfg = _cfg(p, tokenizer=kind, test_path=str(test), val_fraction=0.25,
               **({"vocab_size": 300} if kind == "bpe" else {}))
    d = prepare_data(RunConfig.from_dict(cfg).data, 32)
    tok = d.tokenizer
    train_rows = {tuple(r[m].tolist()) for r, m in zip(d.train_ids, d.train_mask)}
    train_texts = [t for _, t in rows if tuple(tok.encode(t)) in train_rows]
    assert len(train_texts) == 18 and len(d.val_y) == 6
    if kind == "char":
        val_only = {t[4] for _, t in rows if t not in train_texts}
        assert val_only and not val_only & set(tok.chars)  # validation-only characters are unknown ...
        assert {t[4] for t in train_texts} <= set(tok.chars)
        unk = tok.vocab_size - 1
        assert tok.encode("Ж") == [unk] and unk in d.test_ids[0].tolist()  # ... and so is a test-only one
        assert all(unk in r[m].tolist() for r, m in zip(d.val_ids, d.val_mask))
    else:  # the BPE merges are those of the training rows alone
        expected = build_tokenizer("bpe", "\n".join(train_texts), 300)
        assert tok.to_dict() == expected.to_dict()


# ------------------------------------------------------------------------------------------ the split
def test_stratified_split_proportions():
    y = [0] * 50 + [1] * 31 + [2] * 7 + [3] * 2 + [4]
    tr, va = stratified_split(y, 0.2, seed=3)
    assert sorted(tr + va) == list(range(len(y))) and len(va) == round(len(y) * 0.2)
    got = Counter(y[i] for i in va)
    for c, n in Counter(y).items():
        assert abs(got[c] - 0.2 * n) <= 1, (c, got[c], n)
        assert got[c] < n  # every class keeps a training row
    assert stratified_split(y, 0.2, seed=3) == (tr, va)
    assert stratified_split(y, 0.2, seed=4) != (tr, va)
    assert stratified_split(y, 0.0, seed=3) == (list(range(len(y))), [])


def test_split_is_fixed_by_split_seed_not_train_seed(tmp_path):
    p = _ag_news(tmp_path / "ag.csv", n=80)
    cols = {"no_header": True, "label_column": 0, "text_columns": "1,2", "val_fraction": 0.25}

    def val_rows(train_seed, split_seed):
        cfg = _cfg(p, split_seed=split_seed, **cols)
        cfg["train"]["seed"] = train_seed
        d = build_classifier(RunConfig.from_dict(cfg))[2].data  # the split, as training sees it
        return d.val_ids.tolist(), d.val_y.tolist()

    ids, y = val_rows(0, 0)
    assert val_rows(1, 0) == (ids, y)  # another training seed: the same validation rows
    assert val_rows(0, 1)[0] != ids  # another split seed: other rows
    labels = [int(lab) - 1 for lab, _ in read_examples(p, no_header=True, label_column=0, text_columns="1,2")]
    total, val = Counter(labels), Counter(y)
    assert sum(val.values()) == 20
    for c in total:
        assert abs(val[c] - 0.25 * total[c]) <= 1


# ------------------------------------------------------------------------------------------ test file
def test_test_file_is_scored_and_reported_as_test(tmp_path, capsys):
    train = _ag_news(tmp_path / "train.csv", n=60)
    test = _ag_news(tmp_path / "test.csv", n=20, seed=1, extra=" ¿")  # "¿" never occurs in training
    cfg = _cfg(train, no_header=True, label_column=0, text_columns="1,2", test_path=str(test))
    cfg["train"].update(steps=20, eval_every=10)
    assert run_classify(cfg, tmp_path / "run", progress=False) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and f"(20 rows of {test})" in out
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert rows[0]["test_accuracy"] is None and rows[-1]["test_accuracy"] is not None  # scored once, at the end
    ck = load_checkpoint(tmp_path / "run" / "ckpt")
    assert ck.train_state["test_accuracy"] == rows[-1]["test_accuracy"]
    # the reported figure is the accuracy of the saved model on the test file
    ex = read_examples(test, no_header=True, label_column=0, text_columns="1,2")
    ids, mask = encode_texts([t for _, t in ex], ck.tokenizer, 32)
    labels = ck.run_config.classify.labels
    pred = predict(ck.build_model(), ids, mask)
    truth = torch.tensor([labels.index(lab) for lab, _ in ex])
    assert (pred == truth).float().mean().item() == pytest.approx(rows[-1]["test_accuracy"])
    assert f"test accuracy {rows[-1]['test_accuracy']:.4f}" in out
    bad = _csv(tmp_path / "bad.csv", [("9", "t", "d")])
    cfg["data"]["test_path"] = str(bad)
    assert run_classify(cfg, tmp_path / "run2", progress=False) == 2
    assert "test labels ['9'] do not occur in the training file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the CLI
def test_classify_data_keys_in_the_run_config():
    """The classification [data] keys are typed fields; --data.no_header works as a bare flag."""
    from diffattn.configs.run_config import ConfigError, load_run_config

    cfg = load_run_config("classify", ["--data.no_header", "--data.label_column", "0", "--data.text_columns",
                                       "1,2", "--data.split_seed", "7", "--data.test_path", "t.csv"])
    d = cfg.data
    assert (d.no_header, d.label_column, d.text_columns, d.split_seed, d.test_path) == (True, "0", "1,2", 7, "t.csv")
    assert cfg.task == "classify" and load_run_config("classify", ["--data.no_header"]).data.no_header
    assert load_run_config("tiny", ["--train.compile"]).train.compile is True
    with pytest.raises(ConfigError, match="--train.lr needs a value"):
        load_run_config("tiny", ["--train.lr", "--train.steps", "3"])
    with pytest.raises(ConfigError, match="split_seed: expected an int"):
        load_run_config("classify", ["--data.split_seed", "x"])


def test_readme_command_uses_the_packaged_default_config(tmp_path, monkeypatch, capsys):
    """`diffattn train --task classify --data.path f.csv` (no --config), here on an AG News-style file."""
    from clirun import run_main

    _ag_news(tmp_path / "train.csv", n=40)
    _ag_news(tmp_path / "test.csv", n=12, seed=1)
    res = run_main("train", "--task", "classify", "--data.path", "train.csv", "--data.no_header",
                       "--data.label_column", "0", "--data.text_columns", "1,2", "--data.test_path", "test.csv",
                       "--train.steps", "3", "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "test accuracy" in res.stdout and "(12 rows of test.csv)" in res.stdout
    ck = load_checkpoint(tmp_path / "runs" / "classify" / "ckpt")
    assert ck.run_config.classify.labels == ["1", "2", "3", "4"]
    assert (ck.model_config.d_model, ck.model_config.max_seq_len, ck.model_config.causal) == (128, 256, False)
    from diffattn.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--task", "classify", "--data.path", "train.csv", "--data.no_header"]) == 2
    assert "runs/classify already holds a run" in capsys.readouterr().err  # the first run is safe
    assert main(["train", "--task", "classify", "--data.path", "train.csv", "--data.no_header",
                 "--out", "runs/other"]) == 2
    assert capsys.readouterr().err.strip() == (  # the data path is recorded absolute, so it resumes from anywhere
        f"error: {tmp_path / 'train.csv'}: with data.no_header, columns are 0-based indexes, got ['label', 'text'];"
        " e.g. --data.label_column 0 --data.text_columns 1,2")
