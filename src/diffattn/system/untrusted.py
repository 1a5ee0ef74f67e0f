"""Files and folders from elsewhere: the rules every reader of them follows, each enforced here, in one place.

* Where a file is: :func:`open_nofollow` opens a file by name without following a link out of its folder;
  :func:`confined` checks a name a file gave (a manifest entry) or a folder diffattn enters (a run's ``best/``, a
  comparison's ``runs/<model>``) before anything is opened; :func:`refuse_links` refuses a folder whose entries a
  command writes in place when one is a link.
* What a file is, before it is read: :func:`regular_file` refuses anything but a regular file (a FIFO would block
  for ever, a device never end); :func:`read_bytes` reads one no larger than a bound; :func:`read_json` and
  :func:`read_toml` parse one, refusing a structure nested deeper than :data:`MAX_DEPTH` (Python's parsers, and
  every recursive walk after them, would end in ``RecursionError``).
* What is shown of it: :func:`printable` escapes control characters, bidirectional overrides and the bytes of a
  name that is not UTF-8 before they reach a terminal; :func:`printable_text` keeps line breaks and tabs (generated
  text); :func:`markdown_text` and :func:`markdown_code` put a string into Markdown as text (a model card).

A refusal is :class:`Refused` (a ValueError, one line, exit 2); a missing optional package is :class:`MissingExtra`.
The bottom of the system layer: imports nothing from diffattn (:mod:`~diffattn.system.atomic_files`, which every
layer writes through, re-exports these names)."""

from __future__ import annotations

import errno
import fnmatch
import glob
import json
import os
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Refused(ValueError):
    """An input refused before anything was done with it, for the reason its one-line message gives (exit 2)."""


class UnsafePath(Refused):
    """A file diffattn would open leads out of its folder (a link, ``..``, an absolute name) or is no regular file."""


class UnreadableInput(Refused):
    """A file refused before it is read whole: not a regular file, larger than its bound, or nested too deeply."""


class MissingExtra(ImportError, Refused):
    """An optional package a command needs is not installed; the message names the extra that installs it. An
    ImportError (what a caller importing it expects) and a refusal: one line, exit 2."""


# ---------------------------------------------------------------------------------------------- shown as text

# C0 and C1 controls, DEL, the bidirectional overrides and isolates ("Trojan source"), and lone surrogates (the
# bytes of a file name that is not UTF-8, as Python decodes them)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_MD_PUNCT = re.compile(r"([!-/:-@\[-`{-~])")  # every ASCII punctuation character may be backslash-escaped


def _escaped(c: str) -> str:
    if "\udc80" <= c <= "\udcff":  # a byte of a non-UTF-8 name: shown as that byte
        return f"\\x{ord(c) - 0xdc00:02x}"
    return c.encode("unicode_escape", "backslashreplace").decode("ascii")


def printable(text: object) -> str:
    """``str(text)`` with every control character escaped (``\\x1b``, ``\\n``, ``\\u202e``; a byte of a name that is
    not UTF-8 as ``\\xe9``), so that a name from a file or folder cannot clear a terminal, move its cursor, reorder
    a line, start a new one, or make the write fail. Idempotent."""
    return _CONTROL.sub(lambda m: _escaped(m.group()), str(text))


def printable_text(text: object) -> str:
    """:func:`printable`, but line breaks and tabs are kept: text meant to be read as text (what ``generate``
    prints), which may still never drive the terminal."""
    return _CONTROL.sub(lambda m: m.group() if m.group() in "\n\t" else _escaped(m.group()), str(text))


def markdown_text(text: object) -> str:
    """``text`` as Markdown that shows it as it is: every ASCII punctuation character backslash-escaped (no link,
    tag, emphasis or code can start), control characters escaped (:func:`printable`)."""
    return _MD_PUNCT.sub(r"\\\1", printable(text))


def markdown_code(text: object) -> str:
    """Inline code (Markdown's backticks) showing ``text`` as it is: delimited by more backticks than it holds in a
    row, so that none of it can end the span; control characters escaped."""
    text = printable(text)
    ticks = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_name(name: object, what: str = "the name") -> str:
    """``str(name)`` when it is valid Unicode; :class:`UnreadableInput` for a file name in another encoding (its
    bytes decoded as lone surrogates): diffattn writes the names it is given into UTF-8 files (``resolved.toml``,
    checkpoints, reports), where such a name cannot go."""
    text = str(name)
    if _SURROGATE.search(text):
        raise UnreadableInput(f"{what} {printable(text)} is not valid UTF-8 (a name in another encoding); diffattn "
                              "records the names it is given in UTF-8 files: rename it")
    return text


# ---------------------------------------------------------------------------------------------- where it is


def _link_text(path: Path) -> str:  # what a link points to, for a refusal
    return f" (to {printable(os.readlink(path))})" if path.is_symlink() else ""


def open_nofollow(path: str | os.PathLike, mode: str = "r", *, encoding: str | None = None,
                  newline: str | None = None) -> Any:
    """``open(path, mode)`` for a file opened by name in a folder that may come from elsewhere: a symbolic link
    at ``path``, dangling or not, is refused (:class:`UnsafePath`) rather than followed out of the folder, and so
    is anything but a regular file (a FIFO would block)."""
    return open(path, mode, encoding=None if "b" in mode else (encoding or "utf-8"), newline=newline,
                opener=nofollow_fd)


def nofollow_fd(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags)`` (a new file 0666 less the umask) as :func:`open_nofollow` opens: no symbolic
    link, only a regular file."""
    path = Path(path)
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO) and path.is_symlink():
            raise UnsafePath(f"{printable(path)} is a symbolic link{_link_text(path)}; diffattn does not follow "
                             "links out of a folder it reads or writes: remove the link, then run this again") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise UnsafePath(f"{printable(path)} is not a regular file; remove it, then run this again") from None
        raise
    return _regular_fd(fd, path, UnsafePath, "; remove it, then run this again")


def _regular_fd(fd: int, path: Path, error: type[Refused], then: str) -> int:
    """``fd`` (opened non-blocking) back in blocking mode if it is a regular file; else closed and refused."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{printable(path)} is not a regular file ({_kind(mode)}){then}")
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a file"


def confined(folder: str | os.PathLike, name: object, *, what: str = "entry") -> Path:
    """``folder / name`` for a ``name`` that a file in ``folder`` gave (a checkpoint manifest's entry, an index's
    weight file) or that diffattn looks for there, checked before anything is opened: a plain file name (a
    string with no path separator, not ``.`` or ``..``), which, if it is a symbolic link, resolves inside
    ``folder`` or, in a Hugging Face cache snapshot, into its repo's ``blobs/``. Else :class:`UnsafePath`, one
    line naming the entry (escaped) as ``what``."""
    folder = Path(folder)
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
            or os.path.isabs(name)):
        raise UnsafePath(f"{printable(folder)}: {what} {printable(repr(name))} is not a plain file name inside the "
                         "folder; the folder is refused (nothing was opened)")
    path = folder / name
    if path.is_symlink():
        real, home = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
        # a Hugging Face cache snapshot (<repo>/snapshots/<rev>/...) links its files to <repo>/blobs/<hash>
        snap = next((p for p in (home, *home.parents) if p.parent.name == "snapshots"), None)
        if not any(real.is_relative_to(r) for r in [home] + ([snap.parent.parent / "blobs"] if snap else [])):
            raise UnsafePath(f"{printable(path)} is a symbolic link out of its folder{_link_text(path)}; the folder "
                             "is refused (a link may point only inside the folder, or into blobs/ of a Hugging "
                             "Face cache)")
    return path


def refuse_links(folder: str | os.PathLike, patterns: Iterable[str]) -> None:
    """:class:`UnsafePath` naming the first entry of ``folder`` matching ``patterns`` (globs) that is a symbolic
    link: the files and folders a command writes in place, checked before it changes anything."""
    links = sorted({p for pat in patterns for p in _entries(Path(folder), pat) if p.is_symlink()})
    if links:
        raise UnsafePath(f"{printable(links[0])} is a symbolic link{_link_text(links[0])}; diffattn writes nothing "
                         "through a link: remove it, then run this again (nothing was changed)")


def _entries(folder: Path, pattern: str) -> list[Path]:
    """The entries of ``folder`` that ``pattern`` names, dangling links too (``Path.glob`` skips a link whose
    target is missing, and a dangling link is as good as any for writing through)."""
    parent, _, name = pattern.rpartition("/")
    if glob.has_magic(parent):
        return list(folder.glob(pattern))
    where = folder / parent if parent else folder
    try:
        names = os.listdir(where)
    except OSError:  # no such folder (yet): nothing in it to refuse
        return []
    return [where / n for n in names if fnmatch.fnmatchcase(n, name)]


# ---------------------------------------------------------------------------------------------- what it is

MAX_DEPTH = 64  # nesting of a JSON or TOML document: a checkpoint holding a BPE tokenizer nests 6 deep
MAX_DOCUMENT_BYTES = 1 << 30  # a JSON or TOML document read whole (a large tokenizer.json is 30 MB)


def regular_file(path: str | os.PathLike, what: str = "") -> Path:
    """``path`` when it is a regular file or a folder (a link to one is followed: the user named it), checked
    before it is read: a FIFO, socket or device is refused (:class:`UnreadableInput`), as reading it would block or
    never end. A missing path is the reader's to report (it is returned as it is)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise UnreadableInput(f"{what + ' ' if what else ''}{printable(path)} is not a regular file "
                              f"({_kind(mode)}); diffattn reads files")
    return path


def read_bytes(path: str | os.PathLike, max_bytes: int = MAX_DOCUMENT_BYTES, what: str = "") -> bytes:
    """The bytes of the regular file ``path`` (opened without blocking, so a FIFO is refused, not waited on), refused
    (:class:`UnreadableInput`) before it is read when it is larger than ``max_bytes``. OSError as ``open``."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = _regular_fd(os.open(path, flags), path, UnreadableInput, "; diffattn reads files")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnreadableInput(f"{what + ' ' if what else ''}{printable(path)} is {size:,} bytes; diffattn reads "
                                  f"such a file whole and takes at most {max_bytes:,}")
        return f.read(max_bytes + 1)


def depth_of(obj: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply lists and dicts nest in ``obj`` (a scalar: 0), counted without recursion; stops past ``limit``."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, (list, tuple)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            todo.extend((y, d + 1) for y in x if isinstance(y, (list, tuple, dict)))
    return deepest


def _too_deep(where: object, kind: str) -> UnreadableInput:
    return UnreadableInput(f"{printable(where)}: the {kind} nests more than {MAX_DEPTH} levels deep; no file diffattn "
                           "reads does: it is refused")


def loads_json(text: str | bytes, where: object = "JSON") -> Any:
    """``json.loads(text)``, refused (:class:`UnreadableInput`) when it nests deeper than :data:`MAX_DEPTH`;
    invalid JSON raises ``json.JSONDecodeError`` as ever (``where`` names the source in a refusal)."""
    return _nested_at_most(json.loads, text, where, "JSON")


def _nested_at_most(parse: Any, text: str | bytes, where: object, kind: str) -> Any:
    """``parse(text)``, refused when the parser recurses too deep or the document nests deeper than
    :data:`MAX_DEPTH` (the one bound JSON and TOML share)."""
    try:
        obj = parse(text)
    except RecursionError:
        raise _too_deep(where, kind) from None
    if depth_of(obj) > MAX_DEPTH:
        raise _too_deep(where, kind)
    return obj


def read_json(path: str | os.PathLike, max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """The JSON document in the file ``path`` (:func:`read_bytes`, :func:`loads_json`): a FIFO, a file larger than
    ``max_bytes`` or nesting deeper than :data:`MAX_DEPTH` is refused (:class:`UnreadableInput`); invalid UTF-8
    raises UnicodeDecodeError and invalid JSON ``json.JSONDecodeError``, as ``json.loads(path.read_text())``."""
    return loads_json(read_bytes(path, max_bytes).decode("utf-8"), path)


def read_toml(path: str | os.PathLike, max_bytes: int = MAX_DOCUMENT_BYTES) -> dict[str, Any]:
    """The TOML document in the file ``path``, with :func:`read_json`'s bounds; invalid TOML raises
    ``tomllib.TOMLDecodeError``."""
    return _nested_at_most(tomllib.loads, read_bytes(path, max_bytes).decode("utf-8"), path, "TOML")
