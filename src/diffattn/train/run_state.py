"""A run's state across processes: restoring it from a checkpoint (weights, optimizer, GradScaler, every RNG,
the counters and the metrics history) and saving it, so that a resumed run continues bit-for-bit.

Both stream: a save writes the live tensors one at a time (under FSDP2 each is gathered when its turn comes),
and a resume reads each tensor of the files straight into the live parameter or optimizer state (each rank
keeping its shard), so neither holds a second copy of the model or the optimizer state."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from diffattn.checkpoint.best import BEST, best_train_state
from diffattn.checkpoint.format import Checkpoint, CheckpointError, gather_for_save, save_checkpoint
from diffattn.checkpoint.run_folder import LATEST, PREVIOUS, checkpoint_step, prune_checkpoints
from diffattn.checkpoint.tensor_files import Reader, TensorFileError
from diffattn.configs.run_config import RunConfig, TrainConfig
from diffattn.model.init import copy_into
from diffattn.system.atomic_files import printable, read_json
from diffattn.train.distributed import DistInfo, load_full_state


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the last good checkpoint was left untouched."""


def new_state(extra_fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """The counters a checkpoint carries; ``extra_fields`` (a task's last evaluation metrics) start as None."""
    state: dict[str, Any] = {"step": 0, "tokens_seen": 0, "best_val_loss": None, "best": None, "history": [],
                             "elapsed_s": 0.0}
    state.update(dict.fromkeys(extra_fields))
    return state


def rng_state(gen: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """RNG states as uint8 tensors (+ the few scalars of python/numpy state, for JSON)."""
    rng = {"data": gen.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    pv, pkey, pgauss = random.getstate()
    rng["python"] = torch.from_numpy(np.asarray(pkey, dtype=np.uint32).view(np.uint8).copy())
    nkind, nkey, npos, nhas, ncached = np.random.get_state()
    rng["numpy"] = torch.from_numpy(np.asarray(nkey, dtype=np.uint32).view(np.uint8).copy())
    meta = {"python": [pv, pgauss], "numpy": [nkind, int(npos), int(nhas), float(ncached)]}
    return rng, meta


def set_rng_state(gen: torch.Generator, rng: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved; states a checkpoint lacks (older classifier runs saved only the
    data generator's) are left as they are."""
    if "data" in rng:
        gen.set_state(rng["data"])
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    if "python" in rng and "python" in meta:
        words = tuple(int(w) for w in rng["python"].numpy().view(np.uint32))
        random.setstate((meta["python"][0], words, meta["python"][1]))
    if "numpy" in rng and "numpy" in meta:
        kind, pos, has, cached = meta["numpy"]
        np.random.set_state((kind, rng["numpy"].numpy().view(np.uint32).copy(), pos, has, cached))


@contextmanager
def _reading(checkpoint: Checkpoint, part: str) -> Iterator[None]:
    """What a crafted or damaged ``part`` of ``checkpoint`` raises while it is restored (a wrong type, a wrong size, a
    key missing) as one CheckpointError naming it: the resume is refused, not a traceback."""
    try:
        yield
    except CheckpointError:
        raise
    except (TensorFileError, OSError, KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError,
            RuntimeError) as e:
        raise CheckpointError(f"{checkpoint.path}: {part} cannot be restored: {printable(e)}") from e


def restore(checkpoint: Checkpoint, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
            scaler: Any, gen: torch.Generator, train_cfg: TrainConfig, dist: DistInfo) -> None:
    """Load ``checkpoint`` into the model, optimizer, scaler, RNGs and ``state`` (in place). A checkpoint loaded with
    ``stream=True`` is read from its files one tensor at a time. A part that cannot be restored is a
    CheckpointError naming it."""
    if checkpoint.streamed:
        with _reading(checkpoint, "the weights"):
            stream_weights(model, checkpoint)
        with _reading(checkpoint, "the optimizer state"):
            stream_optimizer_state(model, optimizer, checkpoint)
    else:
        load_full_state(model, optimizer, checkpoint)
    state.update({k: checkpoint.train_state[k] for k in state if k in checkpoint.train_state})
    if checkpoint.rng:
        with _reading(checkpoint, "the RNG state"):
            set_rng_state(gen, checkpoint.rng, checkpoint.train_state.get("rng_meta", {}))
    if scaler is not None and checkpoint.train_state.get("scaler"):
        with _reading(checkpoint, "the gradient scaler's state"):
            scaler.load_state_dict(checkpoint.train_state["scaler"])
    # The data order depends only on the seed, the sequence length and the global batch (rows per step),
    # so a run may resume at another world size / accumulation with the same global batch.
    old = checkpoint.train_state.get("train_config", {})
    old_rows = old.get("batch_size", 0) * old.get("grad_accum", 1) * checkpoint.train_state.get("world_size", 1)
    changed = [k for k in ("seq_len", "seed") if k in old and old[k] != getattr(train_cfg, k)]
    if old and old_rows != train_cfg.batch_size * train_cfg.grad_accum * dist.world:
        changed.append("global batch (batch_size · grad_accum · world_size)")
    if changed and dist.main:
        warnings.warn(f"resuming with a changed {changed}: the data order differs from the original run",
                      stacklevel=3)


class Saver:
    """Writes the run's checkpoint to ``out/ckpt`` (:data:`LATEST`; a no-op without ``out``); the one it replaces
    stays as ``ckpt-step-<N>`` while ``keep_checkpoints`` allows. Collective under FSDP: every rank calls
    :meth:`save`."""

    def __init__(self, out: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                 gen: torch.Generator, train_cfg: TrainConfig, dist: DistInfo, *,
                 run_config: RunConfig | dict[str, Any], tokenizer: Any, last: Path | None = None) -> None:
        self.out, self.ckpt_dir = out, (out / LATEST if out is not None else None)
        self.model, self.optimizer, self.scaler, self.gen = model, optimizer, scaler, gen
        self.train_cfg, self.dist, self.run_config, self.tokenizer = train_cfg, dist, run_config, tokenizer
        self.last = last  # the last checkpoint written (or resumed from)

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Save at ``step``; -> whether this rank wrote it."""
        if self.ckpt_dir is None:
            return False
        model_state, optimizer_state = self.model.state_dict(), named_optimizer_state(self.model, self.optimizer)
        if not self.dist.main:
            gather_for_save(model_state, optimizer_state)  # FSDP2: rank 0 writes each tensor as all ranks gather it
        else:
            ckpt_dir, train_cfg = self.ckpt_dir, self.train_cfg
            # The checkpoint being replaced stays as ckpt-step-<N> (a fallback if the newest is ever corrupt).
            prev = checkpoint_step(ckpt_dir) if train_cfg.keep_checkpoints > 1 and ckpt_dir.is_dir() else None
            keep_as = self.out / f"{PREVIOUS}{prev}" if prev is not None and prev != step else None
            rng, rng_meta = rng_state(self.gen)
            train_state = {
                **state,
                "rng_meta": rng_meta,
                "world_size": self.dist.world,
                "train_config": dataclasses.asdict(train_cfg),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            }
            save_checkpoint(ckpt_dir, model_state, run_config=self.run_config, tokenizer=self.tokenizer,
                            optimizer=optimizer_state, train_state=train_state, rng=rng, keep_previous_as=keep_as)
            prune_checkpoints(self.out, train_cfg.keep_checkpoints)
            self.last = ckpt_dir
        if self.dist.world > 1:
            import torch.distributed  # only under torchrun

            torch.distributed.barrier()
        return self.dist.main

    def save_best(self, step: int, state: dict[str, Any], fields: tuple[str, ...] = ()) -> bool:
        """Write the model as the run's best checkpoint, ``out/best`` (:mod:`diffattn.checkpoint.best`): weights, run
        config, tokenizer and the evaluation's train state, atomically; -> whether this rank wrote it."""
        if self.out is None:
            return False
        model_state = self.model.state_dict()
        if not self.dist.main:
            gather_for_save(model_state, None)
        else:
            save_checkpoint(self.out / BEST, model_state, run_config=self.run_config, tokenizer=self.tokenizer,
                            train_state=best_train_state(state, fields))
        if self.dist.world > 1:
            import torch.distributed  # only under torchrun

            torch.distributed.barrier()
        return self.dist.main

    def diverged(self, what: str, value: float, step: int) -> NonFiniteLossError:
        where = (
            f"the last good checkpoint {self.last} (step {checkpoint_step(self.last) or '?'}) is left untouched"
            if self.last is not None
            else "no checkpoint was written"
        )
        return NonFiniteLossError(
            f"non-finite {what} ({value}) at step {step}: training stopped; {where}. "
            "Try a lower lr, a smaller grad_clip, more warmup, or float32."
        )


# ------------------------------------------------------------------------------------------ streaming

def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its order (tied parameters under their first name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter names (the layout torch.distributed.checkpoint writes and
    checkpoints keep), holding the live state tensors (DTensor shards under FSDP2): nothing is copied."""
    optimizer_state = optimizer.state_dict()
    names = _param_names(model, optimizer)
    return {"state": {names[i]: st for i, st in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}


def _like(target: Tensor, full: Tensor) -> Tensor:
    """``full`` as ``target`` holds it: this rank's shard of a DTensor, or on ``target``'s device."""
    if hasattr(target, "device_mesh"):
        # torch.distributed.tensor is slow to import and only needed for a sharded (FSDP2) model
        from torch.distributed.tensor import distribute_tensor

        mesh = target.device_mesh
        return distribute_tensor(full.to(mesh.device_type), mesh, target.placements, src_data_rank=None)
    return full.to(target.device)


def stream_weights(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Read the weights of a streamed checkpoint into ``model``'s parameters and buffers, one tensor at a time,
    strictly (the names and shapes must match; tied aliases resolve to their stored tensor)."""
    targets = model.state_dict(keep_vars=True)
    with Reader(checkpoint.path / "model.safetensors") as r:
        missing = sorted(set(targets) - set(r.entries) - set(checkpoint.tied))
        unexpected = sorted(set(r.entries) - set(targets))
        if missing or unexpected:
            raise CheckpointError(f"{checkpoint.path}: the checkpoint weights do not fit this model: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]}")
        for name, t in targets.items():
            src = checkpoint.tied.get(name, name)
            if src != name and targets.get(src) is t:
                continue  # tied in the model too: loaded under its stored name
            dtype, shape = r.entries[src][:2]
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{checkpoint.path}: {name} has shape {list(shape)} in the checkpoint, "
                                      f"{list(t.shape)} in the model")
            plain = t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and not hasattr(t, "device_mesh")
            with torch.no_grad():
                if plain:
                    r.read(src, out=t.detach())  # straight into the parameter: no copy at all
                else:
                    copy_into(t.detach(), r.read(src))


def _same_kind(saved: Any, live: Any) -> bool:
    """Whether a saved optimizer setting can stand where the live one is (a number for a number, a pair of
    numbers for betas, a bool for a bool, None for None): a crafted one would crash the first step."""
    if isinstance(live, bool) or live is None:
        return type(saved) is type(live)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(live, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(live) and all(
            _same_kind(a, b) for a, b in zip(saved, live))
    return isinstance(saved, type(live))


def _check_groups(saved: Any, live: list[dict[str, Any]]) -> None:
    """The saved param groups (optimizer.json) against the live optimizer's: as many, each setting of the kind the
    live one is. ValueError naming the first that is not."""
    if not isinstance(saved, list) or len(saved) != len(live) or not all(isinstance(g, dict) for g in saved):
        raise ValueError(f"param_groups must be a list of {len(live)} objects")
    for i, (g, ref) in enumerate(zip(saved, live)):
        bad = [k for k, v in g.items() if k != "params" and k in ref and not _same_kind(v, ref[k])]
        if bad:
            raise ValueError(f"param_groups[{i}].{bad[0]} is {printable(repr(g[bad[0]]))[:40]}, not a "
                             f"{type(ref[bad[0]]).__name__} as the optimizer's")


def _checked_state(st: dict[str, Any], param: Tensor, name: str) -> dict[str, Any]:
    """One parameter's optimizer state, checked before the optimizer steps on it: every entry a floating tensor
    (a scalar for ``step``), the moments of the parameter's shape."""
    for k, v in st.items():
        if not (isinstance(v, Tensor) and v.is_floating_point()):
            raise ValueError(f"the optimizer state {k!r} of {name} is not a floating-point tensor")
        if k != "step" and tuple(v.shape) != tuple(param.shape):
            raise ValueError(f"the optimizer state {k!r} of {name} has shape {list(v.shape)}, the parameter "
                                  f"{list(param.shape)}")
    return st


def stream_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Checkpoint) -> None:
    """Read the optimizer state of a streamed checkpoint, one tensor at a time, into ``optimizer`` (each
    tensor as its parameter is held: a DTensor shard under FSDP2)."""
    if not (checkpoint.path / "optimizer.json").is_file():
        raise CheckpointError(f"{checkpoint.path}: no optimizer state in the checkpoint; cannot resume training")
    try:
        meta = read_json(checkpoint.path / "optimizer.json")
        saved_groups = [list(g["params"]) for g in meta["param_groups"]]
        entries = meta["state"]
        _check_groups(meta["param_groups"], optimizer.param_groups)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{checkpoint.path}: optimizer.json is invalid: {printable(e)}") from e
    names = _param_names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    current, start = [], 0
    for g in optimizer.param_groups:
        current.append(names[start:start + len(g["params"])])
        start += len(g["params"])
    as_names = [[names[p] if isinstance(p, int) else p for p in g] for g in saved_groups]
    if as_names != current:
        raise CheckpointError(f"{checkpoint.path}: the optimizer state does not fit this model's parameters")
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    with Reader(checkpoint.path / "optimizer.safetensors") as r:
        for i, entry in enumerate(entries):
            idx = int(entry["key"]) if entry["key_type"] == "int" else index[entry["key"]]
            st = dict(entry["values"])
            for k in entry["tensors"]:
                full = r.read(f"{i}.{k}")
                st[k] = _like(flat[idx], full) if full.shape == flat[idx].shape else full
            state[idx] = _checked_state(st, flat[idx], names[idx])
    groups = []
    for g, saved in zip(meta["param_groups"], as_names):
        g = {**g, "params": [index[n] for n in saved]}
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
