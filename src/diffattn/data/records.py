"""Record corpora as users keep them: ``.jsonl`` / ``.json`` / ``.parquet`` files, folders or globs of them.

Read through the ``datasets`` library (``load_dataset("json" | "parquet", data_files=..., streaming=True)``), one
file at a time so that errors name the file, and strictly locally: ``HF_DATASETS_OFFLINE=1`` is set before
``datasets`` is first imported, and only local paths are ever passed to it. Streaming means nothing is loaded
whole and nothing is copied into the ``datasets`` cache.

A path is a record corpus when it is a record file, a folder whose non-hidden files (recursively, sorted by
relative path) are all record files, or a glob (``*``, ``?``, ``[``) matching only record files. Every file of
one corpus has the same format (JSON or Parquet). Any other path is text input (:func:`diffattn.data.lm.read_text`).
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from diffattn.system.untrusted import Refused, regular_file

RECORD_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
DEFAULT_TEXT_FIELD = "text"
BATCH_ROWS = 1024  # rows per streamed batch: bounds memory while keeping the tokenizer's batch encoding busy


class RecordError(Refused):
    """A record corpus that cannot be read: mixed formats, a missing field, a value that is not text."""


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _visible_files(folder: Path) -> list[Path]:
    files = [f for f in folder.rglob("*")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)]
    return sorted(files, key=lambda f: f.relative_to(folder).as_posix())


def record_files(path: str | os.PathLike) -> list[Path] | None:
    """The record files ``path`` names (a record file, a folder of them or a glob), in reading order; None when
    ``path`` is text input. A folder or glob mixing record files with others, or JSON with Parquet, is an
    error."""
    s = os.fspath(path)
    if _is_glob(s) and not Path(s).exists():
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(s), recursive=True) if Path(f).is_file())
        if not files:
            raise RecordError(f"{s}: the pattern matches no files")
    elif Path(s).is_dir():
        files = _visible_files(Path(s))
        if not any(f.suffix.lower() in RECORD_FORMATS for f in files):
            return None
    else:  # a FIFO named x.jsonl would block the reader for ever: refused
        return [regular_file(s, "data")] if Path(s).suffix.lower() in RECORD_FORMATS else None
    other = [f for f in files if f.suffix.lower() not in RECORD_FORMATS]
    if other:
        raise RecordError(f"{s}: mixes record files ({', '.join(RECORD_FORMATS)}) with other files ({other[0]}"
                          f"{f' and {len(other) - 1} more' if len(other) > 1 else ''}); keep one kind per folder")
    formats = {RECORD_FORMATS[f.suffix.lower()] for f in files}
    if len(formats) > 1:
        raise RecordError(f"{s}: mixes JSON and Parquet files; keep one format per corpus")
    return files


def _load(file: Path) -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: datasets must never reach the Hub
    import datasets  # slow to import (~3 s): only record corpora need it

    if not file.is_file():
        raise RecordError(f"{file}: no such file")
    try:
        return datasets.load_dataset(RECORD_FORMATS[file.suffix.lower()], data_files=[str(file.resolve())],
                                     split="train", streaming=True)
    except Exception as e:  # datasets raises many types for an unreadable file
        raise RecordError(f"{file}: cannot be read as {file.suffix} records: {e}") from None


def iter_rows(files: Sequence[Path], fields: Sequence[str]) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, 1-based row number, {field: value}) for every row, streaming; a row without one of ``fields`` is an
    error naming the file, the row and the fields it has."""
    for file in files:
        n = 0
        try:
            for batch in _load(file).iter(batch_size=BATCH_ROWS):
                missing = [f for f in fields if f not in batch]
                if missing:
                    raise RecordError(f"{file}: row {n + 1} has no field {missing[0]!r} (fields: "
                                      f"{', '.join(map(str, batch)) or 'none'}); set --data.text_field")
                for i in range(len(batch[fields[0]])):
                    n += 1
                    yield file, n, {f: batch[f][i] for f in fields}
        except RecordError:
            raise
        except Exception as e:  # a malformed line surfaces while streaming, as datasets' own exception types
            raise RecordError(f"{file}: cannot be read as {file.suffix} records (after row {n}): {e}") from None


def iter_texts(files: Sequence[Path], text_field: str = DEFAULT_TEXT_FIELD) -> Iterator[str]:
    """Each record's text, each ending in a newline (added when missing), streaming. Null texts are skipped; any
    other non-string value is an error naming the file and row."""
    for file, n, row in iter_rows(files, [text_field]):
        t = row[text_field]
        if t is None:
            continue
        if not isinstance(t, str):
            raise RecordError(f"{file}: row {n}: field {text_field!r} is {type(t).__name__}, not text")
        yield t if t.endswith("\n") else t + "\n"


def sample_text(files: Sequence[Path], text_field: str, max_bytes: int) -> str:
    """The first records of the corpus, about ``max_bytes`` of UTF-8 (whole records; at least one)."""
    parts, size = [], 0
    for t in iter_texts(files, text_field):
        parts.append(t)
        size += len(t.encode("utf-8"))
        if size >= max_bytes:
            break
    return "".join(parts)


def corpus_sha256(files: Sequence[Path], text_field: str) -> str:
    """sha256 of the corpus as read: each file's content (in reading order) and the text field."""
    h = hashlib.sha256(f"diffattn-records-v1\0{text_field}\0".encode())
    for file in files:
        f = hashlib.sha256()
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                f.update(chunk)
        h.update(f.digest())
    return h.hexdigest()
