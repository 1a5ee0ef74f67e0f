"""The rules every reader of a file from elsewhere follows (issue 39), each tested where it is enforced, once:
no non-regular file is read (a FIFO would block), no document nested past a bound is parsed, no file larger than
its bound is read whole, no name that is not UTF-8 is recorded, no string from a file reaches a terminal or a page
as control or markup, no train state of the wrong type reaches a reader, no model of more modules than a machine
builds in reasonable time is built, no text input is read whole before its first bytes and its size are checked,
and our safetensors reader refuses what the safetensors library refuses."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

from diffattn.checkpoint.tensor_files import Reader, TensorFileError
from diffattn.checkpoint.train_state import check_tokenizer_fits, check_train_state
from diffattn.data.text import DataError, check_text_input
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import MAX_MODULES, ModelTooLarge, check_fits, footprint
from diffattn.model.tokenizer import CharTokenizer
from diffattn.system.untrusted import (
    MAX_DEPTH,
    UnreadableInput,
    depth_of,
    markdown_code,
    markdown_text,
    printable,
    printable_text,
    read_bytes,
    read_json,
    read_toml,
    regular_file,
    utf8_name,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ------------------------------------------------------------------------------------------ what a file is


def test_a_fifo_is_refused_by_every_reader_not_waited_on(tmp_path):
    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)  # no writer: any open for reading that waits would hang this test
    for read in (read_bytes, read_json, read_toml, regular_file):
        with pytest.raises(UnreadableInput, match="not a regular file \\(a FIFO\\)"):
            read(fifo)
    with pytest.raises(DataError, match="a FIFO"):
        check_text_input([fifo])


@pytest.mark.parametrize("reader,suffix", [(read_json, ".json"), (read_toml, ".toml")])
def test_a_document_nested_too_deeply_is_refused_not_a_recursion_error(tmp_path, reader, suffix):
    f = tmp_path / f"deep{suffix}"
    f.write_text(_nested(100_000) if suffix == ".json" else f"a = {_nested(100_000)}\n")  # main: RecursionError
    with pytest.raises(UnreadableInput, match=f"nests more than {MAX_DEPTH} levels deep"):
        reader(f)
    f.write_text(_nested(MAX_DEPTH + 1) if suffix == ".json" else f"a = {_nested(MAX_DEPTH)}\n")  # parsed, too deep
    with pytest.raises(UnreadableInput, match="nests more than"):
        reader(f)
    f.write_text(json.dumps({"a": {"b": [1, {"c": 2}]}}) if suffix == ".json" else "[a]\nb = [[1], [2]]\n")
    assert reader(f)  # an ordinary document reads as before


def test_depth_is_counted_without_recursion():
    deep: list = []
    node = deep
    for _ in range(50_000):  # deeper than Python's recursion limit
        node.append([])
        node = node[0]
    assert depth_of(deep) == MAX_DEPTH + 1  # it stops counting past the bound
    assert depth_of({"a": [1, {"b": 2}]}) == 3 and depth_of(5) == 0


def test_a_file_larger_than_its_bound_is_refused_before_it_is_read(tmp_path):
    f = tmp_path / "big.json"
    with open(f, "wb") as fh:
        fh.truncate(1 << 40)  # 1 TB, sparse: reading it would take hours
    with pytest.raises(UnreadableInput, match="1,099,511,627,776 bytes"):
        read_json(f)


def test_a_name_that_is_not_utf8_is_refused_and_printed_as_its_bytes(tmp_path):
    name = os.fsdecode(b"caf\xe9.txt")  # as Python decodes a Latin-1 file name
    with pytest.raises(UnreadableInput, match=r"caf\\xe9\.txt is not valid UTF-8"):
        utf8_name(name, "the data file")
    assert utf8_name("café.txt") == "café.txt"
    assert printable(name) == "caf\\xe9.txt"
    print(printable(name).encode("utf-8"))  # the escaped form can always be written


# ------------------------------------------------------------------------------------------ what is shown


EVIL = "\x1b]0;owned\x07\x1b[2J\u202eevil<img src=x onerror=alert(1)>[x](javascript:alert(1))`"


def test_printable_text_keeps_lines_and_tabs_but_no_control():
    out = printable_text("a\tb\nc" + EVIL)
    assert out.startswith("a\tb\nc") and not any(ord(c) < 32 and c not in "\t\n" for c in out)
    assert "\u202e" not in out and "\\u202e" in out and "\\x1b" in out and "\\x07" in out


def test_markdown_text_and_code_show_markup_as_text():
    md = markdown_text(EVIL)
    assert re.search(r"(?<!\\)[<>\[\]()`]", md) is None  # every markup character escaped
    assert "\\<img" in md and "\\[x\\]\\(javascript" in md and "\x1b" not in md
    code = markdown_code("a``b`")
    assert code.startswith("```") and code.endswith("```") and "a``b`" in code  # the span cannot end early


# ------------------------------------------------------------------------------------------ a checkpoint's fields


@pytest.mark.parametrize("field,value", [("step", 10**30), ("step", "3"), ("step", True), ("tokens_seen", -1),
                                         ("best", {"metric": "val_loss", "value": "x", "step": 1}),
                                         ("history", "\x1b]0;t\x07"), ("history", [1, 2]),
                                         ("rng_meta", {"python": ["3", None]}), ("rng_meta", {"numpy": [1, 2]}),
                                         ("train_config", {"batch_size": "two"}), ("elapsed_s", float("nan")),
                                         ("world_size", 0), ("scaler", [])])
def test_a_train_state_field_of_the_wrong_type_is_refused(field, value):
    with pytest.raises(ValueError, match=f"train_state.{field} must be"):
        check_train_state({field: value})


def test_a_train_state_a_run_writes_passes():
    state = {"step": 4, "tokens_seen": 64, "best_val_loss": 2.5, "best": {"metric": "val_loss", "value": 2.5,
             "step": 4}, "history": [{"step": 2, "train_loss": 3.0}], "elapsed_s": 1.5,
             "rng_meta": {"python": [3, None], "numpy": ["MT19937", 624, 0, 0.0]}, "world_size": 1,
             "train_config": {"batch_size": 2, "seq_len": 8}, "scaler": None, "val_accuracy": None}
    assert check_train_state(state) is state


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="its tokenizer has 5 tokens but the model's vocabulary only 3"):
        check_tokenizer_fits(CharTokenizer("abcde"), 3)
    check_tokenizer_fits(CharTokenizer("abc"), 3)


# ------------------------------------------------------------------------------------------ the build cost


def test_a_model_of_a_million_thin_layers_is_refused_before_it_is_built():
    cfg = ModelConfig(vocab_size=4, d_model=2, n_layers=10**6, n_heads=1, attention="standard", max_seq_len=8,
                      ffn_hidden=2)  # the TOML: 10⁶ layers of d_model 2
    fp = footprint(cfg)
    assert fp.modules > MAX_MODULES and fp.weights < 2e8  # its tensors fit any machine: the count refuses it
    with pytest.raises(ModelTooLarge, match="has 13,000,008 modules to build; diffattn builds at most 200,000"):
        check_fits(cfg, "X")
    check_fits(cfg, "the KV cache", copies=0, rope=False)  # a built model's cache check builds nothing


def test_the_module_count_is_the_built_models(make_config):
    from diffattn.model.transformer import TransformerClassifier, TransformerLM

    for kw in ({}, {"attention": "standard"}, {"attention": "dint"}, {"attention": "alibi"}):
        cfg = make_config(**kw)
        assert footprint(cfg).modules == sum(1 for _ in TransformerLM(cfg).modules())
    cfg = make_config()
    assert footprint(cfg, num_classes=3).modules == sum(1 for _ in TransformerClassifier(cfg, 3).modules())


# ------------------------------------------------------------------------------------------ text input


def test_text_input_is_checked_by_its_first_bytes_and_size_before_it_is_read(tmp_path, monkeypatch):
    reads: list[Path] = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")
    nul = tmp_path / "nul.txt"
    with open(nul, "wb") as f:
        f.truncate(2 * 10**9)  # 2 GB of NUL bytes, sparse
    with pytest.raises(DataError, match="NUL byte at byte offset 0"):
        check_text_input([nul])
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"text " * 20_000)
        f.truncate(30 * 10**9)  # 30 GB, its first bytes text
    with pytest.raises(DataError, match="30 GB of text input is read whole, which takes about 720 GB of memory"):
        check_text_input([big])
    assert reads == []  # neither was read whole
    small = tmp_path / "ok.txt"
    small.write_bytes(b"hello\n")
    assert check_text_input([small]) == 6


# ------------------------------------------------------------------------------------------ safetensors


def _tensor_file(path: Path, header: object, data: bytes, *, size: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if size is None else size) + raw + data)
    return path


ENTRY = {"dtype": "F32", "shape": [2]}
CRAFTED = {
    "overlapping": ({"a": {**ENTRY, "data_offsets": [0, 8]}, "b": {**ENTRY, "data_offsets": [4, 12]}}, 12),
    "out-of-order gap": ({"a": {**ENTRY, "data_offsets": [8, 16]}, "b": {**ENTRY, "data_offsets": [16, 24]}}, 24),
    "list header": ([1, 2, 3], 0),
    "metadata not text": ({"__metadata__": {"a": 1}}, 0),
    "nested": (json.loads(_nested(200)), 0),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_our_safetensors_reader_refuses_what_the_library_refuses(tmp_path, case):
    header, n = CRAFTED[case]
    f = _tensor_file(tmp_path / "m.safetensors", header, b"\0" * n)
    with pytest.raises(SafetensorError):
        safe_open(str(f), framework="pt")
    with pytest.raises(TensorFileError, match="not a valid safetensors file"):
        Reader(f)


def test_a_header_over_the_librarys_limit_is_refused(tmp_path):
    f = tmp_path / "m.safetensors"
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 100_000_001) + b"{" + b" " * 100_000_000)  # main's reader parsed it
    with pytest.raises(TensorFileError, match="header too large"):
        Reader(f)


def test_a_file_the_library_writes_reads_as_before(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 3)}, str(tmp_path / "m.safetensors"))
    with Reader(tmp_path / "m.safetensors") as r:
        assert torch.equal(r.read("b"), torch.ones(2, 3)) and torch.equal(r.read("a"), torch.arange(4.0))
