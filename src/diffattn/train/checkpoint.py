"""Checkpoints: a directory of safetensors + JSON files, written atomically and verified by sha256 on load.

CONTRACT (used by train.py, generate.py, evaluate.py, classify.py):
  save_checkpoint(path, model, *, run_config, tokenizer=None, optimizer=None, train_state=None) -> None
  load_checkpoint(path, map_location="cpu") -> Checkpoint
      Checkpoint.run_config, .model_config, .state_dict, .tokenizer (or None), .train_state, .build_model()
  CheckpointError(ValueError): missing / corrupt / truncated files, named in the message.
  resolve_checkpoint_dir(path) -> Path: the one resolver: a run folder (train --out, a study cell, a compare model
      run DIR/runs/<model>), its ckpt/, or a checkpoint folder (convert --out) -> the checkpoint directory to load.
  open_checkpoint(path, map_location="cpu", *, tensors=True) -> Checkpoint: resolve + load; a run folder whose
      ckpt/ is damaged falls back to its newest good older checkpoint (what diffattn.load_pretrained reads).
  model_runs(path) -> {name: run folder}: the models of a comparison folder (compare --out DIR), else {}.
  COMPONENTS, param_counts(state_dict, tied): parameter counts by component (`diffattn info`, diffattn.cli.info).

Layout of a checkpoint directory::

    manifest.json          format version + sha256 and size of every other file
    config.json            run_config (with the "model" section), tokenizer dict, train_state, tied aliases
    model.safetensors      weights (tied weights stored once; the aliases are re-created on load)
    optimizer.safetensors  optimizer tensors (optional) ...
    optimizer.json         ... and its non-tensor parts (param groups, state scalars)
    rng.safetensors        RNG states as uint8 tensors (optional)

Nothing is ever unpickled. A checkpoint is first written into a temp directory next to the target, every file
and the directory are fsynced, and then it is renamed into place (an existing checkpoint is renamed aside
first and removed only after the new one is in place), so a crash leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffattn.fileio import io_error_in, names_path
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
from diffattn.tokenizer import tokenizer_from_dict
from diffattn.train.safetensors_io import gathered
from diffattn.train.safetensors_io import write as write_tensors

FORMAT = "diffattn-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CKPT_SUBDIR = "ckpt"  # a run folder keeps its checkpoint here
PT = {"format": "pt"}  # the safetensors metadata torch's own writers put in


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or corrupt."""


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint. ``state_dict`` has every model key (tied aliases included)."""

    path: Path
    run_config: dict[str, Any]
    model_config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer: Any = None
    train_state: dict[str, Any] = field(default_factory=dict)
    optimizer_state: dict[str, Any] | None = None
    rng: dict[str, Tensor] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    # loaded with stream=True: the weights and optimizer state were left in the files, to be read into a live
    # model and optimizer one tensor at a time (diffattn.train.state.restore)
    streamed: bool = False

    @property
    def task(self) -> str:
        return self.run_config.get("task", "lm")

    def build_model(self) -> nn.Module:
        """Instantiate the model of ``run_config`` and load the weights (strict)."""
        if self.task == "classify":
            ccfg = self.run_config.get("classify", {})
            if "num_classes" not in ccfg:
                raise CheckpointError(
                    f"{self.path}: classify checkpoint without classify.num_classes in config.json"
                )
            model: nn.Module = TransformerClassifier(
                self.model_config, int(ccfg["num_classes"]), ccfg.get("pooling", "mean")
            )
        elif self.task == "encoder":  # only a save_pretrained folder holds one (diffattn.interop.hub)
            model = TransformerEncoder(self.model_config)
        else:
            model = TransformerLM(self.model_config)
        try:
            model.load_state_dict(self.state_dict, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{self.path}: weights do not match the model config: {e}") from e
        return model


# ------------------------------------------------------------------------------------------------------ save


def _storage_key(t: Tensor) -> tuple | None:
    """Equal for two tensors that are the same view of one storage (tied weights); None for an empty one."""
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def tied_aliases(sd: Mapping[str, Tensor]) -> dict[str, str]:
    """{alias: stored name} for the entries of a model's state dict that share another entry's storage (tied
    weights), as :attr:`Checkpoint.tied` records them; nothing is copied."""
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in sd.items():
        key = _storage_key(t)
        if key is not None and key in seen:
            tied[name] = seen[key]
        elif key is not None:
            seen[key] = name
    return tied


def _dedup_state_dict(sd: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store each storage once (safetensors refuses shared tensors). Returns (tensors, {alias: stored}); the
    tensors are the state dict's own (DTensors are gathered one at a time as they are written)."""
    out: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in sd.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"state dict entry {name!r} is not a tensor ({type(t).__name__})")
        t = t.detach()
        key = _storage_key(t.to_local() if hasattr(t, "full_tensor") else t)
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out[name] = t
    return out, tied


def _split_optimizer_state(osd: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Optimizer state_dict -> (tensors for safetensors, JSON-able rest). State keys may be ints (torch's own
    state_dict) or parameter names (torch.distributed.checkpoint's); the JSON records which."""
    tensors: dict[str, Tensor] = {}
    state_meta: list[dict[str, Any]] = []
    for i, (key, st) in enumerate(osd.get("state", {}).items()):
        entry: dict[str, Any] = {
            "key": key,
            "key_type": "int" if isinstance(key, int) else "str",
            "tensors": [],
            "values": {},
        }
        for k, v in st.items():
            if isinstance(v, Tensor):
                tensors[f"{i}.{k}"] = v.detach()  # gathered (a DTensor) and copied out as it is written
                entry["tensors"].append(k)
            else:
                entry["values"][k] = v
        state_meta.append(entry)
    groups = []
    for g in osd.get("param_groups", []):
        gg = {}
        for k, v in g.items():
            if isinstance(v, Tensor):
                v = v.item()
            gg[k] = list(v) if isinstance(v, tuple) else v
        groups.append(gg)
    return tensors, {"state": state_meta, "param_groups": groups}


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    run_config: dict,
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
    ``run_config`` should hold a "model" section; if it does not, ``model.config`` is recorded there.
    """
    path = Path(path)
    run_config = json.loads(json.dumps(run_config))  # deep copy; fails early if not JSON-able
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    if "model" not in run_config:
        cfg = getattr(model, "config", None)
        if not isinstance(cfg, ModelConfig):
            raise ValueError(
                "save_checkpoint: run_config has no 'model' section and the model has no ModelConfig"
            )
        run_config["model"] = cfg.to_dict()
    ModelConfig.from_dict(run_config["model"])  # refuse to write a checkpoint that could not be rebuilt
    tok = tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else tokenizer
    weights, tied = _dedup_state_dict(sd)
    osd = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))  # pid: clean_leftovers
    try:
        files = []
        # tensor by tensor, hashed while written: a save adds one tensor's copy at most to memory
        digests = {"model.safetensors": write_tensors(tmp / "model.safetensors", list(weights.items()), PT)}
        files.append("model.safetensors")
        if osd is not None:
            otensors, ometa = _split_optimizer_state(osd)
            digests["optimizer.safetensors"] = write_tensors(tmp / "optimizer.safetensors", list(otensors.items()), PT)
            _write_json(tmp / "optimizer.json", ometa)
            files += ["optimizer.safetensors", "optimizer.json"]
        if rng:
            bad = [k for k, v in rng.items() if not isinstance(v, Tensor) or v.dtype != torch.uint8]
            if bad:
                raise ValueError(f"save_checkpoint: rng states must be uint8 tensors; bad entries: {bad}")
            _save_tensors({k: v.detach().cpu().contiguous().clone() for k, v in rng.items()},
                          tmp / "rng.safetensors")
            files.append("rng.safetensors")
        _write_json(
            tmp / "config.json",
            {"run_config": run_config, "tokenizer": tok, "train_state": train_state or {}, "tied": tied},
        )
        files.append("config.json")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "torch": torch.__version__,
            "files": {f: {"sha256": digests.get(f) or file_sha256(tmp / f), "bytes": (tmp / f).stat().st_size}
                      for f in files},
        }
        _write_json(tmp / MANIFEST, manifest)
        for f in [*files, MANIFEST]:
            _fsync_file(tmp / f)
        _fsync_dir(tmp)
        _swap_in(tmp, path, Path(keep_previous_as) if keep_previous_as is not None else None)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def gather_for_save(model_state: Mapping[str, Tensor], optimizer_state: Mapping[str, Any] | None) -> None:
    """What a rank that does not write takes part in while rank 0 runs :func:`save_checkpoint` on the same
    state: the gathers of its sharded (DTensor) tensors, in the order they are written. Nothing when no tensor
    is sharded."""
    weights, _ = _dedup_state_dict(model_state)
    items = list(weights.items())
    if optimizer_state is not None:
        items += list(_split_optimizer_state(optimizer_state)[0].items())
    if any(hasattr(t, "full_tensor") for _, t in items):
        for _ in gathered(items):
            pass


def _swap_in(tmp: Path, path: Path, keep_as: Path | None = None) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first and, after the swap, renamed to
    ``keep_as`` or removed. If the second rename fails, the old checkpoint is moved back."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    _fsync_dir(path.parent)
    if old is not None and keep_as is not None:
        if keep_as.exists():
            shutil.rmtree(keep_as)
        os.replace(old, keep_as)
        _fsync_dir(path.parent)
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ load


def _leftover_old(path: Path) -> Path | None:
    """A checkpoint moved aside by a save that died between its two renames (the new one never landed)."""
    cands = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in cands if (c / MANIFEST).is_file()), None)


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check the manifest and every file's size and sha256. Returns the manifest; raises CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: {MANIFEST} is missing (incomplete or not a diffattn checkpoint)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
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
            f"{path}: unsupported checkpoint version {manifest.get('version')} (expected {VERSION})"
        )
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        size = f.stat().st_size
        if size != meta.get("bytes"):
            raise CheckpointError(
                f"{path}: file {name} is truncated or altered ({size} bytes, manifest says "
                f"{meta.get('bytes')})"
            )
        if file_sha256(f) != meta.get("sha256"):
            raise CheckpointError(f"{path}: file {name} is corrupt (sha256 mismatch)")
    for need in ("model.safetensors", "config.json"):
        if need not in manifest["files"]:
            raise CheckpointError(f"{path}: manifest lists no {need}")
    return manifest


def _load_tensors(path: Path, name: str, device: str | torch.device) -> dict[str, Tensor]:
    try:
        return load_file(str(path / name), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: file {name} cannot be read: {e}") from e


def _merge_optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[Any, dict[str, Any]] = {}
    for i, entry in enumerate(meta["state"]):
        key = int(entry["key"]) if entry["key_type"] == "int" else entry["key"]
        st = dict(entry["values"])
        for k in entry["tensors"]:
            st[k] = tensors[f"{i}.{k}"]
        state[key] = st
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


READ_TRIES = 5  # a checkpoint replaced while it is read is read again, up to this many times


def _generation(path: Path) -> tuple[int, int] | None:
    """Which checkpoint folder is at ``path`` now: every save renames a new folder into place, with a new inode
    and change time (None while a save has moved the old one aside)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    tensors: bool = True, stream: bool = False) -> Checkpoint:
    """Verify every file of the checkpoint at ``path``, then load it; CheckpointError names a bad file.

    A run that is training replaces its checkpoint while others read it (``eval``, ``generate``, ``info``): if
    the folder at ``path`` changed during the read, it is read again (:data:`READ_TRIES` times), so a reader
    never mixes the files of two checkpoints nor reports a half-replaced one as corrupt.

    If ``path`` is gone but a save died between its two renames, the complete previous checkpoint it moved
    aside is loaded instead (with a warning). ``tensors=False`` verifies everything but reads only the JSON
    parts (config, tokenizer, train state): ``state_dict``, the optimizer and RNG states are left empty.
    ``stream=True`` reads the RNG states too but leaves the weights and optimizer state in their files
    (``streamed``), for :func:`diffattn.train.state.restore` to read into the live model one tensor at a time."""
    path = Path(path)
    for attempt in range(READ_TRIES):
        before = _generation(path)
        try:
            ck = _load_checkpoint_once(path, map_location, tensors, stream)
        except CheckpointError:
            if attempt == READ_TRIES - 1 or _generation(path) == before:
                raise
        else:
            if _generation(path) == before:
                return ck
        time.sleep(0.05 * (attempt + 1))  # a save is renaming its folders: they settle within milliseconds
    raise CheckpointError(f"{path} was replaced {READ_TRIES} times while being read (a run saving very often); "
                          "try again")


def _load_checkpoint_once(path: Path, map_location: str | torch.device, tensors: bool, stream: bool) -> Checkpoint:
    if not path.exists():
        old = _leftover_old(path)
        if old is not None:
            warnings.warn(f"{path} is missing; loading the previous checkpoint left at {old}", stacklevel=3)
            path = old
    manifest = verify_checkpoint(path)
    files = manifest["files"]
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        run_config, tied = cfg["run_config"], cfg.get("tied", {})
        model_config = ModelConfig.from_dict(run_config["model"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: config.json is invalid: {e}") from e
    if not tensors:
        files = {}
    weights = tensors and not stream
    sd = _load_tensors(path, "model.safetensors", map_location) if weights else {}
    for alias, src in tied.items():
        if weights and src not in sd:
            raise CheckpointError(f"{path}: config.json ties {alias} to {src}, which model.safetensors lacks")
        if weights:
            sd[alias] = sd[src]
    optimizer_state = None
    if weights and "optimizer.safetensors" in files and "optimizer.json" in files:
        otensors = _load_tensors(path, "optimizer.safetensors", map_location)
        try:
            optimizer_state = _merge_optimizer_state(
                otensors, json.loads((path / "optimizer.json").read_text())
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: optimizer.json is invalid: {e}") from e
    rng = _load_tensors(path, "rng.safetensors", "cpu") if "rng.safetensors" in files else {}
    tokenizer = cfg.get("tokenizer")
    if tokenizer is not None:
        try:
            tokenizer = tokenizer_from_dict(tokenizer)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: config.json has an invalid tokenizer: {e}") from e
    return Checkpoint(
        path=path,
        run_config=run_config,
        model_config=model_config,
        state_dict=sd,
        tokenizer=tokenizer,
        train_state=cfg.get("train_state") or {},
        optimizer_state=optimizer_state,
        rng=rng,
        tied=tied,
        streamed=tensors and stream,
    )


# ------------------------------------------------------------------------------------ a run's checkpoints

LATEST = "ckpt"  # a run folder's newest checkpoint; older kept ones are ckpt-step-<N> beside it
PREVIOUS = "ckpt-step-"


def checkpoint_step(path: Path) -> int | None:
    """The training step recorded in a checkpoint's config.json (without verifying it), or None."""
    try:
        step = json.loads((path / "config.json").read_text(encoding="utf-8"))["train_state"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


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
    :func:`load_checkpoint`."""
    run_dir = Path(run_dir)
    candidates = [run_dir / LATEST, *previous_checkpoints(run_dir)]
    errors: list[str] = []
    for cand in candidates:
        try:
            ck = load_checkpoint(cand, map_location, stream=stream)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        if errors:
            warnings.warn(
                f"{candidates[0]} cannot be used ({errors[0]}); falling back to the previous checkpoint {cand} "
                f"(step {ck.train_state.get('step', '?')})",
                stacklevel=2,
            )
        return ck
    raise CheckpointError("; ".join(errors) if errors else f"{run_dir}: no checkpoint found")


def open_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    tensors: bool = True) -> Checkpoint:
    """The checkpoint of any folder diffattn writes that holds one (see :func:`resolve_checkpoint_dir`): a run
    folder gives its newest good checkpoint (:func:`load_run_checkpoint`), any other its own checkpoint."""
    if Path(path).name == CKPT_SUBDIR and previous_checkpoints(Path(path).parent):
        path = Path(path).parent  # a run's ckpt/: its older checkpoints are the fallback, as for the run folder
    where = resolve_checkpoint_dir(path)
    if where == Path(path) / CKPT_SUBDIR:
        if not tensors:  # the JSON parts are the same in every checkpoint of a run; ckpt/ is the one to check
            return load_checkpoint(where, map_location, tensors=False)
        return load_run_checkpoint(path, map_location)
    return load_checkpoint(where, map_location, tensors=tensors)


COMPARISON_SUBDIRS = ("runs", "cells")  # `compare --out DIR`: DIR/runs/<model>/; `compare --data`: DIR/cells/<cell>/
# Files that only a comparison folder has beside runs/ or cells/ (a project folder's runs/ alone is not one):
# compare's report and settings, the --data experiment's spec, Optuna journal and event log.
COMPARISON_MARKERS = ("results.json", "config.json", "command.txt", "report.md", "summary.md", "study.json",
                      "optuna.journal", "events.log")


def model_runs(path: str | os.PathLike) -> dict[str, Path]:
    """The models of a comparison folder, {name: run folder}, sorted by name: ``diffattn compare --out DIR``
    keeps each model's run in ``DIR/runs/<name>/`` and ``compare --data`` each cell's in ``DIR/cells/<name>/``.
    Only run folders holding a checkpoint (``ckpt/`` with a manifest) count, and only in a folder with one of
    :data:`COMPARISON_MARKERS`; empty for any other folder."""
    path = Path(path)
    if not any((path / m).is_file() for m in COMPARISON_MARKERS):
        return {}
    found: dict[str, Path] = {}
    for sub in COMPARISON_SUBDIRS:
        d = path / sub
        if not d.is_dir():
            continue
        for run in sorted(d.iterdir()):
            if (run / CKPT_SUBDIR / MANIFEST).is_file() and run.name not in found:
                found[run.name] = run
    return dict(sorted(found.items()))


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory a command should load for ``path``: a run folder, whose checkpoint is ``DIR/ckpt``
    (``diffattn train --out DIR``, a ``compare --data`` cell ``DIR/cells/<cell>``, a ``compare --out DIR`` model
    run ``DIR/runs/<model>``), or a checkpoint folder itself (``ckpt/``, a ``diffattn convert --out`` folder).

    A candidate holds a checkpoint when it has a manifest. When neither does, a candidate that looks like a
    damaged checkpoint (config or weights without a manifest, or a copy a crashed save moved aside) is
    returned, so that :func:`load_checkpoint` reports the damage (or recovers the copy). A comparison folder
    (:func:`model_runs`) raises a CheckpointError naming its models. Otherwise a CheckpointError names both
    places looked at.
    """
    # Extend here when ckpt/ holds several checkpoints: pick the newest complete one among them.
    path = Path(path)
    candidates = (path, path / CKPT_SUBDIR)
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
    for c in candidates:
        damaged = (c / "config.json").is_file() or (c / "model.safetensors").is_file()
        if damaged or _leftover_old(c) is not None:
            return c
    if previous_checkpoints(path):  # ckpt/ was deleted: open_checkpoint falls back to the newest older one
        return path / CKPT_SUBDIR
    if not path.exists():
        raise CheckpointError(f"{path} does not exist (give a run folder, diffattn train --out DIR, or its ckpt/)")
    raise CheckpointError(
        f"{path}: no checkpoint here: neither {path / MANIFEST} nor {path / CKPT_SUBDIR / MANIFEST} exists; "
        "give a run folder (diffattn train --out DIR) or its ckpt/ folder"
    )


# ------------------------------------------------------------------------------------------------------ info

COMPONENTS = ("embeddings", "attention", "lambda", "ffn", "norms", "lm_head", "classifier_head", "other")


def component_of(name: str) -> str:
    """Which part of the model a parameter belongs to (for ``diffattn info``)."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
    if "tok_emb" in parts:
        return "embeddings"
    if parts[0] == "lm_head":
        return "lm_head"
    if parts[0] == "head":
        return "classifier_head"
    if leaf.startswith("lambda"):
        return "lambda"
    if "norm" in leaf or leaf == "subln":
        return "norms"
    if "attn" in parts:
        return "attention"
    if "ffn" in parts:
        return "ffn"
    return "other"


def param_counts(state_dict: Mapping[str, Tensor], tied: Mapping[str, str] | None = None) -> dict[str, int]:
    """Parameter count per component; tied aliases are counted once (under the stored name)."""
    tied = tied or {}
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, t in state_dict.items():
        if name in tied:
            continue
        counts[component_of(name)] += t.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    return counts
