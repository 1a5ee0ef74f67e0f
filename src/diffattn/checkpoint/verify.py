"""What a checkpoint folder must be before anything in it is read: its manifest (format, version, and each file's
sha256 and size) with entries that are plain file names inside the folder, and a model this machine can hold.

A folder from elsewhere is refused (:class:`CheckpointRefused`) in one line naming the cause before anything is
opened or hashed: a manifest entry such as ``../../outside/file`` or an absolute path would otherwise let a crafted
checkpoint learn whether a file exists and whether its content matches a guess, and a symbolic link out of the
folder would be loaded. The model's memory is counted from its config (:mod:`diffattn.model.footprint`) before
the weights are read or the model is built. The format itself is :mod:`diffattn.checkpoint.format`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from diffattn.checkpoint.folder_kind import MANIFEST, CheckpointError
from diffattn.configs.run_config import RunConfig
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import ModelTooLarge, check_fits
from diffattn.system.atomic_files import Refused, UnsafePath, confined, file_sha256, read_json
from diffattn.system.atomic_files import printable as _p

FORMAT = "diffattn-checkpoint"
VERSION = 1
class CheckpointRefused(CheckpointError):
    """A checkpoint that is whole but must not be read here: a manifest entry that leads outside its folder, or a
    model larger than this machine's memory. Its older checkpoints share the cause: no fallback to them."""


def num_classes(run_config: RunConfig) -> int:
    """A classifier checkpoint's classify.num_classes (0 when absent, or not a classifier)."""
    n = run_config.classify.num_classes if run_config.task == "classify" else None
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def fits(cfg: ModelConfig, path: Path, **kw: Any) -> None:
    """:func:`~diffattn.model.footprint.check_fits` for the model of the checkpoint at ``path``, refused as a
    :class:`CheckpointRefused`."""
    try:
        check_fits(cfg, _p(path), **kw)
    except ModelTooLarge as e:
        raise CheckpointRefused(str(e)) from None


def in_folder(path: Path, name: object, what: str = "file") -> Path:
    """``path / name`` for a name the checkpoint's own files give (:func:`~diffattn.system.atomic_files.confined`:
    a plain file name that leads nowhere outside the folder); CheckpointRefused otherwise."""
    try:
        return confined(path, name, what=what)
    except UnsafePath as e:
        raise CheckpointRefused(str(e)) from None


def check_entries(path: Path, files: dict[str, Any]) -> None:
    """Every manifest entry is a plain file name in the folder with a {"sha256": str, "bytes": int} object,
    checked before any file is opened or hashed."""
    for name, meta in files.items():
        in_folder(path, name, f"{MANIFEST} entry")
        if not (isinstance(meta, dict) and isinstance(meta.get("sha256"), str) and isinstance(meta.get("bytes"), int)):
            raise CheckpointError(f"{_p(path)}: {MANIFEST} entry {_p(repr(name))} is not an object with a sha256 and "
                                  "a size in bytes; the checkpoint is damaged or not diffattn's")


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check the manifest and every file's size and sha256. Returns the manifest; raises CheckpointError
    (CheckpointRefused for an entry that would lead outside the folder, before anything is opened)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    mpath = in_folder(path, MANIFEST)
    if not mpath.is_file():
        raise CheckpointError(f"{path}: {MANIFEST} is missing (incomplete or not a diffattn checkpoint)")
    try:
        manifest = read_json(mpath)
    except Refused as e:  # a FIFO, nested too deeply: crafted, not damaged
        raise CheckpointRefused(f"{path}: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is corrupt: {e}") from e
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: unsupported checkpoint version {_p(repr(manifest.get('version')))} (expected {VERSION})"
        )
    check_entries(path, manifest["files"])
    for need in ("model.safetensors", "config.json"):
        if need not in manifest["files"]:
            raise CheckpointError(f"{path}: manifest lists no {need}")
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {_p(name)} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"{path}: file {_p(name)} is truncated or altered ({size} bytes, manifest says {meta['bytes']})"
            )
        if file_sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: file {_p(name)} is corrupt (sha256 mismatch)")
    return manifest
