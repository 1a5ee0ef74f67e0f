"""Fault injection in the spirit of SQLite's I/O-error and disk-full tests: count every write operation a command
makes under one folder, and make the k-th one fail as a full disk does.

The operations (``KINDS``): a file opened for writing (``open``, ``io.open``, ``Path.open``/``write_text``), each
``write`` on such a file, a safetensors save (``diffattn.checkpoint.format.save_file``, which writes from Rust where
``open`` is not seen), ``os.replace``/``os.rename``, ``os.mkdir`` of a new folder, ``os.link`` and ``os.symlink``
(the study's spec and Optuna's journal lock), and ``os.fsync``. Optuna's journal appends are ``open`` + ``write``
+ ``fsync`` on ``optuna.journal``. Only the main thread's operations on paths under ``root`` count, so the
sequence is the same in every run of a command (a background thread's timing does not shift it).

A failed ``write`` raises ``OSError(ENOSPC)`` without a file name, as the kernel's does; the others name the path.
Not tried: the note a run folder's lock holder writes into ``.diffattn.lock`` (best effort: on a full disk the
lock is held all the same, a refusal just cannot name the holder), and the rename by which Optuna releases its
journal lock (``optuna.journal.lock<uuid>.rename``): a rename needs no free blocks, and a release that fails leaves
a lock that Optuna breaks only after its 30 s grace period, so the rerun would wait 30 s (Optuna's protocol
working, at a cost the loop cannot pay).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KINDS = ("open", "write", "safetensors", "replace", "mkdir", "link", "fsync")
_WRITE_MODES = set("wax+")


class Injector:
    """Counts the write operations under ``root``; the ``fail_at``-th (1-based) raises ``OSError(err)``."""

    def __init__(self, root: Path, fail_at: int | None = None, err: int = errno.ENOSPC) -> None:
        self.root = str(Path(root).resolve())
        self.fail_at, self.err = fail_at, err
        self.ops: list[tuple[str, str]] = []  # (kind, path) of every operation counted, in order
        self.failed: tuple[str, str] | None = None

    def _mine(self, path: Any) -> bool:
        if isinstance(path, int) or threading.current_thread() is not threading.main_thread():
            return False
        try:
            return os.path.abspath(os.fspath(path)).startswith(self.root)
        except TypeError:
            return False

    def hit(self, kind: str, path: Any, named: bool = True) -> None:
        """Count one operation; raise if it is the one to fail."""
        self.ops.append((kind, str(path)))
        if len(self.ops) == self.fail_at:
            self.failed = (kind, str(path))
            raise OSError(self.err, os.strerror(self.err), *([str(path)] if named else []))


class _Writes:
    """A file object whose writes count (the rest is the file's own)."""

    def __init__(self, f: Any, path: Any, inj: Injector) -> None:
        self._f, self._path, self._inj = f, path, inj

    def write(self, data: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            self._inj.hit("write", self._path, named=False)
        return self._f.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> _Writes:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextmanager
def inject(monkeypatch: Any, root: Path, fail_at: int | None = None, err: int = errno.ENOSPC) -> Iterator[Injector]:
    """Patch the write operations (see the module docstring) for the block; yields the :class:`Injector`."""
    import diffattn.checkpoint.format as checkpoint

    inj = Injector(root, fail_at, err)
    real_open, real_replace, real_rename = builtins.open, os.replace, os.rename
    real_mkdir, real_link, real_symlink, real_fsync = os.mkdir, os.link, os.symlink, os.fsync
    real_save = checkpoint.save_file

    def open_(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if inj._mine(file) and _WRITE_MODES & set(mode) and not str(file).endswith(".diffattn.lock"):
            inj.hit("open", file)
            return _Writes(real_open(file, mode, *args, **kw), file, inj)
        return real_open(file, mode, *args, **kw)

    def replace(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(dst) and not str(dst).endswith(".rename"):
            inj.hit("replace", dst)
        return real_replace(src, dst, *args, **kw)

    def rename(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(dst) and not str(dst).endswith(".rename"):
            inj.hit("replace", dst)
        return real_rename(src, dst, *args, **kw)

    def mkdir(path: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(path) and not os.path.exists(path):  # an existing folder fails with EEXIST, not ENOSPC
            inj.hit("mkdir", path)
        return real_mkdir(path, *args, **kw)

    def link(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(dst):
            inj.hit("link", dst)
        return real_link(src, dst, *args, **kw)

    def symlink(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(dst):
            inj.hit("link", dst)
        return real_symlink(src, dst, *args, **kw)

    def fsync(fd: Any) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        except OSError:
            target = None
        if target is not None and inj._mine(target) and not os.path.isdir(target):
            inj.hit("fsync", target)
        return real_fsync(fd)

    def save_file(tensors: Any, filename: Any, *args: Any, **kw: Any) -> None:
        if inj._mine(filename):
            try:
                inj.hit("safetensors", filename)
            except OSError as e:  # as safetensors reports it: its own error type, the errno in the text
                from safetensors import SafetensorError

                raise SafetensorError(f"Error while serializing: I/O error: {e.strerror} (os error {e.errno})"
                                      ) from None
        return real_save(tensors, filename, *args, **kw)

    for mod in (builtins, io):
        monkeypatch.setattr(mod, "open", open_)
    for name, fn in (("replace", replace), ("rename", rename), ("mkdir", mkdir), ("link", link),
                     ("symlink", symlink), ("fsync", fsync)):
        monkeypatch.setattr(os, name, fn)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    try:
        yield inj
    finally:
        for mod in (builtins, io):
            monkeypatch.setattr(mod, "open", real_open)
        for name, fn in (("replace", real_replace), ("rename", real_rename), ("mkdir", real_mkdir),
                         ("link", real_link), ("symlink", real_symlink), ("fsync", real_fsync)):
            monkeypatch.setattr(os, name, fn)
        monkeypatch.setattr(checkpoint, "save_file", real_save)


def leftovers(root: Path) -> list[str]:
    """What a writer that failed must not leave under ``root``: temp files or folders (``.NAME.tmp-PID-...``),
    a lock file, an empty file (but an append-only log a failed first append left empty: nothing is lost)."""
    bad = []
    for p in Path(root).rglob("*"):
        name = p.name
        if ".tmp-" in name or name == ".diffattn.lock" or (p.is_file() and p.stat().st_size == 0 and name not in
                                                            ("diagnostics.csv", "optuna.journal", "events.log")):
            bad.append(str(p.relative_to(root)))
    return sorted(bad)


CORPUS = "the quick brown fox jumps over the lazy dog. " * 40


def tiny_run(tmp: Path, steps: int = 4, **train: Any) -> tuple[Path, Path]:
    """(config, corpus) of the smallest run: d_model 16, 1 layer, 2 × 8 tokens a step, an evaluation and a
    checkpoint every 2 steps (``train`` overrides the [train] section)."""
    (tmp / "corpus.txt").write_text(CORPUS)
    t = {"steps": steps, "batch_size": 2, "seq_len": 8, "lr": 3e-3, "warmup_steps": 1, "eval_every": 2,
         "eval_batches": 1, "log_every": 2, "ckpt_every": 2, "deterministic": "true", "seed": 5, **train}
    cfg = tmp / "run.toml"
    cfg.write_text('[model]\nattention = "diff"\nd_model = 16\nn_layers = 1\nn_heads = 1\n[train]\n'
                   + "".join(f"{k} = {v}\n" for k, v in t.items()) + '[data]\ntokenizer = "char"\n')
    return cfg, tmp / "corpus.txt"
