"""Token files (nanoGPT style): a flat little-endian array of uint16 (vocab_size <= 65536) or uint32 at "X.bin",
metadata at "X.json": {"format": "diffattn-tokens", "version": 1, "dtype", "vocab_size", "num_tokens",
"tokenizer": dict or null}. Read through numpy.memmap, never loaded whole; written atomically, the pair together.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from diffattn.data.text import DataError
from diffattn.model.tokenizer import Tokenizer
from diffattn.system.atomic_files import atomic_output

TOKEN_FORMAT = "diffattn-tokens"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_meta_path(path: str | os.PathLike) -> Path:
    """The metadata file of a token file: "X.bin" -> "X.json"."""
    return Path(path).with_suffix(".json")


def _dtype_for(vocab_size: int) -> str:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise DataError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise DataError(f"vocab_size {vocab_size} is too large for a token file (uint32 holds at most 2**32 ids)")


def _write_token_pair(path: Path, write_tokens: Callable[[Any], int], meta: Callable[[int], dict[str, Any]]
                      ) -> Path:
    """The token file and its metadata, both or neither: the tokens (``write_tokens(file) -> count``) and then the
    metadata (``meta(count)``) are written to temp files, and only then renamed into place, the .bin first. A
    failure (a full disk, no tokens) leaves no .bin without its .json. Returns the metadata path."""
    meta_path = token_meta_path(path)
    renamed = False
    try:
        with atomic_output(meta_path) as tmp_meta:
            with atomic_output(path) as tmp_bin:
                with open(tmp_bin, "wb") as f:
                    n = write_tokens(f)
                with open(tmp_meta, "wb") as f:
                    f.write(json.dumps(meta(n), ensure_ascii=False).encode("utf-8"))
            renamed = True
    except BaseException:
        if renamed:  # the .json could not follow it into place
            path.unlink(missing_ok=True)
        raise
    return meta_path


def write_token_file(path: str | os.PathLike, tokens: Sequence[int] | np.ndarray | Tensor, vocab_size: int,
                     tokenizer: Tokenizer | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write a 1-D sequence of token ids to ``path`` (.bin) and its metadata to the sibling .json, atomically.

    uint16 when vocab_size <= 65536, else uint32; errors if an id is negative or >= vocab_size.
    Returns the metadata path.
    """
    path = Path(path)
    if path.suffix != ".bin":
        raise DataError(f"{path}: a token file must end in .bin (its metadata goes in the sibling .json)")
    dtype = _dtype_for(vocab_size)
    if isinstance(tokens, Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise DataError("tokens are empty; nothing to write")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"tokens must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise DataError(f"token id {bad} is out of range for vocab_size {vocab_size}")
    if tokenizer is not None and tokenizer.vocab_size != vocab_size:
        raise DataError(f"tokenizer vocab_size {tokenizer.vocab_size} != vocab_size {vocab_size}")
    data = arr.astype(_DTYPES[dtype], copy=False)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> int:
        f.write(data.tobytes())
        return int(arr.size)

    return _write_token_pair(path, write, lambda n: _token_meta(dtype, vocab_size, n, tokenizer, extra))


def _token_meta(dtype: str, vocab_size: int, n: int, tokenizer: Tokenizer | None,
                extra: dict[str, Any] | None) -> dict[str, Any]:
    """The metadata, renamed into place last: a token file without it is incomplete (see :func:`cached_token_file`)."""
    return {**(extra or {}), "format": TOKEN_FORMAT, "version": 1, "dtype": dtype, "vocab_size": int(vocab_size),
            "num_tokens": n, "tokenizer": tokenizer.to_dict() if tokenizer is not None else None}


def write_token_stream(path: str | os.PathLike, texts: Iterable[str], tokenizer: Tokenizer,
                       extra: dict[str, Any] | None = None, batch: int = 1024) -> Path:
    """Tokenize ``texts`` ``batch`` at a time straight into the token file ``path`` (memory stays bounded by one
    batch), then write its metadata. Returns the metadata path."""
    path = Path(path)
    dtype = _dtype_for(tokenizer.vocab_size)

    def write(f) -> int:
        n = 0
        pending: list[str] = []
        for t in _with_end(texts):
            if t is not None:
                pending.append(t)
            if pending and (t is None or len(pending) >= batch):
                for ids in tokenizer.encode_batch(pending):
                    f.write(np.asarray(ids, dtype=_DTYPES[dtype]).tobytes())
                    n += len(ids)
                pending = []
        if n == 0:
            raise DataError(f"{path}: no tokens; the input has no text")
        return n

    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_token_pair(path, write, lambda n: _token_meta(dtype, tokenizer.vocab_size, n, tokenizer, extra))


def _with_end(items: Iterable[str]) -> Iterator[str | None]:
    yield from items
    yield None


def read_token_file(path: str | os.PathLike, check_ids: bool = True) -> tuple[np.memmap, dict[str, Any]]:
    """Open a token file read-only as a numpy memmap (nothing is loaded up front) and return (tokens, meta).

    Validates the metadata and that the .bin size matches num_tokens · itemsize (truncation is an error).
    ``check_ids`` scans the file in chunks for ids >= vocab_size (bounded memory).
    """
    path = Path(path)
    meta_path = token_meta_path(path)
    make = "create token files with: python -m diffattn.data TEXT OUT.bin (it writes OUT.bin and OUT.json)"
    for f, missing in ((path, "token file not found"), (meta_path, f"no metadata file {meta_path} beside it")):
        if not f.is_file():
            raise DataError(f"{path}: {missing}; {make}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path}: not valid JSON metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKEN_FORMAT:
        raise DataError(f"{meta_path}: not diffattn token-file metadata (expected format {TOKEN_FORMAT!r})")
    for key in ("dtype", "vocab_size", "num_tokens"):
        if key not in meta:
            raise DataError(f"{meta_path}: metadata lacks {key!r}")
    if meta["dtype"] not in _DTYPES:
        raise DataError(f"{meta_path}: dtype must be one of {sorted(_DTYPES)}, got {meta['dtype']!r}")
    n, vocab = meta["num_tokens"], meta["vocab_size"]
    if not isinstance(n, int) or n < 1:
        raise DataError(f"{meta_path}: num_tokens must be a positive int, got {n!r}")
    if not isinstance(vocab, int) or vocab < 1 or vocab > np.iinfo(_DTYPES[meta["dtype"]]).max + 1:
        raise DataError(f"{meta_path}: vocab_size {vocab!r} is not a positive int that {meta['dtype']}"
                        " can hold")
    dtype = _DTYPES[meta["dtype"]]
    expected, actual = n * dtype.itemsize, path.stat().st_size
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its metadata says"
        raise DataError(f"{path}: {what}: {actual} bytes, expected {expected}"
                        f" ({n} tokens of {meta['dtype']})")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    if check_ids:
        chunk = 1 << 24
        for start in range(0, n, chunk):
            hi = int(tokens[start:start + chunk].max())
            if hi >= vocab:
                raise DataError(f"{path}: token id {hi} (in tokens {start}..{min(n, start + chunk) - 1}) is"
                                f" out of range for vocab_size {vocab}")
    return tokens, meta


