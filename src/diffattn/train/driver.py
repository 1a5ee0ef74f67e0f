"""The run driver: every command that trains goes through :func:`drive` (``diffattn train``, each model of
``diffattn compare``, each cell of ``diffattn study``), with a typed :class:`~diffattn.configs.run_config.RunConfig`
and a :class:`RunFolder`.

A run folder has a policy for what it may already hold (:data:`POLICIES`):

* ``"refuse"``: a new run (``diffattn train``): a folder holding a run is refused unless ``overwrite`` (then the
  old run is removed when the folder is claimed); one that stopped before its first checkpoint is started again.
  A run that fails before its first checkpoint removes what it wrote.
* ``"resume"``: continue the run in the folder from its newest good checkpoint (``diffattn train --resume``).
* ``"reuse"``: a folder an experiment manages (a compare model, a study cell): a finished run there is loaded, not
  trained again; an unfinished one continues; an empty one starts. The experiment guards its own folder and
  records its own settings (``config.json``, ``cell.json``, ``result.json``).

:func:`drive` holds the folder (its lock, from before it is read until the run ends), claims it once the data and
the model are built, builds the model (a language model, or a classifier for ``task = "classify"``), trains it
through the one loop (:class:`diffattn.train.loop.Training`) and returns a :class:`RunOutcome`. Every stop and failure
propagates as an exception; :func:`exit_code` maps each to one exit code (0 done; 2 bad input; 3 a NaN/inf loss;
130 / 143 Ctrl-C / SIGTERM; 74 a storage failure) and :func:`failure_line` to its one line.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.checkpoint.format import MANIFEST, Checkpoint
from diffattn.checkpoint.output_guard import TRAIN_OUTPUTS, OutputFolder, check_output_dir
from diffattn.checkpoint.run_folder import LATEST, checkpoint_step, load_run_checkpoint, previous_checkpoints
from diffattn.configs.run_config import RunConfig
from diffattn.configs.toml_writer import to_toml
from diffattn.data.lm import make_source
from diffattn.model.init import materialize
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import Refused, atomic_write, printable
from diffattn.system.io_errors import EX_IOERR, WRITE_FAILURES, io_error_in, io_error_line
from diffattn.train.distributed import env_int, setup_distributed
from diffattn.train.loop import Training, TrainResult
from diffattn.train.preflight import check_memory
from diffattn.train.retrofit import freeze, retrofit_model
from diffattn.train.run_state import NonFiniteLossError
from diffattn.train.signals import TrainingInterrupted

POLICIES = ("refuse", "resume", "reuse")
EXIT_USAGE, EXIT_DIVERGED = 2, 3
# A failure of the inputs (config, data, folder, checkpoint): one line, exit 2, whenever it happens.
# Every library refusal is a Refused (a ConfigError, DataError, CheckpointError, OutputError, BackendError, a
# folder leading outside itself, a model too large, RANK=abc).
USAGE_ERRORS = (Refused,)


def main_rank() -> bool:
    """Whether this process writes the run folder: under torchrun only rank 0 touches it."""
    return env_int("RANK") == 0


class RunFolder(OutputFolder):
    """The folder of one run for one command (module docstring: ``policy``): an
    :class:`~diffattn.checkpoint.output_guard.OutputFolder` (``with folder:`` holds it, as soon as it exists, until
    the block ends) that only the main rank writes. ``command`` names the holder in another process's refusal,
    ``hint`` ends it; ``source``: a folder the run reads (``--init-from``), which the output may not be or lie in;
    ``quiet``: no line about what a killed process left (a study cell).

    A run goes through the folder's phases in one order, each a call that returns or raises (no flag is read back
    afterwards): held (``with folder:``), :meth:`check` (valid for the policy, nothing changed), :meth:`claim_run`
    (the folder made this run's; a new run that then fails in the block before its first checkpoint leaves the
    folder as it found it), let go when the block ends."""

    def __init__(self, path: str | os.PathLike, *, policy: str = "refuse", overwrite: bool = False,
                 command: str = "diffattn train", hint: str = "", source: str | None = None,
                 quiet: bool = False, written: Iterable[str] = TRAIN_OUTPUTS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        super().__init__(path, command, hint=hint, written=written, quiet=quiet, source=source)
        self.policy, self.overwrite = policy, overwrite

    def writes(self) -> bool:
        return main_rank()

    def check(self) -> None:
        """Validate the folder for the policy without changing anything (raises OutputError): a new run's folder
        holds no run (a run that stopped before its first checkpoint may be started again); a resumed one can
        still be written."""
        if not main_rank() or self.policy == "reuse":
            return
        overwrite = self.overwrite or self.policy == "resume"  # resuming replaces its own outputs
        check_output_dir(self.path, overwrite=overwrite, source=self.source, restart_unsaved=True)

    def claim_run(self) -> None:
        """The folder made this run's: created and held; for a new run, the old one removed (``overwrite``), or one
        that stopped before its first checkpoint, saying so, and the claim taken back if the block raises."""
        if self.policy == "reuse":  # an experiment's folder: it manages what the folder holds
            self.claim()
        if self.policy != "refuse":  # a resumed run's folder is its own already
            return
        removed = self.claim(patterns=TRAIN_OUTPUTS, overwrite=self.overwrite, restart_unsaved=True, undo=True)
        if removed and self.overwrite:
            print(f"note: --overwrite: removed the previous run in {self.path} "
                  f"({', '.join(p.name for p in removed)})", file=sys.stderr)
        elif removed:
            print(f"note: {self.path} held a run stopped before its first checkpoint (nothing to resume); starting "
                  f"it again (replaced {', '.join(p.name for p in removed)})", file=sys.stderr)

    def undo(self) -> bool:
        removed = super().undo()
        if removed:
            print(f"note: removed what this run wrote in {self.path}: it failed before its first checkpoint",
                  file=sys.stderr)
        return removed


@dataclass
class RunOutcome:
    """A run driven to its end: the loop's result, the trained (or reused) model, the task hook it trained on,
    the tokenizer, the run config with its model resolved; ``reused``: a finished run loaded, not trained;
    ``train_s``: seconds of this process's training; ``earlier_s``: training seconds of the processes before
    (a resumed or reused run)."""

    result: TrainResult
    model: nn.Module
    task: Any
    tokenizer: Any
    run: RunConfig
    reused: bool = False
    train_s: float = 0.0
    earlier_s: float = 0.0


def drive(run: RunConfig, folder: RunFolder, *, checkpoint: Checkpoint | None = None, init: Checkpoint | None = None,
          source: Any = None, tokenizer: Any = None, progress: bool = True, quiet: bool = False,
          on_start: Callable[[RunConfig, nn.Module, Checkpoint | None], None] | None = None,
          loop_guard: AbstractContextManager | None = None) -> RunOutcome:
    """Train ``run`` in ``folder`` (module docstring); -> :class:`RunOutcome`. ``checkpoint``: the checkpoint to resume
    (already read and checked by the caller); ``init``: a checkpoint whose weights a new run starts from;
    ``source`` / ``tokenizer``: the data, already built by the caller (an experiment shares it between runs),
    else built from ``run.data``; ``on_start``: called once the run has started (the folder claimed, the
    checkpoint restored), before the first step (with the checkpoint it resumes); ``loop_guard``: entered around
    the steps only. Holds the folder until it returns (a folder the caller holds stays held); raises what
    stopped the run (see :func:`exit_code`).

    The phases, in order: hold the folder; the inputs (the checkpoint to reuse or resume, the data and the model:
    what fails here is bad input, :class:`InputError`); claim the folder; set the loop up (a resumed run's
    checkpoint restored into it); record ``resolved.toml`` (a user's run folder), so a run refused in any phase
    before leaves it as it was; train."""
    dist = setup_distributed()
    try:
        with folder:  # a hold the caller took outlives the block
            if folder.policy == "reuse" and checkpoint is None:
                checkpoint = _reuse_point(folder.path)
            if (checkpoint is not None and folder.policy == "reuse"
                    and int(checkpoint.train_state.get("step", 0)) >= run.train.steps):
                return _reused(run, checkpoint, folder, source, tokenizer)
            if checkpoint is None and folder.policy == "resume":
                checkpoint = load_run_checkpoint(folder.path, stream=True)
            run, model, task, tokenizer = inputs(run, checkpoint, init, source, tokenizer)
            folder.claim_run()  # a new run failing from here on leaves the folder as it found it
            loop = Training(model, task, run, out_dir=folder.path, progress=progress, tokenizer=tokenizer,
                            resume=checkpoint if checkpoint is not None else False, quiet=quiet)
            if folder.policy != "reuse" and dist.main:  # a user's run folder records its resolved config
                atomic_write(folder.path / "resolved.toml", to_toml(run.to_dict()))
            if on_start is not None and dist.main:
                on_start(run, model, checkpoint)
            t0 = time.perf_counter()
            with loop_guard or nullcontext():
                res = loop.run()
            earlier = float(checkpoint.train_state.get("elapsed_s", 0.0)) if checkpoint is not None else 0.0
            return RunOutcome(res, model, task, tokenizer, run, train_s=time.perf_counter() - t0, earlier_s=earlier)
    finally:
        if dist.initialized_here:
            torch.distributed.destroy_process_group()


class InputError(Refused):
    """The data or the model of a run could not be read or built (a ValueError or a read error while the inputs
    were built): bad input, whatever raised it (exit 2)."""


def inputs(run: RunConfig, checkpoint: Checkpoint | None = None, init: Checkpoint | None = None, source: Any = None,
           tokenizer: Any = None) -> tuple[RunConfig, nn.Module, Any, Any]:
    """:func:`build`, then the memory check (the vocabulary and classes are known now); a ValueError or an error
    reading a file raised here is bad input: :class:`InputError` with its message (a storage failure while the
    token cache is written stays one: exit 74)."""
    try:
        run, model, task, tokenizer = build(run, checkpoint, init, source, tokenizer)
        check_memory(run)
    except USAGE_ERRORS:
        raise
    except OSError as e:
        if e.errno in WRITE_FAILURES:
            raise
        raise InputError(printable(e)) from e
    except ValueError as e:
        raise InputError(printable(e)) from e
    return run, model, task, tokenizer


def build(run: RunConfig, checkpoint: Checkpoint | None = None, init: Checkpoint | None = None, source: Any = None,
          tokenizer: Any = None) -> tuple[RunConfig, nn.Module, Any, Any]:
    """(run with its model resolved, model, task hook or batch source, tokenizer): a classifier for ``task =
    "classify"``, else a language model on ``source`` (or the data of ``run.data``). The model is built on the
    meta device (the loop allocates it and initialises it from ``torch.manual_seed(train.seed)``: the weights of
    the model built eagerly after that seed), or from ``init``'s weights."""
    if run.task == "classify":
        from diffattn.train.classify import build_classifier  # lazy: an LM run need not load the classifier

        return build_classifier(run, checkpoint)
    train_cfg = run.train
    if source is None:
        given = checkpoint.tokenizer if checkpoint is not None else init.tokenizer if init is not None else None
        # the data layer reads the [data] section as a mapping (it knows no run config)
        source, tokenizer = make_source(run.data.to_dict(), train_cfg.seq_len, tokenizer=given, seed=train_cfg.seed)
    run = run.resolve_model(getattr(tokenizer, "vocab_size", None) or getattr(source, "vocab_size", None))
    if init is not None and checkpoint is None:
        torch.manual_seed(train_cfg.seed)
        model = TransformerLM(run.model)
        model.load_state_dict(init.state_dict, strict=True)
        if run.retrofit.active:  # the source converted in memory: the run records the target's config
            model, _ = retrofit_model(model, run.retrofit, source=source, seed=train_cfg.seed)
            run = run.replace(model=model.config)
    else:
        with torch.device("meta"):
            model = TransformerLM(run.model)
    freeze(model, run.retrofit)
    return run, model, source, tokenizer


def _reuse_point(path: Path) -> Checkpoint | None:
    """The newest good checkpoint of an experiment's run folder, or None when it has none (a fresh start)."""
    if not (path / LATEST).exists() and not previous_checkpoints(path):
        return None
    return load_run_checkpoint(path)


def _reused(run: RunConfig, checkpoint: Checkpoint, folder: RunFolder, source: Any, tokenizer: Any) -> RunOutcome:
    """A run an earlier process finished: its weights in the model (built as training would build it, after
    the same seed), its result and training time as recorded."""
    run, model, task, tokenizer = inputs(run, checkpoint, None, source, tokenizer)
    torch.manual_seed(run.train.seed)
    materialize(model, torch.device("cpu"))
    model.load_state_dict(checkpoint.state_dict)
    ts = checkpoint.train_state
    res = TrainResult(history=ts.get("history", []), step=int(ts["step"]), tokens_seen=ts.get("tokens_seen", 0),
                      best_val_loss=ts.get("best_val_loss"), elapsed_s=ts.get("elapsed_s", 0.0),
                      checkpoint=folder.path / LATEST)
    return RunOutcome(res, model, task, tokenizer, run, reused=True, earlier_s=float(ts.get("elapsed_s", 0.0)))


# ------------------------------------------------------------------------------------ how a run ends
def exit_code(e: BaseException) -> int | None:
    """The exit code a command that raised ``e`` ends with; None when ``e`` is no expected failure (it
    propagates). A stop (Ctrl-C, SIGTERM: a training loop's, an experiment's) carries its own ``exit_code``; bad
    input (:data:`USAGE_ERRORS`, :class:`InputError` among them) is 2."""
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(getattr(e, "exit_code", None), int):  # the user stopped it: its signal's code
        return e.exit_code
    if isinstance(e, NonFiniteLossError):
        return EXIT_DIVERGED
    if isinstance(e, USAGE_ERRORS):
        return EXIT_USAGE
    if isinstance(e, Exception) and io_error_in(e) is not None:
        return EX_IOERR
    return None


def kept_checkpoint(out: Path) -> tuple[Path, int] | None:
    """(the newest checkpoint of the run folder ``out`` that records its step, that step), or None."""
    for cand in (out / LATEST, *previous_checkpoints(out)):
        step = checkpoint_step(cand) if (cand / MANIFEST).is_file() else None
        if step is not None:
            return cand, step
    return None


def resume_hint(out: Path, resume: str) -> str:
    """What a second Ctrl-C leaves: how to resume, or that no checkpoint was written."""
    if (out / LATEST / MANIFEST).is_file():
        return f"resume with: {resume}"
    return f"no checkpoint was written in {out}"


def failure_line(e: BaseException, code: int, out: Path | None, resume: str) -> str:
    """The one line of a run that ended with ``code`` (:func:`exit_code`): a stop names the step and how to
    resume (``resume``, the command that continues), a storage failure the path, its cause, the checkpoint kept
    and how to continue; anything else is ``error: ...``."""
    if isinstance(e, TrainingInterrupted) and e.save_error is not None:
        return _storage_line(e.save_error, out, resume, prefix=f"interrupted ({signal.Signals(e.signum).name}) "
                                                               f"after step {e.step}, but its checkpoint could not "
                                                               "be saved: ")
    if isinstance(e, TrainingInterrupted):
        return (f"saved checkpoint at step {e.step}; resume with: {resume}" if e.checkpoint is not None
                else f"interrupted after step {e.step}")
    if code == EX_IOERR:
        return _storage_line(io_error_in(e), out, resume)
    return f"error: {printable(e)}"


def _storage_line(err: OSError | None, out: Path | None, resume: str, prefix: str = "error: ") -> str:
    kept = kept_checkpoint(out) if out is not None else None
    what, then = ((f"the checkpoint at step {kept[1]} ({kept[0]})", resume) if kept is not None
                  else ("nothing (no checkpoint had been written)", "run the same command again"))
    return io_error_line(err, kept=what, then=then, where=out, prefix=prefix)
