"""Experiment trackers: where a run's scalars go besides ``metrics.csv`` (``train.tracker``).

``train.tracker`` names them, comma-separated: ``tensorboard`` (the default: ``OUT/tb``, when tensorboard
imports), ``wandb`` (Weights & Biases), or ``none``. Every tracker receives the same scalars: each metrics row
(train loss, lr, grad norm, tokens/s, the validation loss and a task's metrics such as a classifier's accuracy)
and each diagnostics row (``diag/``: λ or σ per layer, the negative map's mass, the entropies, the early-window
columns), at the step they describe (see :class:`diffattn.train.runlog.RunLog`).

Weights & Biases: the run is created in ``OUT/wandb`` with the run config as its config, named after ``OUT``, in
the project ``$WANDB_PROJECT`` (default ``diffattn``); every W&B setting read from the environment applies
(``WANDB_MODE=offline`` logs to disk only, ``WANDB_ENTITY``, ...). Charts use ``step`` (optimizer steps) as their
x-axis. A resumed run continues the same W&B run (its id is kept in ``OUT/wandb/diffattn-run-id``); steps logged
after the checkpoint it resumes from are logged again. Each tracker is an optional extra (``pip install
'diffattn[wandb]'``, ``'diffattn[tb]'``); asking for W&B without it installed is a config error, before anything
is written, while a missing TensorBoard (the default) only turns ``tb/`` off, with a one-line note.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from diffattn.system.atomic_files import atomic_write, open_nofollow

WANDB_ID_FILE = "diffattn-run-id"


class WandbTracker:
    """One Weights & Biases run for one training run (module docstring). ``log`` sends a dict of scalars at a
    step; ``close`` finishes the run."""

    def __init__(self, out: Path, *, resumed: bool, config: dict[str, Any] | None) -> None:
        import wandb  # optional dependency (the `wandb` extra); parse_trackers checked it is installed

        folder = out / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_ID_FILE
        run_id = None
        if resumed and id_file.is_file():
            with open_nofollow(id_file) as f:
                run_id = f.read().strip()
        # console="off": W&B does not wrap stdout/stderr, where the progress bar and the signal lines go
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "diffattn", dir=str(out), id=run_id,
                              name=out.resolve().name, resume="allow", config=config or {},
                              settings=wandb.Settings(console="off"))
        atomic_write(id_file, self.run.id + "\n")  # a torn id (a full disk) would start a new W&B run
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def close(self) -> None:
        self.run.finish()
