"""Text, record and token-file datasets, and the batch protocol the training loop reads (tokenizers:
:mod:`diffattn.model.tokenizer`).

The batch protocol (the training loop, the run driver, eval and the experiments read it):
  class BatchSource(Protocol):
      vocab_size: int
      def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]
  split is "train" or "val"; returns (inputs, targets), both LongTensor (B, T); targets == -100 are ignored.

  make_source(data_cfg: dict, seq_len: int, tokenizer=None, seed: int = 0) -> (BatchSource, Tokenizer | None)
      data_cfg: the [data] section of a run config, keys
        path          text file, folder of text files, token file "*.bin" (metadata in sibling "*.json"), or a
                      record corpus: a .jsonl/.json/.parquet file, a folder or a glob of them (diffattn.data.records)
        tokenizer     "char" (default), "bpe", or a path to a Hugging Face tokenizer.json (used as it is)
        vocab_size    BPE target vocabulary (default 2048); must be unset (None) for "char"
        text_field    the records' text field (default "text")
        bpe_sample_mb BPE trains on the first this many MB of a record corpus (default 64)
        cache_dir     where a record corpus is tokenized to (default: default_cache_dir())
        val_fraction  the last val_fraction of the tokens validate (default 0.1; 0 = no val split)
        synthetic     name -> diffattn.data.synthetic.make_synthetic(name, seq_len=seq_len, **params); params
                      from data_cfg["params"] plus any key not listed here. Exclusive with path.
        params        dict of task parameters (synthetic only)
      tokenizer: pass the checkpoint's tokenizer when resuming; it is reused instead of training a new one.
  TokenWindows (a BatchSource over a token array); token files: diffattn.data.token_files; read_text:
  diffattn.data.text.

Text input: :mod:`diffattn.data.text` (its rule, and :class:`DataError`); token files (read through numpy.memmap,
never loaded whole): :mod:`diffattn.data.token_files`. Large corpora belong in a token file, or in record files.

Record corpora (.jsonl/.json/.parquet) are read streaming and tokenized once into a token file in the cache folder,
named by the sha256 of the files, the text field and the tokenizer; a second run with the same data and tokenizer
memory-maps that file and says so instead of tokenizing again. Their tokenizer is fitted (char: every character;
bpe: the first bpe_sample_mb MB) and cached the same way. Each record's text ends with a newline (added if missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from diffattn.data.records import (
    DEFAULT_TEXT_FIELD,
    RECORD_FORMATS,
    RecordError,
    corpus_sha256,
    iter_texts,
    record_files,
    sample_text,
)
from diffattn.data.synthetic import make_synthetic
from diffattn.data.text import DataError, check_text_input, read_text, text_files
from diffattn.data.token_files import read_token_file, token_meta_path, write_token_file, write_token_stream
from diffattn.model.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, build_tokenizer, tokenizer_from_dict
from diffattn.system.atomic_files import atomic_write, printable, read_json, regular_file
from diffattn.system.io_errors import EX_IOERR, io_error_line


class BatchSource(Protocol):
    vocab_size: int

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]: ...



# --------------------------------------------------------------------------------------------- batches
class TokenWindows:
    """A BatchSource over one token stream: the first (1 - val_fraction) of the tokens train, the rest
    validate.

    A batch is ``batch_size`` windows of seq_len + 1 consecutive tokens, each starting at a position drawn
    uniformly with the caller's generator (so training is reproducible, and resumable from the generator
    state); inputs = window[:-1], targets = window[1:]. Windows never cross the train/val boundary.
    ``tokens`` may be a numpy array or memmap (only the drawn windows are read) or a 1-D tensor.
    """

    def __init__(self, tokens: np.ndarray | Tensor, seq_len: int, vocab_size: int, val_fraction: float = 0.1):
        if isinstance(tokens, Tensor):
            tokens = tokens.detach().cpu().numpy()
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise DataError(f"seq_len must be a positive int, got {seq_len!r}")
        if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        if tokens.ndim != 1:
            raise DataError(f"tokens must be 1-D, got shape {tokens.shape}")
        n = len(tokens)
        n_train = int(n * (1.0 - val_fraction))
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = int(vocab_size)
        self.val_fraction = float(val_fraction)
        self.splits: dict[str, tuple[int, int]] = {"train": (0, n_train)}
        if val_fraction > 0:
            self.splits["val"] = (n_train, n)
        for name, (a, b) in self.splits.items():
            if b - a < seq_len + 1:
                raise DataError(f"the {name} split has {b - a} tokens (of {n}, val_fraction={val_fraction});"
                                f" it needs at least seq_len + 1 = {seq_len + 1}. Use more data, a shorter"
                                " seq_len or another val_fraction")

    def split_size(self, split: str) -> int:
        a, b = self._range(split)
        return b - a

    def _range(self, split: str) -> tuple[int, int]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split not in self.splits:
            raise DataError("no validation split: val_fraction is 0")
        return self.splits[split]

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """-> (inputs, targets), LongTensor (B, T) each, T = seq_len; targets are inputs shifted by one."""
        a, b = self._range(split)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        t = self.seq_len
        g = generator
        starts = torch.randint(b - a - t, (batch_size,), generator=g, device=g.device).tolist()
        w = np.stack([np.asarray(self.tokens[a + s:a + s + t + 1], dtype=np.int64) for s in starts])
        w = torch.from_numpy(w)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# --------------------------------------------------------------------------------------------- record corpora
DEFAULT_BPE_SAMPLE_MB = 64  # BPE merges settle long before this; training on a whole large corpus only costs time


def default_cache_dir() -> Path:
    """Where tokenized record corpora are kept: $DIFFATTN_CACHE_DIR, else $XDG_CACHE_HOME/diffattn/tokens, else
    ~/.cache/diffattn/tokens (``--data.cache_dir`` overrides all three)."""
    if os.environ.get("DIFFATTN_CACHE_DIR"):
        return Path(os.environ["DIFFATTN_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffattn" / "tokens"


def _check_cache(cache: Path, given: str | None) -> None:
    """DataError when the token cache cannot be a folder (it, or a folder above it, is a file), naming the
    setting that chose it (``given``, $DIFFATTN_CACHE_DIR or $XDG_CACHE_HOME), before any corpus is read."""
    blocker = next((p for p in (cache, *cache.parents) if p.exists() or p.is_symlink()), None)
    if blocker is None or blocker.is_dir():
        return
    by = given or next((v for v in ("DIFFATTN_CACHE_DIR", "XDG_CACHE_HOME") if os.environ.get(v)), "HOME")
    raise DataError(f"the token cache {printable(cache)} cannot be a folder: {printable(blocker)} is a file. Set "
                    f"{by} to a folder" + ("" if given else " (or pass --data.cache_dir DIR)"))


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:32]


TOKENIZER_CHOICES = "'char', 'bpe', a Hugging Face tokenizer.json or a folder holding one"


def named_tokenizer(kind: str) -> Tokenizer | None:
    """The tokenizer ``data.tokenizer`` names when it is a Hugging Face ``tokenizer.json`` or a folder holding one
    (a transformers model folder; used as it is), else None ("char" and "bpe" are trained on the data). A path
    that holds no tokenizer.json is refused, naming what it is and what it lacks."""
    if kind in ("char", "bpe"):
        return None
    p = Path(kind)
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            held = sorted(printable(x.name) for x in p.iterdir())[:5]
            raise DataError(f"data.tokenizer {kind!r} is a folder without a tokenizer.json (it holds "
                            f"{', '.join(held) + (', ...' if len(held) == 5 else '') if held else 'nothing'}); "
                            f"give {TOKENIZER_CHOICES}")
        p = p / "tokenizer.json"
    elif p.is_file() and kind.endswith(".json"):
        pass
    elif p.exists():
        raise DataError(f"data.tokenizer {kind!r} is a file but not a tokenizer.json; give {TOKENIZER_CHOICES}")
    elif kind.endswith(".json") or os.sep in kind:
        raise DataError(f"data.tokenizer {kind!r}: no such file or folder; give {TOKENIZER_CHOICES}")
    else:
        raise DataError(f"unknown tokenizer {kind!r}; choose {TOKENIZER_CHOICES}")
    return HFTokenizer.from_file(p)


def corpus_tokenizer(files: Sequence[Path], corpus: str, kind: str, vocab_size: int | None, text_field: str,
                     sample_mb: float, cache: Path) -> Tokenizer:
    """A tokenizer fitted to a record corpus (``corpus``: its :func:`~diffattn.data.records.corpus_sha256`):
    "char" reads every record once (streaming) for its characters; "bpe" trains on the first ``sample_mb`` MB.
    Kept in ``cache``, keyed by the corpus and the recipe, so a second run does not fit it again."""
    if kind not in ("char", "bpe"):
        raise DataError(f"unknown tokenizer {kind!r}; choose {TOKENIZER_CHOICES}")
    if kind == "char" and vocab_size is not None:
        build_tokenizer("char", "a", vocab_size)  # raises its message: vocab_size does not apply to char
    f = cache / f"tokenizer-{_key(corpus, kind, str(vocab_size), str(sample_mb))}.json"
    if f.is_file():
        try:
            return tokenizer_from_dict(read_json(f))
        except (ValueError, TypeError, KeyError, AttributeError):  # a damaged cache entry is fitted again
            pass
    if kind == "char":
        chars: set[str] = set()
        for t in iter_texts(files, text_field):
            chars.update(t)
        if not chars:
            raise DataError(f"{files[0]}: no text in field {text_field!r}; nothing to train on")
        tok: Tokenizer = CharTokenizer(sorted(chars))
    else:
        sample = sample_text(files, text_field, int(sample_mb * 2**20))
        if not sample:
            raise DataError(f"{files[0]}: no text in field {text_field!r}; nothing to train on")
        tok = build_tokenizer("bpe", sample, vocab_size)
    cache.mkdir(parents=True, exist_ok=True)
    atomic_write(f, json.dumps(tok.to_dict()))
    return tok


def cached_token_file(files: Sequence[Path], corpus: str, text_field: str, tokenizer: Tokenizer, cache: Path,
                      name: str = "") -> Path:
    """The token file of a record corpus under ``tokenizer``: reused from ``cache`` when the same corpus
    (``corpus``, its sha256) was tokenized with the same tokenizer before (saying so on stderr), else tokenized
    there now, streaming."""
    out = cache / f"tokens-{_key(corpus, json.dumps(tokenizer.to_dict(), sort_keys=True))}.bin"
    if token_meta_path(out).is_file():
        try:
            n = read_token_file(out, check_ids=False)[1]["num_tokens"]
        except DataError:
            pass  # incomplete or damaged: tokenized again below
        else:
            print(f"data: {name or files[0]}: using the cached tokens {out} ({n:,} tokens); not tokenizing again",
                  file=sys.stderr)
            return out
    print(f"data: {name or files[0]}: tokenizing {len(files)} file(s) into {out}", file=sys.stderr)
    meta = write_token_stream(out, iter_texts(files, text_field), tokenizer, extra={
        "corpus": {"sha256": corpus, "text_field": text_field, "files": [str(f.resolve()) for f in files]}})
    n = json.loads(meta.read_text(encoding="utf-8"))["num_tokens"]
    print(f"data: {name or files[0]}: {n:,} tokens cached in {out}", file=sys.stderr)
    return out


def _record_source(files: list[Path], data_cfg: dict[str, Any], seq_len: int, tokenizer: Tokenizer | None,
                   val_fraction: float) -> tuple[BatchSource, Tokenizer]:
    """make_source for a record corpus: fit (or reuse) the tokenizer, tokenize once into the cache, memory-map."""
    kind = data_cfg.get("tokenizer") or "char"
    text_field = data_cfg.get("text_field") or DEFAULT_TEXT_FIELD
    sample_mb = data_cfg.get("bpe_sample_mb")
    sample_mb = DEFAULT_BPE_SAMPLE_MB if sample_mb is None else sample_mb
    if isinstance(sample_mb, bool) or not isinstance(sample_mb, (int, float)) or sample_mb <= 0:
        raise DataError(f"data.bpe_sample_mb must be a positive number of megabytes, got {sample_mb!r}")
    cache = Path(data_cfg["cache_dir"]).expanduser() if data_cfg.get("cache_dir") else default_cache_dir()
    _check_cache(cache, "--data.cache_dir" if data_cfg.get("cache_dir") else None)
    corpus = corpus_sha256(files, text_field)
    if tokenizer is None:
        tokenizer = named_tokenizer(kind) or corpus_tokenizer(
            files, corpus, kind, data_cfg.get("vocab_size"), text_field, sample_mb, cache)
    bin_path = cached_token_file(files, corpus, text_field, tokenizer, cache, name=str(data_cfg["path"]))
    tokens, meta = read_token_file(bin_path)
    return TokenWindows(tokens, seq_len, meta["vocab_size"], val_fraction), tokenizer


def check_input(data_cfg: dict[str, Any], task: str = "lm") -> None:
    """The checks the data readers make of ``data_cfg``'s files before they read any, made alone, in
    milliseconds (before a run hashes its data, say): a record file must be a regular file, text input (a
    classifier's file too, ``task`` "classify") must be regular files without a NUL in their first bytes that fit
    in memory (:func:`diffattn.data.text.check_text_input`). Nothing for a synthetic task, a token file
    (memory-mapped) or a path that does not exist (the reader says so). DataError (one line) otherwise."""
    path = data_cfg.get("path") if isinstance(data_cfg, dict) else None
    if not path or data_cfg.get("synthetic") or Path(path).suffix == ".bin" or not (
            Path(path).exists() or any(c in str(path) for c in "*?[")):
        return
    if task == "classify":  # a .csv is read whole; records (.jsonl, .parquet) stream
        p = regular_file(path, "data")
        if p.suffix.lower() not in RECORD_FORMATS and not p.is_dir():
            check_text_input([p], "a classification file")
        return
    try:
        records = record_files(path)
    except RecordError as e:
        raise DataError(str(e)) from None
    if records is None:
        check_text_input(text_files(path))


# --------------------------------------------------------------------------------------------- run config
# "fingerprint" is recorded by `diffattn train` (the data's sizes and sha256, see rundir.py); nothing here reads it.
DATA_KEYS = ("path", "tokenizer", "vocab_size", "val_fraction", "synthetic", "params", "fingerprint", "text_field",
             "bpe_sample_mb", "cache_dir")


def make_source(data_cfg: dict[str, Any], seq_len: int, tokenizer: Tokenizer | None = None,
                seed: int = 0) -> tuple[BatchSource, Tokenizer | None]:
    """Build the LM batch source of a run config's [data] section (keys in the module docstring).

    Returns (source, tokenizer): the tokenizer trained on (or passed in for) a text corpus, the one stored in
    a token file's metadata (or passed in), or None for synthetic tasks and token files without one.
    ``seed`` is accepted for the contract; text/token sources draw all randomness from get_batch's generator.
    """
    if not isinstance(data_cfg, dict):
        raise DataError(f"data config must be a dict, got {type(data_cfg).__name__}")
    synthetic = data_cfg.get("synthetic")
    path = data_cfg.get("path")
    if synthetic:
        if path:
            raise DataError(f"data: give either path ({path!r}) or synthetic ({synthetic!r}), not both")
        if data_cfg.get("vocab_size") is not None:
            raise DataError("data.vocab_size does not apply to a synthetic task; set task parameters under "
                            "data.params")
        params = data_cfg.get("params") or {}
        if not isinstance(params, dict):
            raise DataError(f"data.params must be a table/dict, got {type(params).__name__}")
        extra = {k: v for k, v in data_cfg.items() if k not in DATA_KEYS}
        return make_synthetic(str(synthetic), seq_len=seq_len, **{**params, **extra}), None

    unknown = sorted(set(data_cfg) - set(DATA_KEYS))
    if unknown:
        raise DataError(f"data: unknown key(s) {unknown}; known: {list(DATA_KEYS)}")
    if data_cfg.get("params"):
        raise DataError("data.params applies only to synthetic tasks (data.synthetic)")
    if not path:
        raise DataError("data.path is not set: give --data.path FILE (a text file, a folder of them, records or a "
                        ".bin token file; `path = ...` under [data] in a TOML), or data.synthetic (a task name)")
    kind = data_cfg.get("tokenizer") or "char"
    vocab_size = data_cfg.get("vocab_size")
    val_fraction = data_cfg.get("val_fraction")
    val_fraction = 0.1 if val_fraction is None else val_fraction

    p = Path(path)
    if p.suffix == ".bin":
        tokens, meta = read_token_file(p)
        stored = tokenizer_from_dict(meta["tokenizer"]) if meta.get("tokenizer") else None
        tok = tokenizer if tokenizer is not None else stored
        if tok is not None and tok.vocab_size != meta["vocab_size"]:
            raise DataError(f"{p}: token file vocab_size {meta['vocab_size']} != tokenizer vocab_size "
                            f"{tok.vocab_size}")
        return TokenWindows(tokens, seq_len, meta["vocab_size"], val_fraction), tok

    # a given (checkpoint's) tokenizer is used as it is; data.tokenizer then only has to be of its kind
    named = named_tokenizer(kind) if tokenizer is None else None
    if tokenizer is not None and tokenizer.kind != (kind if kind in ("char", "bpe") else "hf"):
        raise DataError(f"data.tokenizer is {kind!r} but the given (checkpoint) tokenizer is"
                        f" {tokenizer.kind!r}")
    records = record_files(p)
    if records is not None:
        return _record_source(records, data_cfg, seq_len, tokenizer, val_fraction)
    text = read_text(p)
    if tokenizer is None:
        tokenizer = named or build_tokenizer(kind, text, vocab_size)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return TokenWindows(ids, seq_len, tokenizer.vocab_size, val_fraction), tokenizer


def main(argv: list[str] | None = None) -> int:
    """``python -m diffattn.data TEXT OUT.bin [--tokenizer bpe --vocab-size N]``: pre-tokenize a corpus."""
    import argparse  # only the `python -m diffattn.data` entry parses arguments; the library does not

    ap = argparse.ArgumentParser(prog="python -m diffattn.data", description=main.__doc__)
    ap.add_argument("text", help="text file or folder")
    ap.add_argument("out", help="output token file (.bin; metadata goes in the sibling .json)")
    ap.add_argument("--tokenizer", choices=("char", "bpe"), default="char")
    ap.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing OUT.bin / OUT.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    there = [str(p) for p in (out, token_meta_path(out)) if out.suffix == ".bin" and p.exists()]
    if there and not args.overwrite:  # a token file can take hours to make: never replaced without being asked
        print(f"error: {' and '.join(there)} already exist{'s' if len(there) == 1 else ''}; nothing was changed. "
              "Add --overwrite to replace, or choose another OUT.", file=sys.stderr)
        return 2
    try:
        text = read_text(args.text)
        tok = build_tokenizer(args.tokenizer, text, args.vocab_size)
        ids = np.asarray(tok.encode(text), dtype=np.int64)
        meta_path = write_token_file(args.out, ids, tok.vocab_size, tok)
    except ValueError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only one: nothing half-written is left (_write_token_pair)
        print(io_error_line(e, kept=f"nothing (no partial {args.out} or .json is left)",
                            then="run the same command again"), file=sys.stderr)
        return EX_IOERR
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    print(f"wrote {meta['num_tokens']} tokens ({meta['dtype']}, vocab {meta['vocab_size']}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
