"""What a run is checked for before anything is built, read or written, beyond its config and folder: the memory
its model needs (:func:`check_memory`)."""

from __future__ import annotations

import torch

from diffattn.configs.run_config import RunConfig
from diffattn.model.footprint import check_fits
from diffattn.train.distributed import env_int


def check_memory(run: RunConfig) -> None:
    """Refuse (:class:`~diffattn.model.footprint.ModelTooLarge`, one line) a run whose model, gradients and
    AdamW moments cannot fit on this machine's training device (sharded over the world under FSDP2), or that
    has more modules than any machine builds in reasonable time: in seconds, for a config of 10⁶ layers too,
    before the data is read or the model built."""
    world = env_int("WORLD_SIZE", 1)
    classes = (run.classify.num_classes or 0) if run.task == "classify" else 0
    check_fits(run.model, "train", training=True, num_classes=classes,
               shards=world if run.train.parallel == "fsdp" else 1,
               device=f"cuda:{env_int('LOCAL_RANK')}" if torch.cuda.is_available() else "cpu")
