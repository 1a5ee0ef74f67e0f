"""The study's Optuna journal (``OUT/optuna.journal``, a ``JournalFileBackend``) survives a torn write.

Optuna appends each batch of operations as JSON lines. A write cut short (a full disk, a killed process, a
crash) leaves a torn last record; Optuna then appends the next record onto it, and from then on every read of
the journal fails ("Expecting ',' delimiter"), so the experiment could never be resumed. :func:`repair_journal`
runs before the study is opened: under the journal's own lock (Optuna's ``JournalFileSymlinkLock``, which
every writer takes), a torn end (bytes after the last newline, or last lines that are not whole JSON records)
is moved to a side file ``optuna.journal.torn-<time>-<pid>`` and the journal cut back to its last whole record,
so the study resumes from there: an operation that was never completely written never happened. A bad record
with whole records after it is damage in the middle, which dropping an end cannot mend: refused, naming the
file and line (the cells themselves are safe in ``cells/``, so setting the journal aside loses nothing).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from diffattn.experiments.study.spec import StudyError
from diffattn.fileio import atomic_write, open_nofollow, refuse_links


def _whole(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not UTF-8, or not JSON
        return False


def first_bad_record(data: bytes) -> tuple[int, int, bool] | None:
    """(byte offset, 1-based line, whether a whole record follows) of the first record of ``data`` that is not
    a whole JSON object ending in a newline; None if every record is whole."""
    offset = 0
    bad: tuple[int, int] | None = None
    for n, line in enumerate(data.splitlines(keepends=True), start=1):
        ok = line.endswith(b"\n") and _whole(line)
        if bad is None and not ok:
            bad = (offset, n)
        elif bad is not None and ok:
            return bad[0], bad[1], True
        offset += len(line)
    return (bad[0], bad[1], False) if bad is not None else None


def repair_journal(path: str | os.PathLike) -> str | None:
    """Set aside a torn end of the journal at ``path`` (see the module docstring); -> a note saying what was set
    aside, or None when the journal is whole (or absent). Raises StudyError for damage in the middle."""
    path = Path(path)
    refuse_links(path.parent, [path.name])  # Optuna appends to it by name
    if not path.is_file() or first_bad_record(path.read_bytes()) is None:
        return None
    from optuna.storages.journal import JournalFileSymlinkLock  # heavy: loaded on use (module docstring)
    from optuna.storages.journal._file import get_lock_file  # (optuna, as above)

    with get_lock_file(JournalFileSymlinkLock(str(path))):  # the lock every Optuna writer of this file takes
        data = path.read_bytes()
        found = first_bad_record(data)
        if found is None:  # another process repaired it meanwhile
            return None
        offset, line, more = found
        if more:
            raise StudyError(
                f"{path} is damaged at line {line} (byte {offset}) with whole records after it, so it cannot be "
                f"repaired by setting a torn end aside; move it away (mv {path} {path}.bad) and run the command "
                "again: finished cells are reused from their result.json, the others resume from their "
                "checkpoints")
        side = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        atomic_write(side, data[offset:])
        with open_nofollow(path, "r+b") as f:
            f.truncate(offset)
            f.flush()
            os.fsync(f.fileno())
    return (f"{path}: its last record was torn (a write cut short: a full disk, a killed process); set aside "
            f"{len(data) - offset} bytes in {side.name} and resumed from the {line - 1} whole records before it")
