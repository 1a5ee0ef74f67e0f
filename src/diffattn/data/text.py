"""Text input, and the error every bad data input raises (:class:`DataError`).

Text input rule: a file is read as is; a folder contributes every regular file below it (recursively) whose
path has no hidden component (name starting with "."), in sorted order of the relative path. Every such file
must be UTF-8 text: a NUL byte or invalid UTF-8 is an error naming the file (and byte offset), never silently
skipped. Files are joined with a newline between them when one does not already end with one. A leading UTF-8
BOM is dropped. A record corpus (.jsonl/.json/.parquet, :mod:`diffattn.data.records`) is read record by record.

Text input is read whole, so before any of it is read (:func:`check_text_input`, which every reader of text
calls: language-model text, classification files, ``python -m diffattn.data``): every file must be a regular
file (a FIFO would block), its first bytes must hold no NUL (a binary file is refused without reading it all),
and the whole must fit in memory with its tokens (:data:`BYTES_PER_TEXT_BYTE` per byte, against what this
machine has available): a larger corpus belongs in record files, which are read streaming.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from diffattn.data.records import DEFAULT_TEXT_FIELD, iter_texts, record_files
from diffattn.model.footprint import available_memory, human_bytes
from diffattn.system.atomic_files import printable
from diffattn.system.untrusted import Refused, regular_file


class DataError(Refused):
    """Bad data input: missing/empty/binary/non-UTF-8 files, malformed token files, bad data config."""



# Memory a text read whole takes per byte of the file: the bytes, the decoded str, the token ids as a Python list
# (8-byte pointers) and as an int64 array: peak RSS grew 17.0 bytes per byte reading a 40 MB ASCII file with the char
# tokenizer (make_source); rounded up for non-ASCII text and BPE's training
BYTES_PER_TEXT_BYTE = 24
HEAD_BYTES = 1 << 16  # the first bytes of a text file, checked for a NUL before it is read whole


def _binary(path: Path, nul: int) -> DataError:
    return DataError(f"{printable(path)}: looks like a binary file (NUL byte at byte offset {nul}); text input "
                     "must be UTF-8 text (pre-tokenized data goes in a .bin token file)")


def check_text_input(files: Sequence[Path], what: str = "text input") -> int:
    """Check ``files`` before any is read whole (the module docstring's rule): each a regular file whose first
    :data:`HEAD_BYTES` hold no NUL, all of them together small enough to read with their tokens in the memory
    this machine has. -> their total size in bytes; DataError (one line) otherwise."""
    total = 0
    for f in files:
        try:
            regular_file(f)
            with open(f, "rb") as fh:
                nul = fh.read(HEAD_BYTES).find(b"\x00")
                total += os.fstat(fh.fileno()).st_size
        except OSError as e:
            raise DataError(f"{printable(f)}: cannot be read ({printable(e.strerror or e)})") from None
        except ValueError as e:  # UnreadableInput: a FIFO, a device
            raise DataError(str(e)) from None
        if nul >= 0:
            raise _binary(f, nul)
    have = available_memory()
    need = total * BYTES_PER_TEXT_BYTE
    if have is not None and need > have:
        where = printable(files[0]) + (f" and {len(files) - 1} more file(s)" if len(files) > 1 else "")
        raise DataError(f"{where}: {human_bytes(total)} of {what} is read whole, which takes about "
                        f"{human_bytes(need)} of memory with its tokens; this machine has {human_bytes(have)} "
                        "available. Give a corpus this large as records (.jsonl, one {\"text\": ...} per line), "
                        "which are read streaming")
    return total


def _decode_file(path: Path) -> str:
    raw = path.read_bytes()
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise _binary(path, nul)
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
    check_text_input(files)
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

