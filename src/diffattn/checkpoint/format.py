"""Checkpoints: a directory of safetensors + JSON files, written atomically and verified by sha256 on load.

:func:`save_checkpoint` writes one; :func:`load_checkpoint` verifies and reads one as a :class:`Checkpoint`, whose
``run_config`` is the typed :class:`~diffattn.configs.run_config.RunConfig` the run was given (old layouts read
as it is now); a missing, corrupt or truncated file is a :class:`CheckpointError` naming it.

A run folder's checkpoints (ckpt/ and the kept ckpt-step-N), and finding the checkpoint of any folder diffattn
writes, are :mod:`diffattn.checkpoint.run_folder`'.

Layout of a checkpoint directory::

    manifest.json          format version + sha256 and size of every other file
    config.json            run_config (with the "model" section), tokenizer dict, train_state, tied aliases
    model.safetensors      weights (tied weights stored once; the aliases are re-created on load)
    optimizer.safetensors  optimizer tensors (optional) ...
    optimizer.json         ... and its non-tensor parts (param groups, state scalars)
    rng.safetensors        RNG states as uint8 tensors (optional)

Nothing is ever unpickled. A checkpoint is first written into a temp directory next to the target, every file
and the directory are fsynced, and then it is renamed into place (an existing checkpoint is renamed aside
first and removed only after the new one is in place), so a crash leaves either the old or the new checkpoint
(:mod:`diffattn.checkpoint.atomic_folder`). Tied weights are stored once (:mod:`diffattn.checkpoint.tied`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffattn.checkpoint.atomic_folder import leftover_old, publish_folder, read_settled, temp_folder
from diffattn.checkpoint.optimizer_state import merge_optimizer_state, split_optimizer_state
from diffattn.checkpoint.tensor_files import gathered
from diffattn.checkpoint.tensor_files import write as write_tensors
from diffattn.checkpoint.tied import dedup_state_dict
from diffattn.checkpoint.train_state import check_tokenizer_fits, check_train_state
from diffattn.checkpoint.verify import (  # noqa: F401 (the format's names, read from here by every layer)
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    CheckpointRefused,
    fits,
    in_folder,
    num_classes,
    verify_checkpoint,
)
from diffattn.configs.run_config import RunConfig
from diffattn.model.config import ModelConfig
from diffattn.model.shapes import weights_mismatch
from diffattn.model.tokenizer import tokenizer_from_dict
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
from diffattn.system.atomic_files import (
    UnreadableInput,
    as_umask_allows,
    file_sha256,
    fsync_dir,
    fsync_file,
    names_path,
    read_json,
)
from diffattn.system.atomic_files import printable as _p
from diffattn.system.io_errors import io_error_in

PT = {"format": "pt"}  # the safetensors metadata torch's own writers put in


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint. ``state_dict`` has every model key (tied aliases included)."""

    path: Path
    run_config: RunConfig
    state_dict: dict[str, Tensor]
    tokenizer: Any = None
    train_state: dict[str, Any] = field(default_factory=dict)
    optimizer_state: dict[str, Any] | None = None
    rng: dict[str, Tensor] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    # loaded with stream=True: the weights and optimizer state were left in the files, to be read into a live
    # model and optimizer one tensor at a time (diffattn.train.run_state.restore)
    streamed: bool = False

    @property
    def task(self) -> str:
        return self.run_config.task

    @property
    def model_config(self) -> ModelConfig:
        return self.run_config.model

    def build_model(self) -> nn.Module:
        """Instantiate the model of ``run_config`` and load the weights (strict)."""
        classes = num_classes(self.run_config)
        if self.task == "classify" and classes < 2:
            raise CheckpointError(f"{self.path}: classify checkpoint without classify.num_classes in config.json")
        fits(self.model_config, self.path, copies=1, num_classes=classes)
        if self.task == "classify":
            model: nn.Module = TransformerClassifier(self.model_config, classes, self.run_config.classify.pooling)
        elif self.task == "encoder":  # only a save_pretrained folder holds one (diffattn.checkpoint.model_folders)
            model = TransformerEncoder(self.model_config)
        else:
            model = TransformerLM(self.model_config)
        try:
            model.load_state_dict(self.state_dict, strict=True)
        except RuntimeError as e:  # torch lists every key on many lines: one phrase says the first difference
            why = weights_mismatch(self.model_config, {k: tuple(v.shape) for k, v in self.state_dict.items()},
                                   task=self.task, num_classes=classes)
            raise CheckpointError(f"{self.path}: weights do not match the model config: "
                                  f"{why or _p(str(e).strip().splitlines()[0])}") from None
        retrofit = self.run_config.retrofit
        if retrofit.active:  # a checkpoint saved mid-schedule is the model as it trained at that step
            s = retrofit.schedule(int(self.train_state.get("step", retrofit.steps)))
            for m in model.modules():
                if getattr(m, "retrofit_s", None) is not None:
                    m.set_retrofit(s)
        return model


# ------------------------------------------------------------------------------------------------------ save


def _write_json(path: Path, obj: Any) -> None:
    with names_path(path), open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1, allow_nan=True, sort_keys=False) + "\n")


def _save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file; a storage failure (it reports "... (os error 28)") becomes the OSError naming the
    file, as every other write's does (the command prints it as one line, exit 74)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        err = io_error_in(e)
        if err is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from e


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module | Mapping[str, Tensor],
    *,
    run_config: RunConfig | Mapping[str, Any],
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    train_state: dict | None = None,
    rng: Mapping[str, Tensor] | None = None,
    keep_previous_as: str | os.PathLike | None = None,
) -> None:
    """Write a checkpoint directory at ``path`` atomically (replacing an existing one).

    ``keep_previous_as``: where the checkpoint this one replaces is kept (renamed, after the new one is in
    place); by default it is removed.

    ``model``: a module (its ``state_dict()`` is saved) or an already-gathered full state dict (FSDP).
    ``optimizer``: an optimizer or its (full) state dict. ``tokenizer``: has ``to_dict()``, or is a dict.
    ``rng``: named RNG states (uint8 tensors, e.g. ``torch.get_rng_state()`` and the data generator's state).
    ``run_config``: the run's :class:`~diffattn.configs.run_config.RunConfig`, or its dict layout; a layout without
    a "model" section records ``model.config`` there.
    """
    path = Path(path)
    if isinstance(run_config, RunConfig):
        run_config = run_config.to_dict()
    run_config = json.loads(json.dumps(run_config))  # deep copy; fails early if not JSON-able
    model_state = model.state_dict() if isinstance(model, nn.Module) else model
    if "model" not in run_config:
        cfg = getattr(model, "config", None)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(
                "save_checkpoint: run_config has no 'model' section and the model has no ModelConfig"
            )
        run_config["model"] = cfg.to_dict()
    ModelConfig.from_dict(run_config["model"])  # refuse to write a checkpoint that could not be rebuilt
    if rng:
        bad = [k for k, v in rng.items() if not isinstance(v, Tensor) or v.dtype != torch.uint8]
        if bad:
            raise ValueError(f"save_checkpoint: rng states must be uint8 tensors; bad entries: {bad}")
    tok = tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else tokenizer
    weights, tied = dedup_state_dict(model_state)
    optimizer_state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    config = {"run_config": run_config, "tokenizer": tok, "train_state": train_state or {}, "tied": tied}

    with temp_folder(path) as tmp:
        digests = _write_files(tmp, weights, optimizer_state, rng, config)
        _write_manifest(tmp, digests)
        _publish(tmp, path, Path(keep_previous_as) if keep_previous_as is not None else None)


def _write_files(folder: Path, weights: dict[str, Tensor], optimizer_state: Mapping[str, Any] | None,
                 rng: Mapping[str, Tensor] | None, config: dict[str, Any]) -> dict[str, str | None]:
    """Write every file of a checkpoint but the manifest into ``folder``. Returns {file: its sha256, or None
    where it was not hashed while written}, in the order the files were written."""
    # tensor by tensor, hashed while written: a save adds one tensor's copy at most to memory
    digests: dict[str, str | None] = {
        "model.safetensors": write_tensors(folder / "model.safetensors", list(weights.items()), PT)}
    if optimizer_state is not None:
        otensors, ometa = split_optimizer_state(optimizer_state)
        digests["optimizer.safetensors"] = write_tensors(folder / "optimizer.safetensors",
                                                         list(otensors.items()), PT)
        _write_json(folder / "optimizer.json", ometa)
        digests["optimizer.json"] = None
    if rng:
        _save_tensors({k: v.detach().cpu().contiguous().clone() for k, v in rng.items()},
                      folder / "rng.safetensors")
        digests["rng.safetensors"] = None
    _write_json(folder / "config.json", config)
    digests["config.json"] = None
    return digests


def _write_manifest(folder: Path, digests: Mapping[str, str | None]) -> None:
    """The manifest: the format, its version and the sha256 and size of every file in ``digests``."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__,
        "files": {f: {"sha256": digest or file_sha256(folder / f), "bytes": (folder / f).stat().st_size}
                  for f, digest in digests.items()},
    }
    _write_json(folder / MANIFEST, manifest)


def _publish(tmp: Path, path: Path, keep_as: Path | None) -> None:
    """Make the written folder readable as the umask allows, fsync it, and rename it into place."""
    as_umask_allows(tmp)  # mkdtemp's 0700 (and safetensors' 0600 files) would keep a shared checkpoint private
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    publish_folder(tmp, path, keep_as)


def gather_for_save(model_state: Mapping[str, Tensor], optimizer_state: Mapping[str, Any] | None) -> None:
    """What a rank that does not write takes part in while rank 0 runs :func:`save_checkpoint` on the same
    state: the gathers of its sharded (DTensor) tensors, in the order they are written. Nothing when no tensor
    is sharded."""
    weights, _ = dedup_state_dict(model_state)
    items = list(weights.items())
    if optimizer_state is not None:
        items += list(split_optimizer_state(optimizer_state)[0].items())
    if any(hasattr(t, "full_tensor") for _, t in items):
        for _ in gathered(items):
            pass


# ------------------------------------------------------------------------------------------------------ load


def _load_tensors(path: Path, name: str, device: str | torch.device) -> dict[str, Tensor]:
    try:
        return load_file(str(path / name), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: file {name} cannot be read: {e}") from e


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    tensors: bool = True, stream: bool = False) -> Checkpoint:
    """Verify every file of the checkpoint at ``path``, then load it; CheckpointError names a bad file.

    A run that is training replaces its checkpoint while others read it (``eval``, ``generate``, ``info``): if
    the folder at ``path`` changed during the read, it is read again
    (:func:`~diffattn.checkpoint.atomic_folder.read_settled`), so a reader never mixes the files of two
    checkpoints nor reports a half-replaced one as corrupt.

    If ``path`` is gone but a save died between its two renames, the complete previous checkpoint it moved
    aside is loaded instead (with a warning). ``tensors=False`` verifies everything but reads only the JSON
    parts (config, tokenizer, train state): ``state_dict``, the optimizer and RNG states are left empty.
    ``stream=True`` reads the RNG states too but leaves the weights and optimizer state in their files
    (``streamed``), for :func:`diffattn.train.run_state.restore` to read into the live model one tensor at a
    time."""
    path = Path(path)
    return read_settled(path, lambda: _load_checkpoint_once(path, map_location, tensors, stream))


def _load_checkpoint_once(path: Path, map_location: str | torch.device, tensors: bool, stream: bool) -> Checkpoint:
    if not path.exists():
        old = leftover_old(path)
        if old is not None:
            warnings.warn(f"{path} is missing; loading the previous checkpoint left at {old}", stacklevel=5)
            path = old
    manifest = verify_checkpoint(path)
    files = manifest["files"]
    try:
        cfg = read_json(path / "config.json")
        tied = cfg.get("tied") or {}
        if "model" not in cfg["run_config"]:
            raise KeyError("model")
        run_config = RunConfig.from_dict(cfg["run_config"])  # the typed run config, old layouts included
        model_config = run_config.model
        if not (isinstance(tied, dict) and all(isinstance(v, str) for v in tied.values())):
            raise TypeError("'tied' must be an object")
        train_state = check_train_state(cfg.get("train_state") or {})  # every reader may trust its fields
    except UnreadableInput as e:  # nested too deeply: a crafted file, no fallback to an older checkpoint (a
        # field's refusal, a ConfigError, is the CheckpointError below: a damaged checkpoint)
        raise CheckpointRefused(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # JSONDecodeError, UnicodeDecodeError too
        raise CheckpointError(f"{path}: config.json is invalid: {_p(e)}") from e
    if not tensors:
        files = {}
    weights = tensors and not stream
    if weights:  # a model that cannot be built here is refused before its tensors are read (building it checks
        # again for its own copy, with these tensors in memory)
        fits(model_config, path, copies=1, num_classes=num_classes(run_config))
    state = _load_tensors(path, "model.safetensors", map_location) if weights else {}
    for alias, src in tied.items():
        if weights and src not in state:
            raise CheckpointError(f"{path}: config.json ties {alias} to {src}, which model.safetensors lacks")
        if weights:
            state[alias] = state[src]
    optimizer_state = None
    if weights and "optimizer.safetensors" in files and "optimizer.json" in files:
        otensors = _load_tensors(path, "optimizer.safetensors", map_location)
        try:
            optimizer_state = merge_optimizer_state(otensors, read_json(path / "optimizer.json"))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{path}: optimizer.json is invalid: {_p(e)}") from e
    rng = _load_tensors(path, "rng.safetensors", "cpu") if "rng.safetensors" in files else {}
    tokenizer = cfg.get("tokenizer")
    if tokenizer is not None:
        try:
            tokenizer = tokenizer_from_dict(tokenizer)
            check_tokenizer_fits(tokenizer, model_config.vocab_size)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: config.json has an invalid tokenizer: {_p(e)}") from e
    return Checkpoint(
        path=path,
        run_config=run_config,
        state_dict=state,
        tokenizer=tokenizer,
        train_state=train_state,
        optimizer_state=optimizer_state,
        rng=rng,
        tied=tied,
        streamed=tensors and stream,
    )
