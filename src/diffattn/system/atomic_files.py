"""Files that survive faults: atomic writes and the temp files a killed writer left.

* :func:`atomic_output` / :func:`atomic_write`: every output file diffattn writes is written to a temp file beside
  it (``.NAME.tmp-PID-XXXX``), fsynced and renamed into place, so a reader sees the old file or the new one,
  and a writer that fails (a full disk, Ctrl-C, an exception) leaves nothing: its temp file is removed.
  :func:`remove_stale_temps` removes the temp files of a process that was killed (kill -9) before it could.
* Folders and files from elsewhere are :mod:`diffattn.system.untrusted`'s (opens that follow no link, names confined,
  control characters escaped, reads bounded); its names are re-exported here, so every layer imports them from
  one place as before.
* Beside it in the bottom layer: the run-folder lock (:mod:`diffattn.system.run_lock`) and I/O errors as one line
  (:mod:`diffattn.system.io_errors`).

The bottom layer: imports nothing from diffattn but :mod:`diffattn.system.untrusted`, so every layer (the token-file
writer in ``data`` too) uses it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from diffattn.system.untrusted import (  # noqa: F401 (re-exported: every layer imports these from here)
    MissingExtra,
    Refused,
    UnreadableInput,
    UnsafePath,
    confined,
    nofollow_fd,
    open_nofollow,
    printable,
    printable_text,
    read_json,
    refuse_links,
    regular_file,
)

TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\w+$")  # atomic_output's and save_checkpoint's temps


def as_umask_allows(path: str | os.PathLike) -> None:
    """Give a file or folder made by ``mkstemp`` / ``mkdtemp`` (0600 / 0700 whatever the umask), and what a folder
    holds, the mode ``open`` / ``mkdir`` would have given it (0666 / 0777 less the umask) before it is renamed
    into place."""
    mask = os.umask(0o022)  # read it (there is no other portable way), then put it back at once
    os.umask(mask)
    path = Path(path)
    for p in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


# ---------------------------------------------------------------------------------------------- atomic writes


def temp_name(name: str, pid: int | None = None) -> str:
    """The name of a temp file (or folder) for ``name``: ``.NAME.tmp-PID-XXXX``, hidden, with the writer's pid so
    that :func:`remove_stale_temps` can tell a dead writer's leftover from a live one's work."""
    return f".{name}.tmp-{os.getpid() if pid is None else pid}-{secrets.token_hex(3)}"


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's bytes to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to the disk, where the platform and file system can."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # some filesystems cannot sync a folder
            raise
    finally:
        os.close(fd)


@contextmanager
def names_path(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised in the block that names no file (``write`` on a full disk says only "No space left on
    device") is given ``path``, so the one-line error can say where."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path`` to write the file to (by any means: ``open``, ``savefig(tmp,
    format=...)``, safetensors); on leaving the block the temp file is fsynced and renamed to ``path``. If the
    block raises, or the rename fails, the temp file is removed and ``path`` is left as it was.

    Nested blocks commit inner first: writing a pair (a token file and its metadata) inside one another
    renames neither unless both were written."""
    path = Path(path)
    tmp = path.with_name(temp_name(path.name))
    try:
        with names_path(path):
            yield tmp
            fsync_file(tmp)
            os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], Any]) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function that writes to a binary file) to ``path``
    atomically (:func:`atomic_output`). Returns ``path``."""
    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def stale_pid(pid: int) -> bool:
    """Whether a leftover named with ``pid`` is stale: that process is gone, or it is this one (which cleans up
    only when it starts a command, so none of its own writes is under way then)."""
    return pid == os.getpid() or not pid_alive(pid)


def stale_temp(path: Path) -> bool:
    """Whether ``path`` is a temp file or folder (:func:`temp_name`) left by a process that is gone."""
    m = TEMP_NAME.match(path.name)
    return m is not None and stale_pid(int(m["pid"]))


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Remove the temp files and folders that a killed process left in ``folder`` (not below it); -> what was
    removed. A live writer's temps (its pid runs here) are left alone. Call it when a command starts."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for p in entries:
        if stale_temp(p):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed
