"""Which kind of model folder a path is, told from its names and its ``config.json`` alone: light (no torch, no
tensor read), so that every command that takes a model folder refuses one that holds no model before it imports
the library, in one message that says what a model folder holds (:data:`MODEL_FOLDER`).

The kinds: a diffattn checkpoint (``manifest.json``: ``convert --out``, a run's ``ckpt/``; also one that lost its
manifest, which the reader then names), a run folder (``train --out``: ``ckpt/``, ``ckpt-step-N``, a checkpoint a
crashed save moved aside), a comparison folder (``compare --out``, ``study --out``: its models in ``runs/`` or
``cells/``), a save_pretrained folder (``config.json`` naming a ``diffattn_class``) and a transformers folder
(``config.json`` with a ``model_type``, such as the Llama a user converts, or an export). Whether the folder's
contents are whole and safe to read is the readers' business
(:mod:`~diffattn.checkpoint.verify`, :mod:`~diffattn.checkpoint.model_folders`): this only sorts, and defers
to them whatever it cannot read (a link out of the folder, a config that is not JSON), so they name the cause.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffattn.system.atomic_files import Refused, confined, printable, read_json

MANIFEST = "manifest.json"  # a checkpoint's file list and hashes (diffattn.checkpoint.verify)
LATEST = "ckpt"  # a run folder's newest checkpoint; older kept ones are ckpt-step-<N> beside it
PREVIOUS = "ckpt-step-"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
COMPARISON_SUBDIRS = ("runs", "cells")  # `compare --out DIR`: DIR/runs/<model>/; `study --out DIR`: DIR/cells/<cell>/
# Files that only a comparison folder has beside runs/ or cells/ (a project folder's runs/ alone is not one):
# compare's report and settings, the --data experiment's spec, Optuna journal and event log.
COMPARISON_MARKERS = ("results.json", "config.json", "command.txt", "report.md", "summary.md", "study.json",
                      "optuna.journal", "events.log")

CHECKPOINT, RUN, COMPARISON, PRETRAINED, TRANSFORMERS = "checkpoint", "run", "comparison", "pretrained", "transformers"

#: What every command that reads a model says of a folder that holds none.
MODEL_FOLDER = ("a model folder holds a diffattn checkpoint (manifest.json: convert --out, a run's ckpt/), a run "
                "(ckpt/: train --out DIR), a save_pretrained folder (config.json naming its diffattn_class) or a "
                "transformers model (config.json with a model_type, and its *.safetensors)")


class CheckpointError(Refused):
    """A checkpoint directory is missing, incomplete or corrupt."""


class NotAModelFolder(CheckpointError):
    """A path given as a model folder that holds no model (or does not exist): one message for every command."""


def not_a_model_folder(path: str | os.PathLike, why: str) -> NotAModelFolder:
    """The refusal of ``path``, ``why`` saying what was found instead ("it does not exist", ...)."""
    return NotAModelFolder(f"{printable(str(path))}: not a model folder ({why}); {MODEL_FOLDER}")


def model_folder_kind(path: str | os.PathLike) -> str:
    """The kind of model folder ``path`` is (:data:`CHECKPOINT`, :data:`RUN`, :data:`COMPARISON`,
    :data:`PRETRAINED`, :data:`TRANSFORMERS`), from its names and its config.json; raises
    :class:`NotAModelFolder` for a path that holds none. Nothing but config.json is read (bounded, through no
    link), and no link in the folder is followed (names are looked up with ``lexists``); a folder whose
    config.json cannot be read is handed on as a checkpoint, whose reader says why."""
    p = Path(path)
    if _moved_aside(p.parent, p.name) or (p.name == LATEST and _previous(p.parent)):
        return RUN  # a run's ckpt/ replaced by a save that died, or deleted: its reader falls back
    if not p.is_dir():
        raise not_a_model_folder(p, "it is a file, not a folder" if p.exists() else
                                 "it does not exist: diffattn reads local folders only")
    if os.path.lexists(p / MANIFEST):
        return CHECKPOINT
    if os.path.lexists(p / LATEST) or _previous(p) or _moved_aside(p, LATEST):
        return RUN
    own = _config(p)
    if own is _UNREADABLE:
        return CHECKPOINT
    if isinstance(own, dict):
        if "run_config" in own:  # a checkpoint that lost its manifest
            return CHECKPOINT
        if "diffattn_class" in own:
            return PRETRAINED
        if "model_type" in own:
            return TRANSFORMERS
    if any(os.path.lexists(p / m) for m in COMPARISON_MARKERS) and any(
            os.path.lexists(p / d) for d in COMPARISON_SUBDIRS):
        return COMPARISON  # its reader lists the models (or says it holds none yet)
    if os.path.lexists(p / WEIGHTS):  # weights without a config or manifest: a damaged checkpoint
        return CHECKPOINT
    if own is not None:
        raise not_a_model_folder(p, f"its {CONFIG} names no model: no model_type, diffattn_class or run_config")
    raise not_a_model_folder(p, "it is empty" if not _names(p) else
                             f"it holds no {MANIFEST}, {LATEST}/ or {CONFIG}")


_UNREADABLE = object()


def _config(folder: Path) -> object:
    """The folder's config.json: None when there is none, :data:`_UNREADABLE` when it cannot be read here."""
    if not os.path.lexists(folder / CONFIG):
        return None
    try:
        return read_json(confined(folder, CONFIG))  # a link out of the folder is refused, not followed
    except (OSError, ValueError):  # UnsafePath, UnreadableInput (a FIFO, too large), not UTF-8, not JSON
        return _UNREADABLE


def _names(folder: Path) -> list[str]:
    """The names in ``folder`` (none when it cannot be listed)."""
    try:
        with os.scandir(folder) as entries:
            return [e.name for e in entries]
    except OSError:
        return []


def _previous(folder: Path) -> bool:
    """Whether ``folder`` keeps an older checkpoint of a run (``ckpt-step-<N>``)."""
    return any(n.startswith(PREVIOUS) and n[len(PREVIOUS):].isdigit() for n in _names(folder))


def _moved_aside(folder: Path, name: str) -> bool:
    """Whether a save that died between its two renames left ``folder/.NAME.old-*``."""
    return any(n.startswith(f".{name}.old-") for n in _names(folder))
