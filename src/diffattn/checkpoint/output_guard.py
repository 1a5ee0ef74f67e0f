"""Output paths: one guard for every command that writes a folder or a file.

Every command that writes checks its output first, before any folder is created or any minute is spent:

* a folder (``train --out``, ``convert --out``, ``compare --out``): :func:`check_output_dir` validates it
  without creating anything, and :func:`claim_run_dir` (the same checks) then removes what ``--overwrite``
  replaces and, if asked, creates the folder. Only the files the command itself writes (``owned_patterns``)
  are ever removed; anything else in the folder stays. A folder that is, or lies inside, the command's source
  (the model being converted or fine-tuned) is always refused.
* a file (``eval --out``, ``heads --plot``): :func:`check_output_file`; an existing file is replaced only with
  ``--overwrite``, and the folder it goes into must already exist.

Both check that the path can really be written (a probe file is made and removed at once, so a root user is
told about ``/proc`` or a read-only mount up front too). A problem raises :class:`OutputError` (also known as
:class:`RunDirError`) with a one-line message; the commands print it and exit 2. :func:`release_run_dir`
undoes a run folder after a command failed before its first checkpoint, so a failed command leaves the file
system as it found it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from diffattn.checkpoint.best import BEST
from diffattn.checkpoint.format import MANIFEST
from diffattn.checkpoint.run_folder import LATEST, PREVIOUS, checkpoint_step
from diffattn.fileio import UnsafePath, refuse_links, remove_stale_temps, stale_pid
from diffattn.run_lock import LOCK_NAME, FolderInUse, RunLock
from diffattn.untrusted import Refused

# What a training run leaves in its folder (train.py, classify.py, the diagnostics file, TensorBoard, W&B).
TRAIN_OUTPUTS = (LATEST, f"{PREVIOUS}*", BEST, "metrics.csv", "metrics.jsonl", "diagnostics.csv", "resolved.toml",
                 "tb", "wandb")
# What `diffattn convert` writes: one checkpoint folder's files (save_checkpoint's layout).
CHECKPOINT_FILES = (MANIFEST, "config.json", "model.safetensors", "optimizer.safetensors", "optimizer.json",
                    "rng.safetensors")


class OutputError(Refused):
    """An output folder or file cannot be used as asked: it holds earlier results and neither resuming nor
    overwriting was asked for, it is the command's own source, or it cannot be written. One-line message."""


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


def claim_run_dir(out: Path, *, overwrite: bool, what: str = "train", resumable: bool = True,
                  patterns: Iterable[str] = TRAIN_OUTPUTS, source: str | os.PathLike | None = None,
                  refuse_nonempty: bool = False, create: bool = False, restart_unsaved: bool = False) -> list[Path]:
    """Make ``out`` ready for a new run: :func:`check_output_dir` (raising :class:`OutputError`), then, with
    ``overwrite`` (or ``restart_unsaved`` and a run without a checkpoint there), remove the previous run's
    outputs (and return them); with ``create`` make the folder (and its missing parents). Call it once the
    inputs are validated, holding the folder's lock: it is the first step that changes anything."""
    out = Path(out)
    overwrite = overwrite or (restart_unsaved and unsaved_run(out))
    old = check_output_dir(out, overwrite=overwrite, owned_patterns=patterns, what=what, resumable=resumable,
                           source=source, refuse_nonempty=refuse_nonempty)
    for p in old if overwrite else []:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return old if overwrite else []


def has_checkpoint(out: str | os.PathLike) -> bool:
    """Whether the folder ``out`` holds a checkpoint anywhere below it (a run's ``ckpt/`` or kept
    ``ckpt-step-N/``, one moved aside by a save that died, a comparison's ``runs/<model>/ckpt/``, ...)."""
    return any(Path(out).rglob(MANIFEST))


def unsaved_run(out: str | os.PathLike, patterns: Iterable[str] = TRAIN_OUTPUTS) -> bool:
    """Whether ``out`` holds a run that stopped before its first checkpoint (killed, or its disk filled): its
    outputs (``patterns``: metrics.csv, resolved.toml, ...) but no checkpoint anywhere. Nothing in it can be
    resumed, so a new ``train`` may start it again. Ask only while holding the folder's lock."""
    return bool(run_outputs(Path(out), patterns)) and not has_checkpoint(out)


def release_run_dir(out: str | os.PathLike, *, created: Path | None, patterns: Iterable[str] = TRAIN_OUTPUTS,
                    lock: RunLock | None = None) -> bool:
    """After a command failed: if the folder ``out`` holds no checkpoint (:func:`has_checkpoint`), remove the
    outputs it wrote (``patterns``) and the folders it created (``created``: :func:`first_missing` of ``out``
    taken before creating it), if they are empty then. Returns whether anything was removed; a folder with a
    checkpoint anywhere in it is left alone. Call it only for a folder this command claimed; ``lock`` (the
    folder's, held) is released before the folders are removed (its file would keep them from being empty)."""
    out = Path(out)
    if not out.is_dir() or has_checkpoint(out):
        if lock is not None:
            lock.release()
        return False
    removed = False
    for p in run_outputs(out, patterns):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed = True
    if lock is not None:
        lock.release()
    if created is not None:
        top = created.absolute()
        for q in (out.absolute(), *out.absolute().parents):
            try:
                q.rmdir()  # only empty folders go
            except OSError:
                break
            removed = True
            if q == top:
                break
    return removed


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


def lock_run_dir(out: str | os.PathLike, command: str, hint: str = "", written: Iterable[str] = TRAIN_OUTPUTS,
                 quiet: bool = False) -> RunLock:
    """Hold the run folder ``out`` (it must exist) for this command (:class:`~diffattn.fileio.RunLock`; raises
    :class:`OutputError` naming the process that holds it), refuse it if one of the entries it writes in place
    (``written``, globs) is a symbolic link, then tidy what a killed process left there (:func:`clean_leftovers`,
    said in one line on stderr unless ``quiet``)."""
    lock = RunLock(out, command, hint)
    try:
        lock.acquire()
        refuse_links(out, written)
    except (FolderInUse, UnsafePath) as e:  # a link as the lock file itself too: refused, never followed
        lock.release()
        raise OutputError(str(e)) from None
    notes = clean_leftovers(out)
    if notes and not quiet:
        print(f"note: {out}: removed what a killed process left: {', '.join(notes)}", file=sys.stderr)
    return lock


def hold_output(out: str | os.PathLike, command: str, written: Iterable[str],
                source: str | os.PathLike | None = None) -> RunLock | None:
    """Hold the folder ``out`` that a command writes in place (``convert``, ``export``), as a training run holds its
    own (:func:`lock_run_dir`): a ``train`` running there refuses it (:class:`OutputError`, nothing written) and a
    ``train`` started there meanwhile is refused; a link among the entries it writes (``written``) is refused too.
    -> the lock, to release when the command is done; None for a folder that does not exist yet (the command
    makes it: nothing else runs in it), and for ``source`` or a folder inside it (the command refuses it; nothing
    may be written there, a lock file neither)."""
    if not Path(out).is_dir() or (source is not None and _inside(Path(out).expanduser().resolve(),
                                                                  Path(source).expanduser().resolve())):
        return None
    return lock_run_dir(out, command, written=written, quiet=True)


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
