"""The training loop: AdamW, warmup + cosine, clipping, accumulation, AMP, checkpoints, exact resume, DDP/FSDP2,
for every task (a language model, :class:`~diffattn.train.task.LMTask`, or a text classifier,
:class:`~diffattn.train.classify.ClassifyTask`).

:func:`train` (model, task hook or batch source, the run config) -> :class:`TrainResult`; its ``history`` is a list of
dicts {"step", "train_loss", "val_loss" (or None), "lr", "tokens_per_s", ...}. ``RunConfig`` and its
``TrainConfig`` live in :mod:`diffattn.configs.run_config`, ``make_optimizer`` and ``lr_at`` in
:mod:`diffattn.train.optim`.

The parts: :mod:`~diffattn.train.run_state` (restore and save), :mod:`~diffattn.train.step` (one optimizer step),
:mod:`~diffattn.train.runlog` (metrics.csv, TensorBoard, progress), :mod:`~diffattn.train.task` (batches, loss,
evaluation); the cadence (evaluate, log, checkpoint every N steps) is :func:`due` here. A run from a config (new,
resumed, or started from a checkpoint; data, model, run folder) is prepared and launched by
:mod:`diffattn.train.launch`, which the ``diffattn train`` command calls.

Data and exact resume: every step draws ONE global batch of ``batch_size · grad_accum · world_size``
rows from a ``torch.Generator`` seeded with ``train_cfg.seed``; micro-batch m on rank r takes rows
``(m·world + r)·b ...``. So 2 processes × batch b see exactly the data of 1 process × batch 2b, and
grad_accum 2 × b that of 1 × 2b. The loss is the summed loss divided by the number of targets of the whole
global batch, so the gradient is the same mean in every layout. The generator state is checkpointed with the
weights, optimizer and torch RNG, so a resumed run continues bit-for-bit (use ``deterministic = true``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.checkpoint.best import BY_TASK, describe_best, record_best
from diffattn.checkpoint.format import Checkpoint
from diffattn.checkpoint.output_guard import clean_leftovers
from diffattn.checkpoint.run_folder import load_run_checkpoint
from diffattn.configs.run_config import RunConfig, TrainConfig, parse_trackers
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends
from diffattn.system.io_errors import io_error_in
from diffattn.train.diagnostics import DiagnosticsLog, attention_diagnostics, early_diagnostics
from diffattn.train.distributed import all_reduce_max, autocast_for, device_for, setup_distributed
from diffattn.train.optim import make_optimizer
from diffattn.train.parallelize import prepare_model
from diffattn.train.retrofit import RetrofitSchedule
from diffattn.train.run_state import Saver, new_state, restore
from diffattn.train.runlog import METRIC_FIELDS, RunLog
from diffattn.train.signals import StopSignals, TrainingInterrupted
from diffattn.train.step import TrainStep
from diffattn.train.task import LMTask, Task


@dataclass
class TrainResult:
    history: list[dict[str, Any]]
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    best_val_loss: float | None = None
    elapsed_s: float = 0.0
    checkpoint: Path | None = None  # the last checkpoint written, if any

    @property
    def final_train_loss(self) -> float | None:
        return self.history[-1]["train_loss"] if self.history else None

    @property
    def final_val_loss(self) -> float | None:
        vals = [h["val_loss"] for h in self.history if h.get("val_loss") is not None]
        return vals[-1] if vals else None


def set_determinism(train_cfg: TrainConfig) -> None:
    if not train_cfg.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if train_cfg.compile or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(True)
    else:
        # The public call imports torch._inductor.config (seconds of start-up) only to set inductor's own
        # flag, which matters only for compiled code; nothing is compiled here: set the ATen flag alone.
        torch._C._set_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@dataclass(frozen=True)
class AfterStep:
    """What falls due after a step (:func:`due`): an evaluation, a checkpoint, a metrics row."""

    evaluate: bool
    checkpoint: bool
    log: bool


def due(train_cfg: TrainConfig, done: int, checkpoints: bool, eval_at_end: bool = False) -> AfterStep:
    """The cadence: what falls due after ``done`` steps. Evaluations come every ``eval_every`` steps and at the end
    (with ``eval_every = 0`` only if ``eval_at_end``); checkpoints (only with ``checkpoints``) at each evaluation,
    every ``ckpt_every`` steps and at the end; rows every ``log_every`` steps, at each evaluation and at the end."""
    last = done == train_cfg.steps
    evaluate = (train_cfg.eval_every > 0 and (done % train_cfg.eval_every == 0 or last)) or (eval_at_end and last)
    ckpt = checkpoints and (evaluate or last or (train_cfg.ckpt_every > 0 and done % train_cfg.ckpt_every == 0))
    return AfterStep(evaluate, ckpt, done % train_cfg.log_every == 0 or evaluate or last)


def _run_record(model: nn.Module, task: Task, run: RunConfig | TrainConfig) -> tuple[TrainConfig, Any]:
    """(the train section the loop runs, what the checkpoints record): ``run`` itself, or for a bare
    TrainConfig the run config of the model and task (a model without a ModelConfig: its dict layout, what
    save_checkpoint can record)."""
    if isinstance(run, RunConfig):
        return run.train, run
    cfg = getattr(model, "config", None)
    if isinstance(cfg, ModelConfig):
        return run, RunConfig(task=task.kind, model=cfg, train=run)
    return run, {"task": task.kind, "model": {}, "train": dataclasses.asdict(run)}


def _to_resume(resume: bool | Checkpoint, out: Path | None) -> Checkpoint | None:
    if isinstance(resume, Checkpoint):
        return resume
    if not resume:
        return None
    if out is None:
        raise ValueError("train: resume=True needs out_dir (the checkpoint is read from out_dir/ckpt)")
    return load_run_checkpoint(out, stream=True)


class Training:
    """One run of the loop, in two phases a caller sees: constructing it sets the run up (device, optimizer, the
    checkpoint to resume restored into the model, the optimizer and the RNGs: a checkpoint that cannot be
    resumed is refused here, before anything is written), :meth:`run` trains. :func:`train` does both; the run
    driver records the run's config between them."""

    def __init__(self, model: nn.Module, task: Task, run: RunConfig | TrainConfig, *,
                 out_dir: str | os.PathLike | None, progress: bool, tokenizer: Any, resume: bool | Checkpoint,
                 quiet: bool) -> None:
        if not hasattr(task, "evaluate"):  # a batch source: next-token prediction on it
            task = LMTask(task, diagnostics=isinstance(model, TransformerLM))
        train_cfg, record = _run_record(model, task, run)
        self.dist = dist = setup_distributed()
        self.device = device = device_for(dist)
        set_determinism(train_cfg)
        self.model, self.task, self.train_cfg, self.quiet = model, task, train_cfg, quiet
        self.out = out = Path(out_dir) if out_dir is not None else None
        self.autocast, need_scaler = autocast_for(device, train_cfg.dtype)
        if out is not None and dist.main and out.is_dir():  # what a killed process left (a run in a study cell too)
            notes = clean_leftovers(out)
            if notes and not quiet:
                print(f"note: {out}: removed what a killed process left: {', '.join(notes)}", file=sys.stderr)
        self.checkpoint = checkpoint = _to_resume(resume, out)
        self.wrapped = prepare_model(model, train_cfg, dist, device)
        self.optimizer = make_optimizer(model, train_cfg)
        self.scaler = torch.amp.GradScaler("cuda") if need_scaler else None
        self.gen = torch.Generator().manual_seed(train_cfg.seed + task.seed_offset)
        self.state = new_state(task.metric_fields)
        if checkpoint is not None:
            restore(checkpoint, self.state, model, self.optimizer, self.scaler, self.gen, train_cfg, dist)
        self.fwd = self.wrapped
        self.wrapped.train()
        self.state["history"] = list(self.state["history"])
        self.start = int(self.state["step"])
        self.log = RunLog(out if dist.main else None, self.state["history"], steps=train_cfg.steps, start=self.start,
                          main=dist.main, progress=progress, quiet=quiet, fields=METRIC_FIELDS + task.metric_fields,
                          trackers=parse_trackers(train_cfg.tracker),
                          config=record.to_dict() if isinstance(record, RunConfig) else record)
        # Attention diagnostics at each evaluation, on one probe batch fixed for the whole run (diagnostics.csv)
        # (and, for the first ``diag_early_steps`` steps, every ``log_every`` steps with the early columns)
        probing = train_cfg.eval_every or task.eval_at_end or train_cfg.diag_early_steps
        self.probe = task.probe(train_cfg) if probing else None
        self.diag_log = (DiagnosticsLog(out / "diagnostics.csv", self.start)
                         if self.probe is not None and self.log.metrics is not None else None)
        self.saver = Saver(out, model, self.optimizer, self.scaler, self.gen, train_cfg, dist, run_config=record,
                           tokenizer=tokenizer, last=checkpoint.path if checkpoint is not None else None)
        # the hooks called with the steps done, at the start and after each step (a retrofit's schedule)
        self.hooks = [RetrofitSchedule(record.retrofit)] if isinstance(record, RunConfig) and \
            record.retrofit.active else []
        for hook in self.hooks:
            hook(model, self.start)
        self.step_fn = TrainStep(task, model, self.optimizer, train_cfg, fwd=self.fwd, wrapped=self.wrapped, dist=dist,
                                 device=device, autocast=self.autocast, scaler=self.scaler,
                                 diverged=self.saver.diverged)

    def run(self) -> TrainResult:
        train_cfg, log = self.train_cfg, self.log
        log.say(backends.describe_line(self.device, train_cfg.dtype))  # runs the kernels' self-checks, before compile
        if self.checkpoint is not None:
            log.say(f"resuming from step {self.start} of {train_cfg.steps} ({self.checkpoint.path})")
        log.open_bar()
        try:
            with StopSignals(hint=self._resume_point, notice=self.dist.main and not self.quiet) as stop:
                for step in range(self.start, train_cfg.steps):
                    self._step(step, stop)
        finally:
            log.close()
        s = self.state
        return TrainResult(history=s["history"], step=s["step"], tokens_seen=s["tokens_seen"],
                           best_val_loss=s["best_val_loss"], elapsed_s=s["elapsed_s"], checkpoint=self.saver.last)

    def _resume_point(self) -> str:
        """What a second Ctrl-C leaves behind (it quits at once, whatever the step in flight is doing)."""
        last = self.saver.last
        return f"the last checkpoint ({last}) is where a resume continues" if last else "no checkpoint was written"

    def _step(self, step: int, stop: StopSignals) -> None:
        train_cfg, state, log = self.train_cfg, self.state, self.log
        t0 = time.perf_counter()
        batch = self.task.get_batch("train", train_cfg.batch_size * train_cfg.grad_accum * self.dist.world, self.gen)
        early = self.probe is not None and step < train_cfg.diag_early_steps and (step + 1) % train_cfg.log_every == 0
        res = self.step_fn(step, batch, grad_groups=early)
        dt = time.perf_counter() - t0
        tokens = self.task.tokens(batch)
        state["step"] = done = step + 1
        for hook in self.hooks:
            hook(self.model, done)
        state["tokens_seen"] += tokens
        state["elapsed_s"] += dt
        log.timed(tokens, dt, res.train_loss)
        after = due(train_cfg, done, self.saver.ckpt_dir is not None, self.task.eval_at_end)
        metrics = self._evaluate(done) if after.evaluate else {}
        improved = bool(metrics) and record_best(self.task.kind, metrics, state, done)
        if after.evaluate or early:
            self._diagnose(done, {**early_diagnostics(self.model, self.probe), **res.grad_groups} if early else {})
        if after.log:
            row = {"step": done, "train_loss": res.train_loss, "val_loss": metrics.get("val_loss"), "lr": res.lr,
                   "grad_norm": res.grad_norm, "tokens_seen": state["tokens_seen"], "tokens_per_s": None,
                   "elapsed_s": state["elapsed_s"]}
            row.update({k: metrics[k] for k in self.task.metric_fields if metrics.get(k) is not None})
            log.row(row, state["elapsed_s"])
        if metrics.get("val_loss") is not None:
            log.say(self.task.eval_line(done, metrics, state["best_val_loss"])
                    + ("" if BY_TASK[self.task.kind][0] == "val_loss" else f"; best {describe_best(state['best'])}"))
        log.tick(tokens, dt, state["best_val_loss"])
        signum = stop.signum
        if self.dist.world > 1:  # every rank stops at the same step, or the collectives of the next one would hang
            signum = int(all_reduce_max(torch.tensor([signum], device=self.device), self.dist).item())
        # On a signal the save is silent: the caller prints the one line (what was saved, how to resume).
        try:
            if (after.checkpoint or signum) and self.saver.save(done, state) and not signum:
                log.say(f"saved checkpoint at step {done}")
            if improved:  # after the last checkpoint: a resume point first, then the best weights beside it
                self.saver.save_best(done, state, self.task.metric_fields)
        except Exception as e:
            if not signum or io_error_in(e) is None:
                raise
            raise TrainingInterrupted(signum, done, None, save_error=io_error_in(e)) from e
        if signum:
            raise TrainingInterrupted(signum, done, self.saver.last if self.saver.ckpt_dir is not None else None)

    def _evaluate(self, done: int) -> dict[str, Any]:
        state = self.state
        metrics = self.task.evaluate(self.fwd, self.train_cfg, step=done, final=done == self.train_cfg.steps,
                                     device=self.device, dist=self.dist, autocast=self.autocast)
        val_loss = metrics.get("val_loss")
        if val_loss is not None:
            if not math.isfinite(val_loss):
                raise self.saver.diverged("validation loss", val_loss, done)
            if state["best_val_loss"] is None or val_loss < state["best_val_loss"]:
                state["best_val_loss"] = val_loss
        state.update({k: metrics.get(k) for k in self.task.metric_fields})
        return metrics

    def _diagnose(self, done: int, early: dict[str, float]) -> None:
        """One diagnostics row (λ, σ, entropies on the probe batch; plus the early-window columns) to
        diagnostics.csv and TensorBoard."""
        if self.probe is None:
            return
        diag = {**{k: v for h in self.hooks for k, v in h.columns().items()},
                **attention_diagnostics(self.model, self.probe), **early}
        if self.diag_log is not None:
            self.diag_log.append(done, diag)
        self.log.scalars(diag, done, prefix="diag/")


def train(
    model: nn.Module,
    task: Task,
    run: RunConfig | TrainConfig,
    *,
    out_dir: str | os.PathLike | None = None,
    progress: bool = True,
    tokenizer: Any = None,
    resume: bool | Checkpoint = False,
    quiet: bool = False,
) -> TrainResult:
    """Train ``model`` on ``task``: a :class:`~diffattn.train.task.Task`, or a :class:`diffattn.data.lm.BatchSource`
    to train a language model ``model(input_ids (B, T)) -> logits (B, T, V)`` on (an :class:`LMTask`).
    ``run``: the run config (its ``train`` section drives the loop; the checkpoints record all of it), or only a
    TrainConfig for a bare model and task (the run config is then the model's own with that train section).

    With ``out_dir``: checkpoints in ``out_dir/ckpt`` (every ``ckpt_every`` steps, at each evaluation, at the
    end; the ``keep_checkpoints - 1`` previous ones stay as ``out_dir/ckpt-step-<N>``), ``metrics.csv`` and
    TensorBoard events (if tensorboard imports). ``resume=True`` continues from the newest good checkpoint in
    ``out_dir`` (or pass a loaded :class:`Checkpoint`). Under torchrun the model is wrapped in DDP or FSDP2
    (``train.parallel``); only rank 0 writes.

    Output (stderr, rank 0): with ``progress`` a bar on a terminal, else one line per ``log_every`` steps; in
    every mode but ``quiet``, a line at each evaluation and checkpoint. SIGINT/SIGTERM finish the step in flight,
    write a checkpoint and raise :class:`TrainingInterrupted`. A NaN/inf loss or gradient norm raises
    :class:`NonFiniteLossError` without touching the last checkpoint. The model is trained in place.
    """
    return Training(model, task, run, out_dir=out_dir, progress=progress, tokenizer=tokenizer, resume=resume,
                    quiet=quiet).run()
