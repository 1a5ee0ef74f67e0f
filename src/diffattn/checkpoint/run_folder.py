"""The checkpoints of a run folder, and finding the checkpoint in any folder diffattn writes.

A run folder (``diffattn train --out DIR``, a study cell, a compare model run) keeps its newest checkpoint in
``DIR/ckpt`` (:data:`LATEST`) and the older kept ones beside it as ``ckpt-step-<N>`` (:data:`PREVIOUS`);
:func:`load_run_checkpoint` falls back from a damaged ``ckpt`` to the newest good older one.
:func:`resolve_checkpoint_dir` and :func:`open_checkpoint` take a run folder, its ``ckpt/`` or a checkpoint folder
(``convert --out``); :func:`model_runs` lists the models of a comparison folder (``compare --out DIR``, a study).
The format of one checkpoint is :mod:`diffattn.checkpoint.format`'s.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from diffattn.checkpoint.atomic_folder import leftover_old
from diffattn.checkpoint.best import BEST, describe_best
from diffattn.checkpoint.folder_kind import (
    COMPARISON_MARKERS,
    COMPARISON_SUBDIRS,
    LATEST,
    PREVIOUS,
    model_folder_kind,
)
from diffattn.checkpoint.format import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointRefused,
    in_folder,
    load_checkpoint,
)
from diffattn.checkpoint.train_state import MAX_COUNT
from diffattn.system.atomic_files import printable, read_json


def checkpoint_step(path: Path) -> int | None:
    """The training step recorded in a checkpoint's config.json (without verifying it), or None."""
    try:
        step = read_json(path / "config.json")["train_state"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_COUNT else None


def previous_checkpoints(run_dir: Path) -> list[Path]:
    """The older kept checkpoints of a run folder, newest first."""
    found = []
    for p in run_dir.glob(PREVIOUS + "*"):
        tail = p.name[len(PREVIOUS):]
        if p.is_dir() and tail.isdigit():
            found.append((int(tail), p))
    return [p for _, p in sorted(found, reverse=True)]


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Keep the newest checkpoint and the ``keep - 1`` newest older ones; remove the rest."""
    for p in previous_checkpoints(run_dir)[max(keep - 1, 0):]:
        shutil.rmtree(p, ignore_errors=True)


def load_run_checkpoint(run_dir: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                        stream: bool = False) -> Checkpoint:
    """Load a run folder's newest good checkpoint: ``ckpt``, or, if that one is missing, corrupt or truncated,
    the newest older kept one that verifies (with a warning naming both). ``stream``: see
    :func:`~diffattn.checkpoint.format.load_checkpoint`."""
    run_dir = Path(run_dir)
    candidates = [run_dir / LATEST, *previous_checkpoints(run_dir)]
    errors: list[str] = []
    for cand in candidates:
        try:
            in_folder(run_dir, cand.name, "checkpoint folder")  # not a link out of the run folder
            checkpoint = load_checkpoint(cand, map_location, stream=stream)
        except CheckpointRefused:
            raise  # the run's other checkpoints share its config and folder: none of them would do
        except CheckpointError as e:
            errors.append(str(e))
            continue
        if errors:
            warnings.warn(
                f"{candidates[0]} cannot be used ({errors[0]}); falling back to the previous checkpoint {cand} "
                f"(step {checkpoint.train_state.get('step', '?')})",
                stacklevel=2,
            )
        return checkpoint
    raise CheckpointError("; ".join(errors) if errors else f"{run_dir}: no checkpoint found")


def open_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    tensors: bool = True) -> Checkpoint:
    """The checkpoint of any folder diffattn writes that holds one (see :func:`resolve_checkpoint_dir`): a run
    folder gives its newest good checkpoint (:func:`load_run_checkpoint`), any other its own checkpoint."""
    if Path(path).name == LATEST and previous_checkpoints(Path(path).parent):
        path = Path(path).parent  # a run's ckpt/: its older checkpoints are the fallback, as for the run folder
    where = resolve_checkpoint_dir(path)
    if where == Path(path) / LATEST:
        if not tensors:  # the JSON parts are the same in every checkpoint of a run; ckpt/ is the one to check
            return load_checkpoint(where, map_location, tensors=False)
        return load_run_checkpoint(path, map_location)
    return load_checkpoint(where, map_location, tensors=tensors)


def model_runs(path: str | os.PathLike) -> dict[str, Path]:
    """The models of a comparison folder, {name: run folder}, sorted by name: ``diffattn compare --out DIR``
    keeps each model's run in ``DIR/runs/<name>/`` and ``diffattn study`` each cell's in ``DIR/cells/<name>/``.
    Only run folders holding a checkpoint (``ckpt/`` with a manifest) count, and only in a folder with one of
    :data:`COMPARISON_MARKERS`; empty for any other folder. A model folder (or ``runs/``, ``cells/``) that is a
    link out of the comparison folder is refused (CheckpointRefused): nothing outside the folder given is read."""
    path = Path(path)
    if not any((path / m).is_file() for m in COMPARISON_MARKERS):
        return {}
    found: dict[str, Path] = {}
    for sub in COMPARISON_SUBDIRS:
        d = in_folder(path, sub, "folder")
        if not d.is_dir():
            continue
        for run in sorted(d.iterdir()):
            in_folder(d, run.name, "model folder")
            if (run / LATEST / MANIFEST).is_file() and run.name not in found:
                found[run.name] = run
    return dict(sorted(found.items()))


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory a command should load for ``path``: a run folder, whose checkpoint is ``DIR/ckpt``
    (``diffattn train --out DIR``, a ``diffattn study`` cell ``DIR/cells/<cell>``, a ``compare --out DIR`` model
    run ``DIR/runs/<model>``), or a checkpoint folder itself (``ckpt/``, a ``diffattn convert --out`` folder).

    A candidate holds a checkpoint when it has a manifest. When neither does, a candidate that looks like a
    damaged checkpoint (config or weights without a manifest, or a copy a crashed save moved aside) is
    returned, so that :func:`load_checkpoint` reports the damage (or recovers the copy). A comparison folder
    (:func:`model_runs`) raises a CheckpointError naming its models; a folder that holds no model at all
    :class:`~diffattn.checkpoint.folder_kind.NotAModelFolder` (the message every reader gives). Otherwise (a
    transformers or save_pretrained folder, which holds no checkpoint) a CheckpointError names both places looked
    at.
    """
    # Extend here when ckpt/ holds several checkpoints: pick the newest complete one among them.
    path = Path(path)
    candidates = (path, path / LATEST)
    in_folder(path, LATEST, "checkpoint folder")  # a run's ckpt/ is never read through a link out of it
    for c in candidates:
        if (c / MANIFEST).is_file():
            return c
    models = model_runs(path)
    if models:  # a comparison folder: several models, so no single checkpoint to pick
        names = list(models)
        raise CheckpointError(
            f"{path} is a comparison folder holding {len(names)} models ({', '.join(names[:6])}"
            f"{', ...' if len(names) > 6 else ''}): give one of them, e.g. {models[names[0]]} "
            "(diffattn eval takes the folder itself: it evaluates each model, or the one named by --model NAME)"
        )
    model_folder_kind(path)  # a folder that holds no model (or does not exist): NotAModelFolder, as every reader
    for c in candidates:
        damaged = (c / "config.json").is_file() or (c / "model.safetensors").is_file()
        if damaged or leftover_old(c) is not None:
            return c
    if previous_checkpoints(path):  # ckpt/ was deleted: open_checkpoint falls back to the newest older one
        return path / LATEST
    raise CheckpointError(  # a model folder, but no diffattn checkpoint (a transformers or save_pretrained one)
        f"{path}: no checkpoint here: neither {path / MANIFEST} nor {path / LATEST / MANIFEST} exists; "
        "give a run folder (diffattn train --out DIR) or its ckpt/ folder"
    )


CHOICES = ("last", "best")  # which of a run's checkpoints a reader takes (eval/export --checkpoint)


def pick_checkpoint(path: str | os.PathLike, which: str = "last") -> Path:
    """The folder to read for ``which`` of a run's checkpoints: ``path`` itself for "last" (readers then take its
    newest good checkpoint, :func:`open_checkpoint`), the run's best checkpoint ``RUN/best``
    (:mod:`diffattn.checkpoint.best`) for "best", from the run folder or any checkpoint folder in it. Raises
    CheckpointError when there is none, saying why."""
    if which not in CHOICES:
        raise CheckpointError(f"--checkpoint must be one of {', '.join(CHOICES)}, got {which!r}")
    p = Path(path)
    if which == "last":
        return p
    run = p.parent if p.name in (LATEST, BEST) or p.name.startswith(PREVIOUS) else p
    if (in_folder(run, BEST, "checkpoint folder") / MANIFEST).is_file():  # never a link out of the run
        return run / BEST
    raise CheckpointError(f"{path}: no best checkpoint ({run / BEST} does not exist: a run writes it at each "
                          "evaluation that improves its validation loss, or a classifier's accuracy; a run that "
                          "never evaluated, or one trained before diffattn kept it, has none); use --checkpoint last")


def best_note(path: str | os.PathLike, step: int | None) -> str | None:
    """A note for a reader of a run's last checkpoint (at ``step``) when the run's best one is another: where it
    is, what it scored, and how to read it; None otherwise."""
    p = Path(path)
    run = p.parent if p.name in (LATEST, BEST) or p.name.startswith(PREVIOUS) else p
    if p.name == BEST or not (in_folder(run, BEST, "checkpoint folder") / MANIFEST).is_file():
        return None
    best = load_checkpoint(run / BEST, tensors=False).train_state.get("best")
    if not best or best.get("step") == step:
        return None
    return printable(f"note: this is the run's last checkpoint (step {step}); its best, {describe_best(best)}, is "
                     f"in {run / BEST}: --checkpoint best reads that one")
