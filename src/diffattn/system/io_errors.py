"""I/O errors as one line: at the command boundary an ``OSError`` (``ENOSPC``, ``EROFS``, ``EACCES``, ``EIO``, ...)
or a storage library's error that wraps one (safetensors, optuna's journal) becomes one line naming the path and
the cause, what was kept and how to continue (:func:`io_error_in`, :func:`io_error_line`); the command exits
:data:`EX_IOERR`.

In the system layer, beside :mod:`~diffattn.system.run_lock`: imports nothing from diffattn but
:mod:`~diffattn.system.atomic_files` and :mod:`~diffattn.system.untrusted`.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from diffattn.system.atomic_files import TEMP_NAME
from diffattn.system.untrusted import printable

EX_IOERR = 74  # sysexits.h: an error while doing I/O on some file

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
    parts = [(m["name"] if (m := TEMP_NAME.match(part)) else part) for part in Path(path).parts]
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
