"""Tokenizers, text input, token files, batch windows and make_source."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from diffattn.data import lm as D
from diffattn.data import text
from diffattn.data import token_files as TF
from diffattn.model import tokenizer as T

UNICODE_TEXT = "héllo wörld, naïve café — 日本語のテキスト 🙂🚀\nsecond line\tτab ∑ ñ\n" * 3


# --------------------------------------------------------------------------------------------- tokenizers
def test_char_roundtrip_unicode_and_dict():
    tok = T.build_tokenizer("char", UNICODE_TEXT)
    assert tok.vocab_size == len(set(UNICODE_TEXT))
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) == len(UNICODE_TEXT)  # one id per code point, multi-byte characters included
    assert tok.decode(ids) == UNICODE_TEXT
    # ids follow the sorted character order
    assert tok.encode("".join(sorted(set(UNICODE_TEXT)))) == list(range(tok.vocab_size))
    tok2 = T.tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert tok2.encode(UNICODE_TEXT) == ids and tok2.vocab_size == tok.vocab_size


def test_char_unseen_character_is_a_clear_error():
    tok = T.build_tokenizer("char", "abc")
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at position 2"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="does not apply to the char tokenizer"):
        T.build_tokenizer("char", "abc", vocab_size=100)


def test_bpe_roundtrip_unicode_and_dict():
    tok = T.build_tokenizer("bpe", UNICODE_TEXT, vocab_size=300)
    assert 256 < tok.vocab_size <= 300
    for s in (UNICODE_TEXT, "unseen words: Ωmega 中文 🎉", "  leading spaces\n\n"):
        ids = tok.encode(s)  # byte-level: anything encodes, even characters never seen in training
        assert tok.decode(ids) == s
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) < len(UNICODE_TEXT.encode("utf-8"))  # merges were learned
    tok2 = T.tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert type(tok2) is T.BPETokenizer and tok2.vocab_size == tok.vocab_size
    assert tok2.encode(UNICODE_TEXT) == ids
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_tokenizer_bad_kind_and_dict():
    with pytest.raises(ValueError, match="unknown tokenizer 'word'"):
        T.build_tokenizer("word", "abc")
    with pytest.raises(ValueError, match="BPE vocab_size must be an int >= 256"):
        T.build_tokenizer("bpe", "abc", vocab_size=100)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        T.tokenizer_from_dict({"kind": "sentencepiece"})
    with pytest.raises(ValueError, match="'kind'"):
        T.tokenizer_from_dict({"chars": "abc"})
    with pytest.raises(ValueError, match="not a valid tokenizers JSON"):
        T.tokenizer_from_dict({"kind": "bpe", "tokenizer": {"model": "nonsense"}})


# --------------------------------------------------------------------------------------------- text input
def test_read_text_file_and_folder(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("\ufeffhello\n", encoding="utf-8")
    assert D.read_text(f) == "hello\n"  # BOM dropped

    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.txt").write_text("B", encoding="utf-8")
    (root / "a.md").write_text("A\n", encoding="utf-8")
    (root / "sub" / "c.txt").write_text("C", encoding="utf-8")
    (root / ".hidden.txt").write_bytes(b"\x00\x01")  # hidden: skipped, so its binary content is no error
    (root / ".git" / "x").write_text("ignored", encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")
    names = [p.relative_to(root).as_posix() for p in text.text_files(root)]
    assert names == ["a.md", "b.txt", "empty.txt", "sub/c.txt"]
    assert D.read_text(root) == "A\nB\nC\n"


def test_read_text_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(D.DataError, match=f"{missing}: no such file"):
        D.read_text(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(D.DataError, match=f"{empty}: empty file"):
        D.read_text(empty)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(D.DataError, match="folder contains no"):
        D.read_text(folder)
    (folder / "e.txt").write_bytes(b"")
    with pytest.raises(D.DataError, match="empty folder"):
        D.read_text(folder)
    binary = tmp_path / "img.txt"
    binary.write_bytes(b"GIF89a\x00\x01")
    with pytest.raises(D.DataError, match=f"{binary}: looks like a binary file \\(NUL byte at byte offset 6"):
        D.read_text(binary)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("abc café".encode("latin-1"))  # é = 0xE9 at byte offset 7
    with pytest.raises(D.DataError, match=f"{latin}: not valid UTF-8 at byte offset 7"):
        D.read_text(latin)
    (folder / "bad.txt").write_bytes(b"ok\xff")
    with pytest.raises(D.DataError, match="bad.txt: not valid UTF-8 at byte offset 2"):
        D.read_text(folder)


# --------------------------------------------------------------------------------------------- token files
def test_token_file_roundtrip_memmap(tmp_path):
    tok = T.build_tokenizer("char", "abcdefghij")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tok.vocab_size, size=1000)
    path = tmp_path / "toks.bin"
    meta_path = TF.write_token_file(path, ids, tok.vocab_size, tok)
    assert meta_path == tmp_path / "toks.json"
    assert path.stat().st_size == 2 * len(ids)  # uint16
    mm, meta = TF.read_token_file(path)
    assert isinstance(mm, np.memmap) and mm.dtype == np.uint16
    assert meta["num_tokens"] == 1000 and meta["vocab_size"] == 10 and meta["dtype"] == "uint16"
    for off in (0, 1, 517, 999):
        assert int(mm[off]) == int(ids[off])
    assert T.tokenizer_from_dict(meta["tokenizer"]).encode("jab") == [9, 0, 1]


@pytest.mark.parametrize("vocab,dtype,itemsize", [(65536, "uint16", 2), (65537, "uint32", 4)])
def test_token_file_dtype_selection(tmp_path, vocab, dtype, itemsize):
    ids = np.array([0, 1, vocab - 1, 7], dtype=np.int64)  # the largest id must survive the narrowing
    path = tmp_path / "t.bin"
    TF.write_token_file(path, ids, vocab)
    mm, meta = TF.read_token_file(path)
    assert meta["dtype"] == dtype and mm.dtype.itemsize == itemsize
    assert path.stat().st_size == itemsize * len(ids)
    assert mm.tolist() == ids.tolist()


def test_token_file_write_errors(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(D.DataError, match="too large for a token file"):
        TF.write_token_file(path, [0, 1], 2**32 + 1)
    with pytest.raises(D.DataError, match="token id 10 is out of range for vocab_size 10"):
        TF.write_token_file(path, [0, 10], 10)
    with pytest.raises(D.DataError, match="token id -1"):
        TF.write_token_file(path, [-1, 3], 10)
    with pytest.raises(D.DataError, match="must end in .bin"):
        TF.write_token_file(tmp_path / "t.dat", [0], 10)
    assert not path.exists()


def test_token_file_read_errors(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(D.DataError, match="token file not found"):
        TF.read_token_file(path)
    TF.write_token_file(path, np.arange(100), 100)
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])
    with pytest.raises(D.DataError, match=r"truncated: 197 bytes, expected 200 \(100 tokens of uint16\)"):
        TF.read_token_file(path)
    path.write_bytes(raw + b"\x00\x00")
    with pytest.raises(D.DataError, match="longer than its metadata says"):
        TF.read_token_file(path)
    # an id beyond the vocabulary, written behind the writer's back
    path.write_bytes(np.array([1, 2, 300] + [0] * 97, dtype="<u2").tobytes())
    with pytest.raises(D.DataError, match="token id 300"):
        TF.read_token_file(path)
    (tmp_path / "t.json").unlink()
    with pytest.raises(D.DataError) as e:
        TF.read_token_file(path)
    assert str(e.value) == (f"{path}: no metadata file {tmp_path / 't.json'} beside it; create token files"
                            " with: python -m diffattn.data TEXT OUT.bin (it writes OUT.bin and OUT.json)")
    (tmp_path / "t.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(D.DataError, match="not valid JSON"):
        TF.read_token_file(path)


# --------------------------------------------------------------------------------------------- windows
def test_windows_values_and_splits():
    n, t = 1000, 16
    src = D.TokenWindows(np.arange(n), seq_len=t, vocab_size=n, val_fraction=0.1)
    assert src.split_size("train") == 900 and src.split_size("val") == 100
    g = torch.Generator().manual_seed(0)
    for split, lo, hi in (("train", 0, 900), ("val", 900, 1000)):
        for _ in range(20):
            x, y = src.get_batch(split, 8, g)
            assert x.dtype == torch.long and x.shape == (8, t) and y.shape == (8, t)
            # tokens are their own positions: each row is consecutive, targets are inputs shifted by one
            assert torch.equal(x - x[:, :1], torch.arange(t).expand(8, t))
            assert torch.equal(y, x + 1)
            assert x.min() >= lo and y.max() < hi  # windows never cross the split boundary


def test_windows_reach_both_ends_of_the_split():
    # train split = 20 tokens, seq_len 4 -> 16 possible starts (0..15); every one must be drawable
    src = D.TokenWindows(np.arange(25), seq_len=4, vocab_size=25, val_fraction=0.2)
    g = torch.Generator().manual_seed(1)
    starts = set(src.get_batch("train", 400, g)[0][:, 0].tolist())
    assert starts == set(range(16))


def test_windows_reproducible_batches_and_memmap(tmp_path):
    path = tmp_path / "t.bin"
    ids = np.random.default_rng(3).integers(0, 500, size=5000)
    TF.write_token_file(path, ids, 500)
    mm, _ = TF.read_token_file(path)
    a = D.TokenWindows(mm, seq_len=32, vocab_size=500)
    b = D.TokenWindows(torch.from_numpy(ids), seq_len=32, vocab_size=500)
    x1, y1 = a.get_batch("train", 4, torch.Generator().manual_seed(7))
    x2, y2 = b.get_batch("train", 4, torch.Generator().manual_seed(7))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = a.get_batch("train", 4, torch.Generator().manual_seed(8))
    assert not torch.equal(x1, x3)
    # resuming from a saved generator state continues the same stream
    g = torch.Generator().manual_seed(5)
    a.get_batch("train", 4, g)
    state = g.get_state()
    nxt = a.get_batch("train", 4, g)[0]
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(a.get_batch("train", 4, g2)[0], nxt)


def test_windows_errors():
    with pytest.raises(D.DataError, match="val split has 9 tokens .* at least seq_len \\+ 1 = 17"):
        D.TokenWindows(np.arange(90), seq_len=16, vocab_size=90, val_fraction=0.1)
    with pytest.raises(D.DataError, match="train split has 8 tokens"):
        D.TokenWindows(np.arange(10), seq_len=8, vocab_size=10, val_fraction=0.2)
    src = D.TokenWindows(np.arange(50), seq_len=8, vocab_size=50, val_fraction=0.0)
    with pytest.raises(D.DataError, match="no validation split"):
        src.get_batch("val", 2, torch.Generator())
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        src.get_batch("test", 2, torch.Generator())
    with pytest.raises(D.DataError, match="val_fraction must be in"):
        D.TokenWindows(np.arange(50), seq_len=8, vocab_size=50, val_fraction=1.0)


# --------------------------------------------------------------------------------------------- make_source
def test_make_source_text_char_and_bpe(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(UNICODE_TEXT * 4, encoding="utf-8")
    src, tok = D.make_source({"path": str(f)}, seq_len=8)
    assert isinstance(tok, T.CharTokenizer) and src.vocab_size == tok.vocab_size
    n = len(UNICODE_TEXT * 4)
    assert src.split_size("train") == int(n * 0.9) and src.split_size("val") == n - int(n * 0.9)
    x, y = src.get_batch("val", 3, torch.Generator().manual_seed(0))
    assert tok.decode(x[0].tolist()) in UNICODE_TEXT * 4

    src, bpe = D.make_source({"path": str(f), "tokenizer": "bpe", "vocab_size": 300, "val_fraction": 0.25},
                             seq_len=8)
    assert isinstance(bpe, T.BPETokenizer) and src.vocab_size == bpe.vocab_size <= 300
    assert src.split_size("val") == len(bpe.encode(UNICODE_TEXT * 4)) - src.split_size("train")

    # resume: the passed tokenizer is reused (same ids), not retrained
    restored = T.tokenizer_from_dict(bpe.to_dict())
    src2, tok2 = D.make_source({"path": str(f), "tokenizer": "bpe", "vocab_size": 300}, seq_len=8,
                               tokenizer=restored)
    assert tok2 is restored
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    src3, _ = D.make_source({"path": str(f), "tokenizer": "bpe", "vocab_size": 300}, seq_len=8, tokenizer=bpe)
    assert torch.equal(src2.get_batch("train", 2, g1)[0], src3.get_batch("train", 2, g2)[0])
    with pytest.raises(D.DataError, match="given \\(checkpoint\\) tokenizer is 'bpe'"):
        D.make_source({"path": str(f), "tokenizer": "char"}, seq_len=8, tokenizer=bpe)


def test_make_source_token_file(tmp_path):
    tok = T.build_tokenizer("char", UNICODE_TEXT)
    path = tmp_path / "d.bin"
    TF.write_token_file(path, tok.encode(UNICODE_TEXT), tok.vocab_size, tok)
    src, tok2 = D.make_source({"path": str(path), "val_fraction": 0.2}, seq_len=8)
    assert isinstance(src.tokens, np.memmap)
    assert tok2.to_dict() == tok.to_dict() and src.vocab_size == tok.vocab_size
    TF.write_token_file(path, [1, 2, 3, 4] * 50, 5)
    src, tok3 = D.make_source({"path": str(path)}, seq_len=8)
    assert tok3 is None and src.vocab_size == 5
    with pytest.raises(D.DataError, match="token file vocab_size 5 != tokenizer vocab_size"):
        D.make_source({"path": str(path)}, seq_len=8, tokenizer=tok)


def test_make_source_errors(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("abc" * 100, encoding="utf-8")
    with pytest.raises(D.DataError, match=r"unknown key\(s\) \['pth'\]"):
        D.make_source({"pth": str(f)}, seq_len=8)
    with pytest.raises(D.DataError, match="data.path is not set: give --data.path"):
        D.make_source({}, seq_len=8)
    with pytest.raises(D.DataError, match="either path .* or synthetic"):
        D.make_source({"path": str(f), "synthetic": "needle"}, seq_len=8)
    with pytest.raises(D.DataError, match="no such file"):
        D.make_source({"path": str(tmp_path / "missing")}, seq_len=8)
    with pytest.raises(D.DataError, match="params applies only to synthetic"):
        D.make_source({"path": str(f), "params": {"a": 1}}, seq_len=8)


def test_make_source_synthetic_passes_params(monkeypatch):
    calls = []

    def fake_make_task(name, seq_len, **params):
        calls.append((name, seq_len, params))
        return types.SimpleNamespace(vocab_size=11)

    monkeypatch.setattr(D, "make_synthetic", fake_make_task)  # lm imports make_synthetic at module level
    src, tok = D.make_source({"synthetic": "needle", "tokenizer": "char", "val_fraction": 0.1,
                              "params": {"n_needles": 2}, "depth": 0.5}, seq_len=64)
    assert tok is None and src.vocab_size == 11
    assert calls == [("needle", 64, {"n_needles": 2, "depth": 0.5})]
    with pytest.raises(D.DataError, match="vocab_size does not apply to a synthetic task"):
        D.make_source({"synthetic": "needle", "vocab_size": 100}, seq_len=64)


def test_make_source_real_task():
    tasks = pytest.importorskip("diffattn.data.synthetic")
    names = sorted(getattr(tasks, "SYNTHETIC", {}))
    if not names:
        pytest.skip("diffattn.data.synthetic has no SYNTHETIC registry")
    src, tok = D.make_source({"synthetic": names[0]}, seq_len=64)
    x, y = src.get_batch("train", 2, torch.Generator().manual_seed(0))
    assert tok is None and x.shape == y.shape and x.shape[0] == 2 and x.dtype == torch.long


def test_prepare_module_entry_point(tmp_path, capsys):
    src = tmp_path / "c.txt"
    src.write_text(UNICODE_TEXT, encoding="utf-8")
    assert D.main([str(src), str(tmp_path / "c.bin"), "--tokenizer", "bpe", "--vocab-size", "270"]) == 0
    assert "tokens (uint16, vocab" in capsys.readouterr().out
    mm, meta = TF.read_token_file(tmp_path / "c.bin")
    assert T.tokenizer_from_dict(meta["tokenizer"]).decode(mm.tolist()) == UNICODE_TEXT
    assert D.main([str(tmp_path / "missing.txt"), str(tmp_path / "d.bin")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_prepare_refuses_to_replace_a_token_file_without_overwrite(tmp_path, capsys):
    """A token file can take hours to make: `python -m diffattn.data` replaced OUT.bin / OUT.json without a word
    (issue 25, item 1)."""
    (tmp_path / "a.txt").write_text("first text", encoding="utf-8")
    (tmp_path / "b.txt").write_text("second, other text", encoding="utf-8")
    out = tmp_path / "c.bin"
    assert D.main([str(tmp_path / "a.txt"), str(out)]) == 0
    before = (out.read_bytes(), (tmp_path / "c.json").read_bytes())
    capsys.readouterr()
    assert D.main([str(tmp_path / "b.txt"), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {out} and {tmp_path / 'c.json'} already exist; nothing was changed. Add --overwrite "
                   "to replace, or choose another OUT."]
    assert (out.read_bytes(), (tmp_path / "c.json").read_bytes()) == before
    (tmp_path / "c.json").unlink()
    out.unlink()
    (tmp_path / "c.json").write_text("{}")  # an OUT.json alone is refused too
    assert D.main([str(tmp_path / "b.txt"), str(out)]) == 2
    assert "c.json already exists" in capsys.readouterr().err
    assert D.main([str(tmp_path / "b.txt"), str(out), "--overwrite"]) == 0
    mm, meta = TF.read_token_file(out)
    assert T.tokenizer_from_dict(meta["tokenizer"]).decode(mm.tolist()) == "second, other text"


def test_token_file_without_metadata_through_the_cli(tmp_path):
    """`diffattn train --data.path ls.bin` on a .bin with no metadata: one line naming the file and the fix."""
    from clirun import run_main

    (tmp_path / "ls.bin").write_bytes(np.arange(64, dtype="<u2").tobytes())
    res = run_main("train", "--config", "tiny", "--data.path", "ls.bin", "--out", "run", "--no-progress",
                       cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (  # the path is recorded absolute (resume from anywhere)
        f"error: {tmp_path / 'ls.bin'}: no metadata file {tmp_path / 'ls.json'} beside it; create token files with:"
        " python -m diffattn.data TEXT OUT.bin (it writes OUT.bin and OUT.json)")
    assert "write_token_file" not in res.stderr
