"""The atomic-folder protocol a checkpoint is written and read by.

A folder is written into a temp folder next to its target (:func:`temp_folder`), then renamed into place
(:func:`publish_folder`): an existing folder is renamed aside first and removed (or kept elsewhere) only after
the new one is in place, so a crash leaves either the old or the new folder, and a folder moved aside by a save
that died between its two renames is found again (:func:`leftover_old`). A reader that may race a writer reads
until the folder did not change while it read (:func:`read_settled`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from diffattn.checkpoint.verify import MANIFEST, CheckpointError
from diffattn.system.atomic_files import fsync_dir

T = TypeVar("T")

READ_TRIES = 5  # a folder replaced while it is read is read again, up to this many times


@contextmanager
def temp_folder(path: Path) -> Iterator[Path]:
    """A new temp folder next to ``path`` (same file system, so it can be renamed into place), removed if the
    block fails; the block publishes it (:func:`publish_folder`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))  # pid: clean_leftovers
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_folder(tmp: Path, path: Path, keep_as: Path | None = None) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first and, after the swap, renamed to
    ``keep_as`` or removed. If the second rename fails, the old folder is moved back."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    fsync_dir(path.parent)
    if old is not None and keep_as is not None:
        if keep_as.exists():
            shutil.rmtree(keep_as)
        os.replace(old, keep_as)
        fsync_dir(path.parent)
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


def leftover_old(path: Path) -> Path | None:
    """A checkpoint moved aside by a save that died between its two renames (the new one never landed)."""
    cands = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in cands if (c / MANIFEST).is_file()), None)


def folder_generation(path: Path) -> tuple[int, int] | None:
    """Which folder is at ``path`` now: every save renames a new folder into place, with a new inode and change
    time (None while a save has moved the old one aside)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def read_settled(path: Path, read_once: Callable[[], T]) -> T:
    """``read_once()``, again while the folder at ``path`` changed during the read (:data:`READ_TRIES` times), so
    a reader never mixes the files of two checkpoints nor reports a half-replaced one as corrupt. A
    CheckpointError from a read during which nothing changed is raised as it is."""
    for attempt in range(READ_TRIES):
        before = folder_generation(path)
        try:
            result = read_once()
        except CheckpointError:
            if attempt == READ_TRIES - 1 or folder_generation(path) == before:
                raise
        else:
            if folder_generation(path) == before:
                return result
        time.sleep(0.05 * (attempt + 1))  # a save is renaming its folders: they settle within milliseconds
    raise CheckpointError(f"{path} was replaced {READ_TRIES} times while being read (a run saving very often); "
                          "try again")
