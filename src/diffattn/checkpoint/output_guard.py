"""Output paths: one guard for every command that writes a folder or a file.

Every command that writes checks its output first, before any folder is created or any minute is spent:

* a folder (``train --out``, ``convert --out``, ``compare --out``): :func:`check_output_dir` validates it
  without creating anything; :class:`OutputFolder` is the folder's one lifecycle (its lock, held from before it
  is read until the command ends; its claim, the same checks, then what ``--overwrite`` replaces removed and the
  folder created; the claim taken back when the command fails before its first checkpoint). Only the files the
  command itself writes (``owned_patterns``) are ever removed; anything else in the folder stays. A folder that
  is, or lies inside, the command's source (the model being converted or fine-tuned) is always refused.
* a file (``eval --out``, ``heads --plot``): :func:`check_output_file`; an existing file is replaced only with
  ``--overwrite``, and the folder it goes into must already exist.

Both check that the path can really be written (a probe file is made and removed at once, so a root user is
told about ``/proc`` or a read-only mount up front too). A problem raises :class:`OutputError` (also known as
:class:`RunDirError`) with a one-line message; the commands print it and exit 2. A failed command leaves
the file system as it found it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from diffattn.checkpoint.best import BEST
from diffattn.checkpoint.format import MANIFEST
from diffattn.checkpoint.run_folder import LATEST, PREVIOUS, checkpoint_step
from diffattn.system.atomic_files import UnsafePath, refuse_links, remove_stale_temps, stale_pid
from diffattn.system.run_lock import LOCK_NAME, FolderInUse, RunLock
from diffattn.system.untrusted import Refused

# What a training run leaves in its folder (train.py, classify.py, the diagnostics file, TensorBoard, W&B).
TRAIN_OUTPUTS = (LATEST, f"{PREVIOUS}*", BEST, "metrics.csv", "metrics.jsonl", "diagnostics.csv", "resolved.toml",
                 "tb", "wandb")
# What `diffattn convert` writes: one checkpoint folder's files (save_checkpoint's layout).
CHECKPOINT_FILES = (MANIFEST, "config.json", "model.safetensors", "optimizer.safetensors", "optimizer.json",
                    "rng.safetensors")


class OutputError(Refused):
    """An output folder or file cannot be used as asked: it holds earlier results and neither resuming nor
    overwriting was asked for, it is the command's own source, or it cannot be written. One-line message."""


class OutputInUse(OutputError):
    """Another live process holds the folder (its lock): the one refusal that may pass once that process ends."""


RunDirError = OutputError  # the older name (a folder that already holds a run); both catch every case


def _names(paths: list[Path], n: int = 4) -> str:
    return ", ".join(p.name for p in paths[:n]) + (", ..." if len(paths) > n else "")


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both resolved)."""
    return path == folder or folder in path.parents


def first_missing(path: str | os.PathLike) -> Path | None:
    """The topmost folder of ``path`` that does not exist yet (what ``mkdir -p`` would create first), or None."""
    p = Path(path).absolute()
    missing = None
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            break
        missing = q
    return missing


def _probe_writable(folder: Path, what: str) -> None:
    """Make and remove a file in ``folder``: the only test that also holds for root (os.access says yes to
    /proc and to read-only mounts)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".diffattn-probe-", dir=folder)
    except OSError as e:
        raise OutputError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)


def run_outputs(out: Path, patterns: Iterable[str] = TRAIN_OUTPUTS) -> list[Path]:
    """The entries of ``out`` that a previous run wrote (matched by ``patterns``), sorted."""
    if not out.is_dir():
        return []
    found = {p for pat in patterns for p in out.glob(pat)}
    return sorted(found)


def check_output_dir(path: str | os.PathLike, *, overwrite: bool, owned_patterns: Iterable[str] = TRAIN_OUTPUTS,
                     what: str = "train", resumable: bool = True, source: str | os.PathLike | None = None,
                     refuse_nonempty: bool = False, flag: str = "--out", restart_unsaved: bool = False) -> list[Path]:
    """Check that the folder ``path`` may be written by ``diffattn <what>``; create and change nothing.

    Refused (:class:`OutputError`): ``path`` is a file; it is ``source`` or inside it, or ``--overwrite`` would
    remove ``source`` (always, even with ``overwrite``); it holds entries matching ``owned_patterns`` (or, with
    ``refuse_nonempty``, anything at all) and ``overwrite`` is off (the message names ``--resume`` when
    ``resumable``, and ``--overwrite``); it, or the nearest existing folder above it, cannot be written.
    With ``restart_unsaved``, a run that stopped before its first checkpoint (outputs, but no checkpoint: see
    :func:`unsaved_run`) is not refused: it is started again. Returns the entries that ``--overwrite`` (or
    that restart) will replace (empty when there are none)."""
    overwrite = overwrite or (restart_unsaved and unsaved_run(path))
    out = Path(path)
    label = f"{what} {flag} {out}"
    full = out.expanduser().resolve()
    if source is not None:
        src = Path(source).expanduser().resolve()
        if _inside(full, src):
            where = "is" if full == src else "is inside"
            raise OutputError(f"{label}: the output folder {where} the source {source}; nothing was changed. "
                              "Write to another folder")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{label}: {out} is a file, not a folder; nothing was changed")
    owned = run_outputs(out, owned_patterns)
    if source is not None and any(_inside(src, p.resolve()) for p in owned):
        raise OutputError(f"{label}: --overwrite would remove the source {source} from {out}; nothing was "
                          "changed. Write to another folder")
    if out.is_dir():
        entries = sorted(p for p in out.iterdir() if p.name != LOCK_NAME) if refuse_nonempty else owned
        if entries and not overwrite:
            resume = f"To continue it: diffattn {what} --out {out} --resume. " if resumable else ""
            if refuse_nonempty:
                replaced = ", ".join(owned_patterns_names(owned_patterns))
                raise OutputError(f"{out} is not empty ({_names(entries)}); nothing was changed. To write "
                                  f"there anyway: add --overwrite (it replaces only {replaced}; other files "
                                  "stay).")
            raise OutputError(f"{out} already holds a run ({_names(entries)}); nothing was changed. {resume}"
                              "To replace it: add --overwrite.")
        _probe_writable(out, label)
    else:
        parent = full.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise OutputError(f"{label}: {parent} is a file, so no folder can be made under it")
        _probe_writable(parent, label)
    return owned


def owned_patterns_names(patterns: Iterable[str]) -> list[str]:
    """The patterns as a reader sees them (the first three, then "...")."""
    pats = list(patterns)
    return pats[:3] + (["..."] if len(pats) > 3 else [])


def has_checkpoint(out: str | os.PathLike) -> bool:
    """Whether the folder ``out`` holds a checkpoint anywhere below it (a run's ``ckpt/`` or kept
    ``ckpt-step-N/``, one moved aside by a save that died, a comparison's ``runs/<model>/ckpt/``, ...)."""
    return any(Path(out).rglob(MANIFEST))


def unsaved_run(out: str | os.PathLike, patterns: Iterable[str] = TRAIN_OUTPUTS) -> bool:
    """Whether ``out`` holds a run that stopped before its first checkpoint (killed, or its disk filled): its
    outputs (``patterns``: metrics.csv, resolved.toml, ...) but no checkpoint anywhere. Nothing in it can be
    resumed, so a new ``train`` may start it again. Ask only while holding the folder's lock."""
    return bool(run_outputs(Path(out), patterns)) and not has_checkpoint(out)


def clean_leftovers(run_dir: str | os.PathLike) -> list[str]:
    """Tidy what a killed process (kill -9, a crash) left in the run folder ``run_dir``; -> one phrase per thing.

    Only leftovers of processes that are gone (their pid, in the name, runs no more) are touched: temp files
    and unfinished checkpoints (``.ckpt.tmp-PID-*``) are removed; a checkpoint that a save moved aside and
    never got to put back or keep (``.ckpt.old-PID``) becomes ``ckpt/`` again when ``ckpt/`` is missing,
    ``ckpt-step-N`` when that is free, else it is removed (``ckpt/`` is newer)."""
    run_dir = Path(run_dir)
    notes = [f"{p.name} (unfinished {'checkpoint' if p.is_dir() else 'file'})" for p in remove_stale_temps(run_dir)]
    latest = run_dir / LATEST
    for old in sorted(run_dir.glob(f".{LATEST}.old-*")):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not stale_pid(int(pid)):
            continue  # its save is still under way
        step = checkpoint_step(old) if (old / MANIFEST).is_file() else None
        if step is not None and not latest.exists():
            os.replace(old, latest)
            notes.append(f"{old.name} (put back as {LATEST}/, step {step})")
        elif step is not None and step != checkpoint_step(latest) and not (run_dir / f"{PREVIOUS}{step}").exists():
            os.replace(old, run_dir / f"{PREVIOUS}{step}")
            notes.append(f"{old.name} (kept as {PREVIOUS}{step}/)")
        else:
            shutil.rmtree(old, ignore_errors=True)
            notes.append(f"{old.name} (an older checkpoint moved aside)")
    return notes + _tidy_best(run_dir)


def _tidy_best(run_dir: Path) -> list[str]:
    """The best checkpoint a killed save moved aside (``.best.old-PID``): put back when ``best/`` is missing,
    else removed (``best/`` is the newer best)."""
    notes = []
    for old in sorted(run_dir.glob(f".{BEST}.old-*")):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not stale_pid(int(pid)):
            continue  # its save is still under way
        if (old / MANIFEST).is_file() and not (run_dir / BEST).exists():
            os.replace(old, run_dir / BEST)
            notes.append(f"{old.name} (put back as {BEST}/)")
        else:
            shutil.rmtree(old, ignore_errors=True)
            notes.append(f"{old.name} (an older best checkpoint moved aside)")
    return notes


_Folder = TypeVar("_Folder", bound="OutputFolder")


class OutputFolder:
    """The one lifecycle of a folder a command writes (a run, a comparison, a study, ``convert`` / ``export --out``).

    ``with OutputFolder(out, command) as folder:`` holds the folder's lock (:class:`~diffattn.system.run_lock.RunLock`)
    from as soon as it exists (on entry, else from :meth:`claim`) until the block ends, however it ends (an
    exception, Ctrl-C): a second process on it is refused, naming this one, and what a killed process left there
    is tidied (:func:`clean_leftovers`, said in one line on stderr unless ``quiet``). :meth:`claim` makes it this
    command's; a claim made with ``undo`` is taken back (:meth:`undo`) when its block raises. Entering it again
    (``with folder:`` in a callee) nests: the lock goes with the outermost block, an armed claim with the block
    that made it.

    ``command`` names the holder in another process's refusal, ``hint`` ends it; ``written``: the entries the
    command writes in place (globs), refused when one is a symbolic link; ``source``: a folder the command reads,
    which is never locked, nor a folder inside it (nothing may be written there, a lock file neither). Every
    refusal is an :class:`OutputError`."""

    def __init__(self, path: str | os.PathLike, command: str, *, hint: str = "",
                 written: Iterable[str] = TRAIN_OUTPUTS, quiet: bool = False,
                 source: str | os.PathLike | None = None) -> None:
        self.path, self.command, self.hint = Path(path), command, hint
        self.written, self.quiet, self.source = tuple(written), quiet, source
        self.lock: RunLock | None = None
        self._depth = 0
        self._armed: int | None = None  # the depth of the block that takes the claim back if it raises
        self._created: Path | None = None
        self._owned: tuple[str, ...] = ()

    def writes(self) -> bool:
        """Whether this process writes the folder (the other ranks of a distributed run do not)."""
        return True

    def __enter__(self: _Folder) -> _Folder:
        self._depth += 1
        try:
            self._hold()
        except BaseException:
            self._depth -= 1
            raise
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        depth, self._depth = self._depth, self._depth - 1
        if self._armed == depth:
            self._armed = None
            if exc is not None:
                self.undo()
        if self._depth == 0 and self.lock is not None:
            lock, self.lock = self.lock, None
            lock.release()

    def _hold(self) -> None:
        if self.lock is not None or not self.writes() or not self.path.is_dir():
            return
        if self.source is not None and _inside(self.path.expanduser().resolve(),
                                               Path(self.source).expanduser().resolve()):
            return  # the command refuses it
        lock = RunLock(self.path, self.command, self.hint)
        try:
            lock.acquire()
            refuse_links(self.path, self.written)
        except FolderInUse as e:
            lock.release()
            raise OutputInUse(str(e)) from None
        except UnsafePath as e:  # a link as the lock file itself too: refused, never followed
            lock.release()
            raise OutputError(str(e)) from None
        self.lock = lock
        notes = clean_leftovers(self.path)
        if notes and not self.quiet:
            print(f"note: {self.path}: removed what a killed process left: {', '.join(notes)}", file=sys.stderr)

    def claim(self, *, patterns: Iterable[str] | None = None, overwrite: bool = False, restart_unsaved: bool = False,
              undo: bool = False, **checks: Any) -> list[Path]:
        """Make the folder this command's: create it (and its missing parents) and hold it; with ``patterns`` (the
        entries the command owns) check it as :func:`check_output_dir` does (``checks``: its other options) and
        remove what ``overwrite`` replaces, or with ``restart_unsaved`` a run that stopped before its first
        checkpoint (:func:`unsaved_run`), under the lock. ``undo``: take the claim back should the block it is made
        in raise. -> the entries removed."""
        if not self.writes():
            return []
        created = first_missing(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._hold()
        self._created, self._owned = created, tuple(patterns or ())
        removed: list[Path] = []
        if patterns is not None:
            overwrite = overwrite or (restart_unsaved and unsaved_run(self.path, self._owned))
            old = check_output_dir(self.path, overwrite=overwrite, owned_patterns=self._owned, source=self.source,
                                   **checks)
            removed = old if overwrite else []
            for p in removed:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        if undo:
            self._armed = self._depth
        return removed

    def undo(self) -> bool:
        """Take the claim back after the command failed: if the folder holds no checkpoint (:func:`has_checkpoint`),
        remove what the command wrote (the claim's ``patterns``) and the folders the claim created, if they are
        empty then; a folder with a checkpoint anywhere in it is left alone. The lock goes in any case, before the
        folders (its file would keep them from being empty). -> whether anything was removed."""
        self._armed = None
        out, lock, self.lock = self.path, self.lock, None
        if not out.is_dir() or has_checkpoint(out):
            if lock is not None:
                lock.release()
            return False
        removed = False
        try:
            for p in run_outputs(out, self._owned):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed = True
        finally:  # let go on every path, and before the folders go
            if lock is not None:
                lock.release()
        if self._created is not None:
            top = self._created.absolute()
            for q in (out.absolute(), *out.absolute().parents):
                try:
                    q.rmdir()  # only empty folders go
                except OSError:
                    break
                removed = True
                if q == top:
                    break
        return removed


def check_output_file(path: str | os.PathLike, *, overwrite: bool, what: str = "", flag: str = "--out",
                      inside_forbidden: str | os.PathLike | None = None) -> Path:
    """Check that the file ``path`` may be written; create and change nothing. Refused (:class:`OutputError`):
    it is a folder; it exists and ``overwrite`` is off (the message names ``--overwrite``); the folder it goes
    into does not exist or cannot be written; it lies inside ``inside_forbidden`` (e.g. the checkpoint folder
    being read). Returns ``path`` as a Path."""
    f = Path(path)
    label = f"{what} {flag} {f}".strip()
    if inside_forbidden is not None and _inside(f.expanduser().resolve(), Path(inside_forbidden).resolve()):
        raise OutputError(f"{label}: that is inside the checkpoint folder {inside_forbidden}; write it elsewhere")
    if f.is_dir():
        raise OutputError(f"{label}: {f} is a folder; give a file name")
    parent = f.expanduser().absolute().parent
    if not parent.is_dir():
        why = "is not a folder" if parent.exists() else "does not exist"
        raise OutputError(f"{label}: the folder {parent} {why}; nothing was written")
    if f.exists() and not overwrite:
        raise OutputError(f"{label}: {f} already exists; nothing was changed. To replace it: add --overwrite")
    if f.exists() and not os.access(f, os.W_OK):
        raise OutputError(f"{label}: {f} is not writable")
    _probe_writable(parent, label)
    return f
