"""The export ``diffattn serve`` makes of a folder vLLM cannot read as it is, kept and reused while its source is
unchanged, instead of written again at every start.

Where: a cache folder of the user's, ``$DIFFATTN_CACHE_DIR`` or ``$XDG_CACHE_HOME/diffattn`` (``~/.cache/diffattn``),
under ``vllm/<source>/<fingerprint>/``. Not inside the run folder: ``serve`` only reads its source, which may be
read-only, shared, a transformers folder that is not ours, or a run folder a ``train`` holds (its lock,
``--overwrite``, resume); an export there would be one more thing for ``export``'s and ``convert``'s output checks to
meet. The cache is ours alone: nothing is written outside it, and deleting it costs one export.

Valid: its fingerprint is the source's now. A checkpoint's is its manifest (the sha256 of every file, checked when
the checkpoint is loaded: the export was made from exactly that content); a save_pretrained or transformers folder's
is the name, size and modification time of each of its files. Both are read without loading the model, and
include :data:`EXPORT_FORMAT` and diffattn's version, so an export written by other code is not taken. A source whose
fingerprint cannot be read (a damaged checkpoint, loaded from an older one) gets an export that is never reused.

Atomic: an export is written into a temp folder beside its place and renamed into it; a rename onto a folder that
another ``serve`` published meanwhile fails, and that one is used. A folder is never replaced in place, so a server
starting on it never sees it change; the exports of the same source's older fingerprints (one export is kept per
source), and temp folders of processes that are gone, are removed after a publish.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from diffattn import __version__
from diffattn.checkpoint.model_folders import is_pretrained_folder
from diffattn.checkpoint.run_folder import resolve_checkpoint_dir
from diffattn.checkpoint.verify import MANIFEST
from diffattn.system.atomic_files import fsync_dir, read_json

EXPORT_FORMAT = 1  # raise it when an export of the same source would differ: every cached export is then stale
STAMP = "diffattn_source.json"  # in each export: its source and fingerprint
CACHE_ENV = "DIFFATTN_CACHE_DIR"


def cache_root() -> Path:
    """The user's cache folder of diffattn: ``$DIFFATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/diffattn``, else
    ``~/.cache/diffattn``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffattn"


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def source_fingerprint(source: Path) -> str | None:
    """The fingerprint of the model in ``source`` (module docstring), read without loading it; None when it cannot
    be read."""
    try:
        if is_pretrained_folder(source):
            files = []
            for f in sorted(source.iterdir()):
                st = f.lstat()  # a link or a FIFO is described, never followed nor opened
                files.append([f.name, stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns])
            seen: object = ["folder", files]
        else:
            seen = ["checkpoint", read_json(resolve_checkpoint_dir(source) / MANIFEST)]
    except (OSError, ValueError):  # Refused and CheckpointError are ValueErrors
        return None
    return _digest([EXPORT_FORMAT, __version__, seen])


def _valid(folder: Path, source: Path, fingerprint: str) -> bool:
    try:
        stamp = read_json(folder / STAMP)
    except (OSError, ValueError):
        return False
    return stamp == {"source": str(source), "fingerprint": fingerprint} and (folder / "config.json").is_file()


def reuse_or_export(source: str | os.PathLike, write: Callable[[Path], None],
                    root: Path | None = None) -> tuple[Path, bool]:
    """The cached export of ``source`` (under ``root``, default :func:`cache_root`) if it is valid, else a new one
    that ``write(folder)`` writes into an empty folder, published atomically. -> (the folder, whether it was
    reused)."""
    src = Path(source).resolve()
    slot = (root or cache_root()) / "vllm" / _digest(str(src))[:16]
    fingerprint = source_fingerprint(src) or f"unread-{uuid.uuid4().hex}"  # never matches: exported again
    target = slot / _digest(fingerprint)[:16]
    if _valid(target, src, fingerprint):
        return target, True
    slot.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=slot))
    try:
        write(stage)
        (stage / STAMP).write_text(json.dumps({"source": str(src), "fingerprint": fingerprint}) + "\n",
                                   encoding="utf-8")
        try:
            os.rename(stage, target)  # fails onto a folder another serve published meanwhile (non-empty)
        except OSError:
            if not _valid(target, src, fingerprint):
                raise
            shutil.rmtree(stage, ignore_errors=True)
            return target, True
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        try:
            slot.rmdir()  # a source refused before its first export leaves no empty folder
        except OSError:
            pass
        raise
    fsync_dir(slot)
    _prune(slot, keep=target)
    return target, False


def _prune(slot: Path, keep: Path) -> None:
    """Remove the source's older exports and the temp folders of processes that are gone."""
    for child in slot.iterdir():
        if child == keep:
            continue
        if child.name.startswith(".tmp-"):
            pid = child.name.split("-")[1]
            if pid.isdigit() and _alive(int(pid)):
                continue
        shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
