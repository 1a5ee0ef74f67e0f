"""Files that survive faults: atomic writes, one process per run folder, and I/O errors as one line.

* :func:`atomic_output` / :func:`atomic_write`: every output file diffattn writes is written to a temp file beside
  it (``.NAME.tmp-PID-XXXX``), fsynced and renamed into place, so a reader sees the old file or the new one,
  and a writer that fails (a full disk, Ctrl-C, an exception) leaves nothing: its temp file is removed.
  :func:`remove_stale_temps` removes the temp files of a process that was killed (kill -9) before it could.
* :class:`RunLock`: a command that writes a run folder holds ``FOLDER/.diffattn.lock`` (``fcntl.flock``) for its
  whole life; a second one is refused with :class:`FolderInUse`, naming the holder's pid and host (the kernel
  releases the lock of a process that dies; on NFS, see the class).
* Folders and files from elsewhere are :mod:`diffattn.untrusted`'s (opens that follow no link, names confined,
  control characters escaped, reads bounded); its names are re-exported here, so every layer imports them from
  one place as before.
* :func:`io_error_in` and :func:`io_error_line`: at the command boundary an ``OSError`` (``ENOSPC``, ``EROFS``,
  ``EACCES``, ``EIO``, ...) or a storage library's error that wraps one (safetensors, optuna's journal) becomes one
  line naming the path and the cause, what was kept and how to continue; the command exits :data:`EX_IOERR`.

The bottom layer: imports nothing from diffattn but :mod:`diffattn.untrusted`, so every layer (the token-file
writer in ``data`` too) uses it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from diffattn.untrusted import (  # noqa: F401 (re-exported: every layer imports these from here)
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

try:
    import fcntl
except ImportError:  # Windows: no flock; run folders are then not locked (README says so)
    fcntl = None  # type: ignore[assignment]

EX_IOERR = 74  # sysexits.h: an error while doing I/O on some file
LOCK_NAME = ".diffattn.lock"
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\w+$")  # atomic_output's and save_checkpoint's temps


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
    m = _TEMP.match(path.name)
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


# ---------------------------------------------------------------------------------------------- the lock


class FolderInUse(ValueError):
    """Another live process holds the folder's :class:`RunLock` (one-line message naming it)."""


_no_flock_said = False


class RunLock:
    """``FOLDER/.diffattn.lock``, held with ``fcntl.flock`` from :meth:`acquire` to :meth:`release` (a context
    manager too). ``command`` names the holder in a refusal (``diffattn train``); ``hint`` ends the refusal
    (e.g. how to add a worker instead). The folder must exist. Reentrant in one object only: a second RunLock
    on the same folder, in this process too, is refused. A killed holder's lock file is reused. On NFS, Linux
    clients map ``flock`` to the server's locks (NLM / NFSv4) unless mounted ``nolock`` or ``local_lock=flock``
    /``all``; a client that crashes holds it until the server's lease expires. No link is followed."""

    def __init__(self, folder: str | os.PathLike, command: str, hint: str = "") -> None:
        self.folder, self.command, self.hint = Path(folder), command, hint
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder (may be empty or stale)."""
        try:
            with open_nofollow(self.path) as f:
                info = json.loads(f.read() or "{}")
        except (OSError, ValueError):  # UnsafePath is a ValueError
            return {}
        return info if isinstance(info, dict) else {}

    def acquire(self) -> RunLock:
        global _no_flock_said
        if self.fd is not None:
            return self
        if fcntl is None:
            if not _no_flock_said:
                _no_flock_said = True
                print("note: no fcntl on this platform: run folders are not locked against a second process",
                      file=sys.stderr)
            return self
        while True:
            # read-only: a file held open for writing would keep its filesystem from being remounted read-only
            # never through a symbolic link: a planted one would have the record below written outside the folder
            fd = nofollow_fd(self.path, os.O_RDONLY | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise FolderInUse(self._refusal()) from None
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    if not _no_flock_said:
                        _no_flock_said = True
                        print(f"note: {self.folder}: this filesystem cannot lock files ({e.strerror}); a second "
                              "process on the same folder is not detected", file=sys.stderr)
                    return self
                raise
            try:  # the previous holder may have removed the file between our open and our lock: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:  # who holds it, for the refusal another process prints; the lock itself needs no space
            with open_nofollow(self.path, "w") as f:
                f.write(json.dumps(info) + "\n")
        except (OSError, UnsafePath):
            pass
        return self

    def _refusal(self) -> str:
        h = self.holder()
        who = (f"{h.get('command', 'diffattn')} (pid {h['pid']} on {h.get('host', '?')}, since {h.get('since', '?')})"
               if h.get("pid") else "another diffattn process")
        stop = f"stop it (kill {h['pid']}: it saves and exits)" if h.get("pid") else "stop it"
        return (f"{self.folder} is in use by {who}; nothing was changed. Wait for it to finish, or {stop}, then run "
                f"this again{self.hint}")

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:  # remove the lock file while still holding it (a process that opened it meanwhile retries)
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                self.path.unlink()
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------- I/O errors

_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) report an errno


def io_error_in(exc: BaseException | None) -> OSError | None:
    """The storage failure behind ``exc``: ``exc`` itself if it is an OSError, one in its ``__cause__`` /
    ``__context__`` chain (optuna's journal lock re-raises a RuntimeError over it), or an errno in a storage
    library's message (safetensors: "I/O error: No space left on device (os error 28)"); else None.
    BrokenPipeError (output piped into ``head``) is not one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
            return exc
        m = _OS_ERROR_IN_TEXT.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def display_path(path: str | os.PathLike) -> str:
    """``path`` as a user knows it: a temp component (``.ckpt.tmp-123-ab12``) is shown as what it becomes
    (``ckpt``)."""
    parts = [(m["name"] if (m := _TEMP.match(part)) else part) for part in Path(path).parts]
    return str(Path(*parts)) if parts else str(path)


# errnos that mean "the storage failed" rather than "this input is wrong", wherever they come from
WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

_FIX = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space (the disk quota is used up)",
    errno.EROFS: "make the filesystem writable again (it is mounted read-only)",
    errno.EACCES: "fix the folder's permissions",
    errno.EPERM: "fix the folder's permissions",
    errno.EIO: "check the disk (the device reported an I/O error; see dmesg)",
}


def describe_io_error(err: OSError, where: str | os.PathLike | None = None) -> str:
    """"PATH: No space left on device [ENOSPC]" (``where`` when the error names no file)."""
    name = errno.errorcode.get(err.errno or 0, "")
    cause = (err.strerror or str(err)) + (f" [{name}]" if name else "")
    path = err.filename if err.filename is not None else where
    return printable(f"{display_path(path)}: {cause}" if path is not None else cause)


def io_error_line(err: OSError, *, kept: str | None = None, then: str | None = None,
                  where: str | os.PathLike | None = None, prefix: str = "error: ") -> str:
    """One line for a storage failure: the path and the cause, ``kept`` (what is safe), and how to continue:
    the fix for the cause, then ``then`` (the command to run)."""
    line = prefix + describe_io_error(err, where)
    if kept:
        line += f"; kept: {kept}"
    fix = _FIX.get(err.errno or 0)
    then = f"run: {then}" if then and then.startswith("diffattn ") else then
    steps = ", then ".join(x for x in (fix, then) if x)
    return line + (f"; to continue: {steps}" if steps else "")
