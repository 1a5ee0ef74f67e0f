"""One process per run folder: a command that writes a run folder holds ``FOLDER/.diffattn.lock``
(``fcntl.flock``) for its whole life; a second one is refused with :class:`FolderInUse`, naming the holder's pid
and host (the kernel releases the lock of a process that dies; on NFS, see :class:`RunLock`).

In the system layer, above :mod:`~diffattn.system.atomic_files`: imports nothing from diffattn but
:mod:`~diffattn.system.untrusted`.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from diffattn.system.untrusted import Refused, UnsafePath, nofollow_fd, open_nofollow

try:
    import fcntl
except ImportError:  # Windows: no flock; run folders are then not locked (README says so)
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".diffattn.lock"


class FolderInUse(Refused):
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


