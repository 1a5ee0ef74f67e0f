"""Record corpora (.jsonl/.json/.parquet, folders and globs) through the real ``datasets`` library: the LM source,
the token cache (a second run does not tokenize again), BPE on a bounded sample, classification and the study."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffattn.data import lm as D
from diffattn.data.classification import read_examples
from diffattn.data.records import RecordError, record_files, sample_text
from diffattn.model.tokenizer import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [f"record {i}: the quick brown fox jumps over the lazy dog" for i in range(120)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Every cached file of these tests goes to a folder of their own, never the user's cache."""
    monkeypatch.setenv("DIFFATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _parquet(path: Path, docs: list[str], **columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": docs, **columns}), path)
    return path


def _tokens(source) -> np.ndarray:
    return np.asarray(source.tokens)


def test_jsonl_source_is_a_memmapped_cached_token_file(tmp_path, cache, capsys, monkeypatch):
    f = _jsonl(tmp_path / "c.jsonl", DOCS)
    src, tok = D.make_source({"path": str(f)}, seq_len=16)
    assert isinstance(src.tokens, np.memmap)
    assert tok.decode(_tokens(src).tolist()) == "".join(d + "\n" for d in DOCS)  # a newline after each record
    err = capsys.readouterr().err
    assert "tokenizing 1 file(s) into" in err and "not tokenizing again" not in err
    assert [p.suffix for p in sorted(cache.glob("tokens-*"))] == [".bin", ".json"]

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(D, "write_token_stream", refuse)
    again, tok2 = D.make_source({"path": str(f)}, seq_len=16)
    assert "using the cached tokens" in capsys.readouterr().err
    assert np.array_equal(_tokens(again), _tokens(src)) and tok2.to_dict() == tok.to_dict()
    # resuming passes the run's tokenizer: the same cache entry
    D.make_source({"path": str(f)}, seq_len=16, tokenizer=tok)
    assert "not tokenizing again" in capsys.readouterr().err


def test_parquet_folder_glob_and_text_field_read_the_same_corpus(tmp_path, cache):
    half = len(DOCS) // 2
    _parquet(tmp_path / "pq" / "a.parquet", DOCS[:half], label=list(range(half)))
    _parquet(tmp_path / "pq" / "b.parquet", DOCS[half:], label=list(range(len(DOCS) - half)))
    _jsonl(tmp_path / "field.jsonl", DOCS, field="content")
    _jsonl(tmp_path / "c.jsonl", DOCS)
    base, tok = D.make_source({"path": str(tmp_path / "c.jsonl")}, seq_len=16)
    for cfg in ({"path": str(tmp_path / "pq")}, {"path": str(tmp_path / "pq" / "*.parquet")},
                {"path": str(tmp_path / "field.jsonl"), "text_field": "content"}):
        src, _ = D.make_source(cfg, seq_len=16, tokenizer=tok)
        assert np.array_equal(_tokens(src), _tokens(base)), cfg
    assert D.read_text(tmp_path / "pq") == "".join(d + "\n" for d in DOCS)  # what compare --data fits on


def test_bad_record_corpora_say_what_is_wrong(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", DOCS)
    with pytest.raises(RecordError, match=r"c.jsonl: row 1 has no field 'body' \(fields: text, id\)"):
        D.make_source({"path": str(f), "text_field": "body"}, seq_len=16)
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", DOCS)
    (tmp_path / "mixed" / "notes.txt").write_text("hello")
    with pytest.raises(RecordError, match="mixes record files"):
        record_files(tmp_path / "mixed")
    with pytest.raises(RecordError, match="matches no files"):
        record_files(tmp_path / "none-*.jsonl")
    with pytest.raises(D.DataError, match="bpe_sample_mb must be a positive number"):
        D.make_source({"path": str(f), "bpe_sample_mb": 0}, seq_len=16)
    assert record_files(tmp_path / "mixed" / "notes.txt") is None  # text input stays text input


def test_bpe_trains_on_a_bounded_sample(tmp_path, cache):
    # the first records are about foxes; the rest, far past the sample, repeat one rare word many times
    docs = ["the quick brown fox jumps over the lazy dog " * 4] * 40 + ["zyzzyva zyzzyva zyzzyva"] * 4000
    f = _jsonl(tmp_path / "big.jsonl", docs)
    mb = 0.005
    src, tok = D.make_source({"path": str(f), "tokenizer": "bpe", "vocab_size": 300, "bpe_sample_mb": mb},
                             seq_len=16)
    sample = sample_text(record_files(f), "text", int(mb * 2**20))
    assert len(sample.encode()) < f.stat().st_size // 10
    assert tok.to_dict() == build_tokenizer("bpe", sample, 300).to_dict()  # fitted on the sample alone
    assert "zyzzyva" not in sample and not any("zyz" in t for t in tok.tok.get_vocab())
    assert tok.decode(_tokens(src).tolist()).endswith("zyzzyva zyzzyva zyzzyva\n")  # yet all of it is tokenized
    assert len(list(cache.glob("tokenizer-*.json"))) == 1  # kept: a second run does not fit it again


def test_train_twice_on_jsonl_tokenizes_once(tmp_path):
    from clirun import run_main

    _jsonl(tmp_path / "c.jsonl", DOCS)
    args = ["train", "--config", "tiny", "--data.path", "c.jsonl", "--data.tokenizer", "bpe", "--data.vocab_size",
            "280", "--no-progress", "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2",
            "--model.max_seq_len", "16", "--train.seq_len", "16", "--train.batch_size", "2", "--train.steps", "2",
            "--train.eval_every", "0"]
    first = run_main(*args, "--out", "run1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "tokenizing 1 file(s)" in first.stderr and "not tokenizing again" not in first.stderr
    second = run_main(*args, "--out", "run2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "using the cached tokens" in second.stderr and "tokenizing 1 file(s)" not in second.stderr
    bad = run_main(*args[:5], "--data.text_field", "body", "--out", "run3", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "has no field 'body'" in bad.stderr


def test_classification_from_jsonl_and_parquet(tmp_path, capsys):
    from diffattn.configs.run_config import RunConfig
    from diffattn.train.launch import RunRequest, launch

    words = ["world", "sports", "business", "science"]
    texts = [f"{words[i % 4]} news number {i}" for i in range(48)]
    labels = [words[i % 4] for i in range(48)]
    pqf = _parquet(tmp_path / "train.parquet", texts, label=labels)
    jl = tmp_path / "train.jsonl"
    jl.write_text("".join(json.dumps({"body": t, "label": lab}) + "\n" for t, lab in zip(texts, labels)))
    assert read_examples(pqf) == list(zip(labels, texts))
    assert read_examples(jl, text_columns="body") == list(zip(labels, texts))
    for path, data in ((pqf, {}), (jl, {"text_field": "body"})):
        cfg = {"task": "classify",
               "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "attention": "diff", "max_seq_len": 32},
               "train": {"steps": 2, "batch_size": 8, "warmup_steps": 0, "eval_every": 0, "seed": 0},
               "data": {"path": str(path), **data}, "classify": {}}
        out = tmp_path / f"run-{path.suffix[1:]}"
        assert launch(RunRequest(config=RunConfig.from_dict(cfg), out=out, progress=False)) == 0
        assert "val accuracy" in capsys.readouterr().out


def test_compare_data_reads_a_record_corpus(tmp_path):
    from diffattn.experiments.study.cell import prepare_data
    from diffattn.experiments.study.spec import StudySpec

    f = _jsonl(tmp_path / "c.jsonl", DOCS)
    spec = StudySpec.from_dict(dict(data=str(f), d_model=16, n_layers=1, heads=[2], lrs=[1e-3], seeds=[0], seq_len=16,
                     batch_size=2, steps=2))
    src, tok = prepare_data(spec)
    assert tok.decode(_tokens(src).tolist()) == "".join(d + "\n" for d in DOCS)


def test_a_tokenizer_json_is_used_as_it_is(tmp_path):
    f = _jsonl(tmp_path / "c.jsonl", DOCS)
    bpe = build_tokenizer("bpe", "".join(DOCS), 280)
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    src, tok = D.make_source({"path": str(f), "tokenizer": str(tmp_path / "tokenizer.json")}, seq_len=16)
    assert tok.kind == "hf" and tok.encode("lazy dog") == bpe.encode("lazy dog")
    assert tok.decode(_tokens(src).tolist()) == "".join(d + "\n" for d in DOCS)
