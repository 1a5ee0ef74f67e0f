"""The reader of model folders. ``diffattn.load_pretrained(dir)`` and ``diffattn.load_pretrained_tokenizer(dir)``:
read a ``save_pretrained`` folder (:mod:`diffattn.model.pretrained`, which writes it) back as its own model
class, and its tokenizer; :func:`training_info` says what a training checkpoint records about its run, for the
model card.

The training checkpoint folder (:mod:`diffattn.checkpoint.format`: optimizer, RNG and train state, sha256) is separate;
:func:`load_pretrained` reads both, and every folder that holds one (run folders, convert outputs, study cells).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.constants import CONFIG_NAME
from torch import nn

from diffattn.checkpoint.folder_kind import (
    CHECKPOINT,
    PRETRAINED,
    TRANSFORMERS,
    NotAModelFolder,
    model_folder_kind,
    not_a_model_folder,
)
from diffattn.checkpoint.format import MANIFEST, Checkpoint, CheckpointError, load_checkpoint
from diffattn.checkpoint.hf_folder import read_hf_folder, read_tokenizer
from diffattn.checkpoint.run_folder import (
    LATEST,
    model_runs,
    open_checkpoint,
    previous_checkpoints,
    resolve_checkpoint_dir,
)
from diffattn.checkpoint.tied import tied_aliases
from diffattn.configs.run_config import ClassifyConfig, RunConfig
from diffattn.model.pretrained import TOKENIZER_FILE, PretrainedError, read_config
from diffattn.model.tokenizer import HFTokenizer, tokenizer_from_dict
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
from diffattn.system.atomic_files import Refused, UnsafePath, confined, printable, read_json


def _names_transformers(own: object) -> bool:
    """Whether a config.json (read) is a transformers model's: a ``model_type``, and neither diffattn's
    ``diffattn_class`` nor a checkpoint's ``run_config``."""
    return isinstance(own, dict) and "model_type" in own and not {"diffattn_class", "run_config"} & set(own)


def transformers_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a transformers model folder (``save_pretrained`` there: a config.json with a
    ``model_type`` and neither diffattn's ``diffattn_class`` nor a checkpoint's ``run_config``), such as the Llama
    a user converted from: read with :func:`diffattn.checkpoint.hf_folder.read_hf_folder`, so the source and its
    conversion are evaluated alike."""
    p = Path(path)
    try:  # a config.json linked out of the folder is not read here: _pretrained_folder refuses the folder
        if not confined(p, CONFIG_NAME).is_file() or (p / MANIFEST).is_file():
            return False
        return _names_transformers(read_json(p / CONFIG_NAME))
    except (OSError, ValueError):  # UnsafePath, UnreadableInput, UnicodeDecodeError, JSONDecodeError: not one
        return False


def _transformers_model(path: str | os.PathLike) -> TransformerLM:
    try:
        return read_hf_folder(path)
    except ValueError as e:  # what our models cannot express, what the folder lacks, an entry out of it
        raise PretrainedError(f"{printable(path)}: a transformers folder diffattn cannot read: "
                              f"{printable(e)}") from None


def _transformers_tokenizer(path: str | os.PathLike) -> HFTokenizer | None:
    try:
        return read_tokenizer(path)
    except ValueError as e:  # UnsafePath too
        raise PretrainedError(printable(e)) from None


def _pretrained_folder(path: str | os.PathLike) -> Path | None:
    """``path`` when it is a save_pretrained folder, None when it may hold a training checkpoint instead (a run
    folder, its ckpt/, a convert output, a study cell or a compare model run). A config.json that is neither a
    checkpoint's nor ours raises read_config's error."""
    p = Path(path)
    try:  # a folder that holds no model (or does not exist) is refused as every reader refuses it
        model_folder_kind(p)
    except NotAModelFolder as e:
        raise PretrainedError(str(e)) from None
    if not p.is_dir():  # a run's ckpt/ that a save moved aside or that was deleted: its run falls back
        return None
    try:
        for name in (CONFIG_NAME, MANIFEST, TOKENIZER_FILE):  # read below: none through a link out of the folder
            confined(p, name)
        if model_runs(p):  # a comparison folder (its config.json is compare's settings): the resolver names them
            return None
    except (UnsafePath, CheckpointError) as e:  # CheckpointRefused: a model folder linked out of a comparison
        raise PretrainedError(str(e)) from None
    if (p / CONFIG_NAME).is_file() and not (p / MANIFEST).is_file():
        try:
            own = read_json(p / CONFIG_NAME)
        except Refused as e:
            raise PretrainedError(str(e)) from None
        except (OSError, ValueError):  # not JSON: read_config says so
            own = None
        if not (isinstance(own, dict) and "run_config" in own):  # a checkpoint that lost its manifest
            read_config(p)
            return p
    if (p / MANIFEST).is_file() or (p / LATEST).is_dir() or list(p.glob(".*.old-*")) or previous_checkpoints(p):
        return None
    raise PretrainedError(str(not_a_model_folder(p, f"it holds no {MANIFEST} or {CONFIG_NAME}")))


def _checkpoint(path: Path, tensors: bool = True) -> Any:
    try:
        return open_checkpoint(path, tensors=tensors)
    except CheckpointError as e:
        raise PretrainedError(str(e)) from None


@dataclass(frozen=True)
class ModelFolder:
    """A model folder opened, its kind decided once (:func:`model_folder`): :data:`TRANSFORMERS`, :data:`PRETRAINED`
    (a save_pretrained folder) or :data:`CHECKPOINT` (a folder holding a training checkpoint: open_checkpoint)."""

    path: Path
    kind: str


def model_folder(path: str | os.PathLike) -> ModelFolder:
    """Open ``path`` as a model folder: decide which reader takes it, once (:class:`ModelFolder`); a folder none
    takes raises PretrainedError naming why (a comparison folder is left to the checkpoint reader, which names its
    models)."""
    if transformers_folder(path):  # a transformers Llama / DiffLlama folder (the model a user converted)
        return ModelFolder(Path(path), TRANSFORMERS)
    folder = _pretrained_folder(path)
    return ModelFolder(Path(path), CHECKPOINT) if folder is None else ModelFolder(folder, PRETRAINED)


def load_pretrained(path: str | os.PathLike | ModelFolder, *, map_location: str = "cpu"):
    """The model in any folder diffattn writes, as its own class (TransformerLM, TransformerEncoder or
    TransformerClassifier), in eval mode: a ``save_pretrained`` folder, a run folder (``diffattn train --out``;
    its newest good checkpoint) or its ``ckpt/``, a ``diffattn convert`` output, a ``diffattn study`` cell
    (``DIR/cells/<cell>``) or a ``compare`` model run (``DIR/runs/<model>``), or a transformers folder; or a
    :class:`ModelFolder` already opened. Local folders only; weights must match exactly; nothing is unpickled. A
    comparison folder holds several models: the error names them."""
    folder = path if isinstance(path, ModelFolder) else model_folder(path)
    if folder.kind == TRANSFORMERS:
        return _transformers_model(folder.path).to(map_location).eval()
    if folder.kind == CHECKPOINT:
        return _checkpoint(folder.path).build_model().to(map_location).eval()
    classes = {c.__name__: c for c in (TransformerLM, TransformerEncoder, TransformerClassifier)}
    name = read_config(folder.path)["diffattn_class"]
    if name not in classes:
        raise PretrainedError(f"{folder.path}: unknown diffattn_class {name!r}; known: {sorted(classes)}")
    return classes[name].from_pretrained(folder.path, map_location=map_location)


def load_pretrained_tokenizer(path: str | os.PathLike | ModelFolder):
    """The tokenizer saved with the model in ``path`` (any folder :func:`load_pretrained` reads, or a
    :class:`ModelFolder`), or None when none was saved."""
    folder = path if isinstance(path, ModelFolder) else model_folder(path)
    if folder.kind == TRANSFORMERS:
        return _transformers_tokenizer(folder.path)
    if folder.kind == CHECKPOINT:
        return _checkpoint(folder.path, tensors=False).tokenizer
    f = folder.path / TOKENIZER_FILE
    if not f.is_file():
        return None
    try:
        return tokenizer_from_dict(read_json(f))
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:  # JSONDecodeError is a ValueError
        raise PretrainedError(f"{f}: not a valid tokenizer: {printable(e)}") from None


def is_pretrained_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a save_pretrained folder (config.json naming a diffattn class, or a transformers
    model folder; no checkpoint manifest), as opposed to a folder that holds a training checkpoint."""
    p = Path(path)
    if not (p / CONFIG_NAME).is_file() or (p / MANIFEST).is_file() or model_runs(p):
        return False
    try:
        confined(p, CONFIG_NAME)
        own = read_json(p / CONFIG_NAME)
    except Refused:
        return True  # load_pretrained refuses it, naming the link (or the file)
    except (OSError, ValueError):
        return False
    return isinstance(own, dict) and "diffattn_class" in own or _names_transformers(own)


_TASKS = {"TransformerLM": "lm", "TransformerClassifier": "classify", "TransformerEncoder": "encoder"}


@dataclass
class LoadedCheckpoint(Checkpoint):
    """A model folder read whole (a save_pretrained or transformers folder): its ``state_dict`` is the loaded
    model's own tensors, and :meth:`build_model` returns that model instead of building a second one (a 0.5B
    model read twice held 5 GB)."""

    model: nn.Module | None = None

    def build_model(self) -> nn.Module:
        return self.model if self.model is not None else super().build_model()


def open_model_folder(path: str | os.PathLike) -> Checkpoint:
    """The model in any folder :func:`load_pretrained` reads, as a :class:`Checkpoint`: what ``diffattn info``,
    ``generate`` and ``eval`` read. A checkpoint folder (a run folder, its ``ckpt/``, a convert output, a study
    cell) is loaded as it is; a save_pretrained folder gives its config, weights and tokenizer, with no training
    state and no data (its run_config holds the task, the model and a classifier's head). Raises
    CheckpointError."""
    if not is_pretrained_folder(path):
        return open_checkpoint(path)  # a run folder whose ckpt/ is damaged or gone: its newest good older one
    try:
        folder = model_folder(path)  # its kind decided once, for the model and the tokenizer
        model, tokenizer = load_pretrained(folder), load_pretrained_tokenizer(folder)
    except PretrainedError as e:
        raise CheckpointError(str(e)) from None
    task = _TASKS[type(model).__name__]
    head = ClassifyConfig(**model.pretrained_kwargs()) if task == "classify" else None
    state = model.state_dict()
    return LoadedCheckpoint(path=Path(path), run_config=RunConfig.of_model(model.config, task, head),
                            state_dict=state, tokenizer=tokenizer, tied=tied_aliases(state), model=model)


def training_info(checkpoint: Checkpoint | str | os.PathLike) -> dict[str, Any]:
    """What a training checkpoint records about its run, as the ``training`` argument of ``save_pretrained``: the
    data (its file or folder name, not this machine's path, and each file's sha256, or the synthetic task), the
    checkpoint (its run folder's name and ``ckpt``), steps, tokens seen, the last training and validation loss,
    the best validation loss and, for a classifier, the validation accuracy. Absent values are left out.

    ``checkpoint``: a run folder (``diffattn train --out DIR``) or its ``ckpt/``, any folder ``diffattn info``
    reads, or a loaded :class:`~diffattn.checkpoint.format.Checkpoint`."""
    if isinstance(checkpoint, (str, os.PathLike)):
        checkpoint = load_checkpoint(resolve_checkpoint_dir(checkpoint), tensors=False)
    elif not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"training_info takes a run folder (or its ckpt/) or a Checkpoint, got "
                        f"{type(checkpoint).__name__}")
    data = checkpoint.run_config.data
    fingerprint = data.fingerprint or {}
    state = checkpoint.train_state or {}
    history = state.get("history") or []
    last_val = next((r["val_loss"] for r in reversed(history) if r.get("val_loss") is not None), None)
    where = Path(checkpoint.path).absolute()
    data_path = fingerprint.get("path") or data.path
    info = {  # names, not this machine's absolute paths: the card is meant to be shared
        "checkpoint": "/".join(where.parts[-2:]) if where.name == LATEST else where.name,
        "data": Path(data_path).name if data_path else None,
        "data_sha256": {name: meta["sha256"] for name, meta in (fingerprint.get("files") or {}).items()} or None,
        "synthetic": data.synthetic,
        "steps": state.get("step"),
        "tokens_seen": state.get("tokens_seen") or None,
        "final_train_loss": history[-1].get("train_loss") if history else None,
        "final_val_loss": last_val,
        "best_val_loss": state.get("best_val_loss"),
        "val_accuracy": state.get("val_accuracy"),
    }
    return {k: v for k, v in info.items() if v is not None}
