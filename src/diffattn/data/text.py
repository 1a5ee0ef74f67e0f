"""Text input, and the error every bad data input raises (:class:`DataError`).

Text input rule: a file is read as is; a folder contributes every regular file below it (recursively) whose
path has no hidden component (name starting with "."), in sorted order of the relative path. Every such file
must be UTF-8 text: a NUL byte or invalid UTF-8 is an error naming the file (and byte offset), never silently
skipped. Files are joined with a newline between them when one does not already end with one. A leading UTF-8
BOM is dropped. A record corpus (.jsonl/.json/.parquet, :mod:`diffattn.data.records`) is read record by record.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffattn.data.records import DEFAULT_TEXT_FIELD, iter_texts, record_files


class DataError(ValueError):
    """Bad data input: missing/empty/binary/non-UTF-8 files, malformed token files, bad data config."""



def _decode_file(path: Path) -> str:
    raw = path.read_bytes()
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{path}: looks like a binary file (NUL byte at byte offset {nul}); text input must"
                        " be UTF-8 text (pre-tokenized data goes in a .bin token file)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {e.start} ({e.reason}); re-encode the file"
                        " as UTF-8") from None
    return text.removeprefix("\ufeff")


def text_files(path: str | os.PathLike) -> list[Path]:
    """The files ``read_text`` reads for ``path`` (a file; or a folder's non-hidden files, sorted)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise DataError(f"{p}: not a regular file or folder")
    files = [f for f in p.rglob("*")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]
    files.sort(key=lambda f: f.relative_to(p).as_posix())
    if not files:
        raise DataError(f"{p}: folder contains no (non-hidden) files")
    return files


def read_text(path: str | os.PathLike, text_field: str = DEFAULT_TEXT_FIELD) -> str:
    """Read a UTF-8 text file, or every file of a folder (see the module docstring for the rule); for a record
    corpus (:mod:`diffattn.data.records`), every record's ``text_field``, one after the other (in memory: large
    corpora go through :func:`make_source`, which streams)."""
    records = record_files(path)
    if records is not None:
        text = "".join(iter_texts(records, text_field))
        if not text:
            raise DataError(f"{path}: no text in field {text_field!r}; nothing to train on")
        return text
    files = text_files(path)
    parts = []
    for f in files:
        t = _decode_file(f)
        if t and not t.endswith("\n") and len(files) > 1:
            t += "\n"
        parts.append(t)
    text = "".join(parts)
    if not text:
        what = "file" if Path(path).is_file() else "folder (all files are empty)"
        raise DataError(f"{path}: empty {what}; nothing to train on")
    return text

