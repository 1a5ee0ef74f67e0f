"""A tokenizer from elsewhere (issue 52): `info` on a transformers folder holding a crafted 170 MB BPE
``tokenizer.json`` of 5 million tokens and merges took 130 s and 4.4 GB before it answered. A tokenizer.json is now
checked as every other file is before the tokenizers library parses it: its size before it is read, its nesting, and
the counts of its vocabulary, merges and added tokens. One line, exit 2, from every reader of a transformers folder
and of a checkpoint's saved tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile import copy_run, edit_json, llama_folder, one_line_refusal, run_entry, train_tiny

import diffattn.model.tokenizer as tokenizer_module
from diffattn.model.tokenizer import MAX_TOKENIZER_BYTES, HFTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

POINTS = ["info", "convert", "generate", "eval"]  # every reader of a transformers folder's tokenizer


def bpe_json(n: int) -> dict:
    """A tokenizers BPE document of ``n`` + 11 tokens and ``n`` merges (``t`` and the digits, then ``t0`` ...)."""
    vocab = {c: i for i, c in enumerate("t0123456789")}
    vocab.update({f"t{i}": i + 11 for i in range(n)})
    merges = [[f"t{i // 10}", str(i % 10)] if i >= 10 else ["t", str(i)] for i in range(n)]
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None, "model": model}


@pytest.fixture
def parsed(monkeypatch) -> list[int]:
    """The length of every document the tokenizers library is asked to parse: a refusal parsed none."""
    seen: list[int] = []
    real = tokenizer_module._TokenizersTokenizer

    class Recording:
        @staticmethod
        def from_str(text: str):
            seen.append(len(text))
            return real.from_str(text)

    monkeypatch.setattr(tokenizer_module, "_TokenizersTokenizer", Recording)
    return seen


def _folder(tmp: Path) -> Path:
    folder = llama_folder(tmp / "llama")
    (folder / "tokenizer.json").write_text(json.dumps(bpe_json(20)))
    return folder


def test_a_tokenizer_within_its_bounds_reads_as_before(tmp_path, parsed):
    tok = HFTokenizer.from_file(_folder(tmp_path) / "tokenizer.json")
    assert tok.vocab_size == 31 and tok.decode(tok.encode("t12")) == "t12" and len(parsed) == 1


@pytest.mark.parametrize("point", POINTS)
def test_a_tokenizer_json_larger_than_its_bound_is_refused_before_it_is_read(tmp_path, parsed, monkeypatch, point):
    folder = _folder(tmp_path)
    with open(folder / "tokenizer.json", "r+b") as f:  # sparse: no 64 MiB written, none read
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    monkeypatch.setattr(tokenizer_module, "loads_json", lambda *a: pytest.fail("the oversized file was parsed"))
    one_line_refusal(run_entry(point, folder, tmp_path), "tokenizer.json is 67,108,865 bytes",
                     "takes at most 67,108,864")
    assert parsed == [] and not (tmp_path / "converted").exists()


@pytest.mark.parametrize("point", POINTS)
def test_a_tokenizer_json_nested_too_deeply_is_refused_before_it_is_built(tmp_path, parsed, point):
    folder = _folder(tmp_path)
    deep = 100_000  # past Python's recursion limit too
    (folder / "tokenizer.json").write_text('{"model": ' + "[" * deep + "]" * deep + "}")
    one_line_refusal(run_entry(point, folder, tmp_path), "tokenizer.json: the JSON nests more than 64 levels deep")
    assert parsed == []


# (the bound made small, so that a small file exceeds it: its value, and the added tokens the file holds)
SMALL = {"model.vocab": ("MAX_TOKENS", 30, 3), "model.merges": ("MAX_MERGES", 19, 3),
         "added_tokens": ("MAX_TOKENS", 35, 40)}


@pytest.mark.parametrize("part", sorted(SMALL))
@pytest.mark.parametrize("point", POINTS)
def test_a_tokenizer_of_too_many_tokens_or_merges_is_refused_before_it_is_built(tmp_path, parsed, monkeypatch,
                                                                                point, part):
    """The bounds (a million tokens, two million merges) made small: a small file of 31 tokens and 20 merges
    exceeds them."""
    folder = _folder(tmp_path)
    bound, value, added = SMALL[part]
    doc = bpe_json(20)
    doc["added_tokens"] = [{"id": 31 + i, "content": f"<x{i}>", "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True} for i in range(added)]
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    monkeypatch.setattr(tokenizer_module, bound, value)
    one_line_refusal(run_entry(point, folder, tmp_path), f"tokenizer.json: its {part} holds", "the tokenizer is "
                     "refused")
    assert parsed == []


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("tokenizers"))


@pytest.mark.parametrize("point", ["info", "generate", "eval"])
def test_a_checkpoints_saved_tokenizer_of_too_many_tokens_is_refused(run, tmp_path, parsed, monkeypatch, point):
    folder = copy_run(run, tmp_path / "r")
    for ck in [folder / "ckpt", folder / "best", *folder.glob("ckpt-step-*")]:
        edit_json(ck, "config.json", lambda c: c.update(tokenizer={"kind": "hf", "tokenizer": bpe_json(20)}))
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENS", 30)
    one_line_refusal(run_entry(point, folder, tmp_path), "the saved hf tokenizer: its model.vocab holds 31 entries")
    assert parsed == []
