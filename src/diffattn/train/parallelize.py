"""Getting a model ready for a training run, in torchtitan's order: activation checkpointing, regional
compilation (each block compiled on its own), then DDP or FSDP2; a model built on the meta device is allocated
and initialised in place on the way (after FSDP2 has sharded it, so no rank holds the whole of it)."""

from __future__ import annotations

import torch
from torch import nn

from diffattn.configs.run_config import TrainConfig
from diffattn.model.blocks import Block, set_activation_checkpointing
from diffattn.model.init import is_meta, materialize
from diffattn.train.distributed import DistInfo, wrap_model


def compile_blocks(model: nn.Module) -> int:
    """Regional compilation: ``torch.compile`` each :class:`Block`'s forward on its own (as torchtitan does),
    in place. Compiling one block costs what compiling all costs once they share code, graphs stay small, and
    parameter names, hooks (FSDP2's) and the state dict are unchanged. Returns the number of blocks."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.forward = torch.compile(b.forward)
    return len(blocks)


def prepare_model(model: nn.Module, train_cfg: TrainConfig, dist: DistInfo, device: torch.device) -> nn.Module:
    """Apply ``train_cfg``'s activation checkpointing and compilation to ``model`` (in place), put it on ``device``
    (a meta-device model is allocated there and initialised with its ``init_weights()`` after
    ``torch.manual_seed(train_cfg.seed)``, as ``diffattn train`` seeds before it builds a model), and wrap it for
    the process group (:func:`~diffattn.train.distributed.wrap_model`). Returns what the loop calls."""
    set_activation_checkpointing(model, train_cfg.activation_checkpointing)
    if train_cfg.compile:
        compile_blocks(model)
    meta = is_meta(model)
    if not meta:
        model.to(device)
    elif not (train_cfg.parallel == "fsdp" and dist.world > 1):
        _materialize(model, device, train_cfg.seed)  # DDP broadcasts rank 0's values when it wraps: they must exist
    wrapped = wrap_model(model, train_cfg.parallel, dist, device)
    if is_meta(model):  # FSDP2 sharded the meta parameters: allocate and initialise each rank's shard
        _materialize(model, device, train_cfg.seed)
    return wrapped


def _materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    # The seed `diffattn train` sets before building a model: a meta-built one gets the same weights
    torch.manual_seed(seed)
    materialize(model, device)
