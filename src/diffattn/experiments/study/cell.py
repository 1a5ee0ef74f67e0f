"""One cell of a ``diffattn study``: the run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/`` (``cell.json``, ``ckpt/``,
``metrics.csv``, ``result.json`` once finished) trained, resumed or reused through the run driver
(:func:`run_cell`), the data every cell reads (:func:`load_data`: the tokenizer fitted once per study) and the
full-validation loss a cell reports. A seed fixes the initial weights and the batch order, so arms with the same
seed see the same batches (a paired design). ``events.log`` gets a line per cell start, stop and finish."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffattn.checkpoint.best import BEST
from diffattn.checkpoint.format import Checkpoint, load_checkpoint, save_checkpoint
from diffattn.checkpoint.output_guard import TRAIN_OUTPUTS, OutputInUse
from diffattn.checkpoint.run_folder import LATEST, checkpoint_step
from diffattn.configs.run_config import ConfigError, DataConfig, RunConfig
from diffattn.data.lm import make_source, read_text
from diffattn.data.records import record_files
from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.study.spec import Arm, StudyError, StudySpec
from diffattn.experiments.study.worker_signals import StopRequest, StudyInterrupted
from diffattn.model.tokenizer import build_tokenizer, tokenizer_from_dict
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import atomic_write, names_path, open_nofollow, refuse_links
from diffattn.train.driver import RunFolder, drive
from diffattn.train.loss import cross_entropy
from diffattn.train.run_state import NonFiniteLossError
from diffattn.train.runlog import read_metrics
from diffattn.train.signals import TrainingInterrupted, request_stop

MAX_VAL_TOKENS = 262_144  # the final full-validation pass reads at most this many tokens


def load_data(out: Path, spec: StudySpec) -> tuple[Any, Any]:
    """(source, tokenizer): the tokenizer is fitted once per study and kept in OUT/tokenizer.json."""
    tok_file = out / "tokenizer.json"
    if tok_file.exists():
        return prepare_data(spec, tokenizer_from_dict(read_json(tok_file)))
    source, tok = prepare_data(spec)
    atomic_write(tok_file, json.dumps(tok.to_dict()))
    return source, tok


def prepare_data(spec: StudySpec, tokenizer: Any = None) -> tuple[Any, Any]:
    """(source, tokenizer) in memory, writing nothing: fits the tokenizer unless given. Raises DataError (a
    ValueError, one line) for missing, empty, binary or non-UTF-8 data and for splits shorter than a window."""
    if tokenizer is not None:
        tok = tokenizer
    elif spec.source:  # --from SRC: the text is read with SRC's own tokenizer, never one fitted here
        from diffattn.experiments.study.source import read_source  # lazy: it imports the conversion recipes

        tok = read_source(spec.source)[1]
    elif record_files(spec.data.path) is not None:
        # a record corpus (.jsonl, ...) streams: its tokenizer is fitted on a sample and it is tokenized once into
        # the token cache, where every later read (the cells') finds it, instead of being read whole here
        return make_source({**data_config(spec).to_dict(), "vocab_size": spec.data.vocab_size}, spec.train.seq_len)
    else:
        tok = build_tokenizer(spec.data.tokenizer, read_text(spec.data.path), spec.data.vocab_size)
    return make_source(data_config(spec).to_dict(), spec.train.seq_len, tokenizer=tok)


def data_config(spec: StudySpec) -> DataConfig:
    """The data every cell of the study reads."""
    # the tokenizer is fitted once per study (spec.data.vocab_size its BPE size): the cells read the data with it
    return dataclasses.replace(spec.data, vocab_size=None)


def cell_config(spec: StudySpec, arm: Arm, lr: float, seed: int, vocab_size: int,
                d_model: int | None = None) -> RunConfig:
    """The run config of a cell (its ``cell.json``; the checkpoints record it too)."""
    model = spec.arm_config(arm, vocab_size, d_model)
    retrofit = spec.retrofit(arm.attention)
    if retrofit.active:  # the run converts SRC in memory and anneals it (train.retrofit): its model is SRC's
        model = spec.model
    return RunConfig(task="lm", model=model, train=spec.train_config(lr, seed), data=data_config(spec),
                     retrofit=retrofit, study={"arm": arm.name, "lr": lr, "seed": seed, "d_model": model.d_model})


def _same_config(cfg_file: Path, run: RunConfig) -> bool:
    """Whether the cell's folder was trained with ``run`` (a ``cell.json`` of an older version is read as
    that version wrote it: fields it lacks are their defaults)."""
    try:
        return RunConfig.from_dict(read_json(cfg_file)) == run
    except (OSError, ValueError, ConfigError):
        return False


def chars_per_token(source: Any, tokenizer: Any) -> float:
    """Characters per token of the validation split, measured by decoding it (1.0 for the char tokenizer)."""
    a, b = source.splits["val"]
    ids = np.asarray(source.tokens[a:b], dtype=np.int64).tolist()
    return len(tokenizer.decode(ids)) / max(1, len(ids))


@torch.no_grad()
def full_val_loss(model: torch.nn.Module, source: Any, seq_len: int, max_tokens: int = MAX_VAL_TOKENS) -> float:
    """Mean next-token loss (nats) over the validation split read as consecutive non-overlapping windows
    (up to ``max_tokens``): the same tokens for every cell, unlike the sampled in-training evaluations."""
    a, b = source.splits["val"]
    b = min(b, a + max_tokens + 1)
    starts = list(range(a, b - seq_len, seq_len))
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(starts), 32):
            w = np.stack([np.asarray(source.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts[i:i + 32]])
            w = torch.from_numpy(w)
            logits = model(w[:, :-1])
            total += float(cross_entropy(logits, w[:, 1:]))
            count += w[:, 1:].numel()
    finally:
        model.train(was)
    return total / max(1, count)


def _event(out: Path, what: str) -> None:
    line = f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%S} {socket.gethostname()}:{os.getpid()} {what}\n"
    with names_path(out / "events.log"), open_nofollow(out / "events.log", "a") as f:
        f.write(line)


def read_json(path: Path) -> Any:
    """A JSON file of the study's folder, never read through a link (what it holds goes into the report)."""
    with open_nofollow(path) as f:
        return json.loads(f.read())


def log(msg: str) -> None:
    """A line on stderr with the time: the study's progress lines."""
    print(f"{datetime.now():%H:%M:%S} {msg}", file=sys.stderr, flush=True)


def run_cell(out: Path, spec: StudySpec, arm: Arm, lr: float, seed: int, source: Any, tokenizer: Any,
             d_model: int | None = None, progress_s: float = 60.0, bar: bool = False,
             quiet: bool = True, stop: StopRequest | None = None,
             record: Callable[[str, Callable[[], dict]], dict] | None = None) -> dict[str, Any]:
    """Train (or resume, or reuse) one cell; -> its result.json dict. A line every ``progress_s`` while it trains
    (or with ``bar`` the loop's progress bar); ``stop``: the worker's signal handler (a signal then saves the cell
    and raises StudyInterrupted); ``record(name, train)`` runs the training once the cell's lock is held
    (the worker's Optuna log, :class:`~diffattn.experiments.study.optuna_log.CellRecord`). The seed fixes the initial
    weights and the batch order, so arms with the same seed see the same batches. A NaN/inf loss ends the cell as
    diverged (val_loss inf): a result about that learning rate, not a crash."""
    size = d_model if d_model not in (None, spec.model.d_model) else None
    name = cell_name(arm.name, lr, seed, size)
    folder = out / "cells" / name
    res_file = folder / "result.json"
    refuse_links(out, ["cells"])  # written into in place: a planted link would lead the cell's files elsewhere
    refuse_links(out / "cells", [name])
    if res_file.exists():
        return read_json(res_file)
    folder.mkdir(parents=True, exist_ok=True)
    # its links are refused below, inside the lock; only another worker's lock is waited on (a planted link as the
    # lock file is an OutputError, not OutputInUse: the cell fails in one line instead of waiting for ever)
    with ExitStack() as stack:
        try:  # one worker per cell, even when a slow one was thought dead and its cell handed out again
            run_folder = stack.enter_context(RunFolder(folder, policy="reuse", command=f"a study worker, cell {name}",
                                                       quiet=True, written=()))
        except OutputInUse as e:
            raise CellInUse(str(e)) from None
        refuse_links(folder, (*TRAIN_OUTPUTS, "cell.json", "result.json"))  # before the cell changes anything
        if res_file.exists():  # finished by the worker that held it
            return read_json(res_file)
        train = lambda: _train_cell(out, spec, arm, lr, seed, source, tokenizer, d_model,  # noqa: E731
                                    progress_s, name, run_folder, bar, quiet, stop)
        return record(name, train) if record else train()


class CellInUse(Exception):
    """Another live worker holds the cell's folder (it is training it)."""


def _train_cell(out: Path, spec: StudySpec, arm: Arm, lr: float, seed: int, source: Any, tokenizer: Any,
                d_model: int | None, progress_s: float, name: str, run_folder: RunFolder, bar: bool = False,
                quiet: bool = True, guard: StopRequest | None = None) -> dict[str, Any]:
    """run_cell once the cell's folder is held: train (or resume, or reuse) it through the run driver and write
    result.json."""
    folder = run_folder.path
    res_file = folder / "result.json"
    run = cell_config(spec, arm, lr, seed, source.vocab_size, d_model)
    cfg = run.model
    cfg_file = folder / "cell.json"
    if cfg_file.exists() and not _same_config(cfg_file, run):
        raise StudyError(f"{folder} was trained with another configuration; use a new --out folder")
    atomic_write(cfg_file, json.dumps(run.to_dict(), indent=2) + "\n")
    ckpt = folder / LATEST
    start_step = (checkpoint_step(ckpt) or 0) if (ckpt / "config.json").exists() else 0
    _event(out, f"start {name} step={start_step}")
    stop = threading.Event()
    ticker = threading.Thread(target=_progress_lines, args=(folder, name, spec.train.steps, progress_s, stop),
                              daemon=True)
    if not bar:  # a line from it would break the bar's line
        ticker.start()
    t0 = time.perf_counter()
    diverged = None
    try:
        init = _source_init(spec, arm, run, seed) if spec.source and start_step == 0 else None
        # once the model holds the initial weights, their copy is let go (a pretrained model's size, for the run)
        outcome = drive(_resumed_as(run, ckpt) if start_step else run, run_folder, init=init, source=source,
                        tokenizer=tokenizer, progress=bar, quiet=quiet, loop_guard=_guarded(guard),
                        on_start=(lambda *_: init.state_dict.clear()) if init else None)
        model, tr = outcome.model, outcome.result
        history, elapsed, step = tr.history, tr.elapsed_s, tr.step
        val_loss = full_val_loss(model, source, spec.train.seq_len, spec.val_tokens or MAX_VAL_TOKENS)
    except NonFiniteLossError as e:
        diverged = str(e)
        history, elapsed, step, val_loss = [], time.perf_counter() - t0, None, math.inf
        with torch.device("meta"):  # its size, for the result: the weights are not needed
            model = TransformerLM(cfg)
    except (TrainingInterrupted, StudyInterrupted) as e:
        in_loop = isinstance(e, TrainingInterrupted)
        if in_loop and guard is not None:
            guard.signum = guard.signum or e.signum  # a further signal now quits at once
        # train saved the cell at e.step: the next run resumes it there; outside train's loop (or when that save
        # failed) the last checkpoint is where the cell stands
        at = e.step if in_loop and e.save_error is None else checkpoint_step(ckpt) or 0
        _event(out, f"stop {name} step={at}")
        raise StudyInterrupted(e.signum, (name, at)) from None
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()
    result = {"cell": name, "arm": arm.name, "attention": arm.attention, "n_heads": arm.n_heads,
              "d_model": cfg.d_model, "lr": lr, "seed": seed, "steps": spec.train.steps, "step": step,
              "tokens": spec.train.steps * spec.train.batch_size * spec.train.seq_len, "params": model.num_params(),
              "non_embedding_params": model.num_params(exclude_embeddings=True),
              "val_loss": val_loss,  # nats/token, full validation split
              "diverged": diverged, "train_seconds": elapsed,
              "history": [{k: h.get(k) for k in ("step", "tokens_seen", "train_loss", "val_loss")} for h in history]}
    if spec.source and diverged is None:
        _slim(folder)
    atomic_write(res_file, json.dumps(result, indent=1, default=float) + "\n")
    _event(out, f"done {name} val_loss={val_loss:.4f}")
    return result


def _slim(folder: Path) -> None:
    """A finished cell of a ``--from`` study keeps its final weights only: nothing resumes a finished cell, and a
    pretrained model's optimizer state (twice its weights) and best checkpoint would fill the disk over a grid.
    The checkpoint is rewritten atomically (a cell stopped here is reused from either version)."""
    checkpoint = load_checkpoint(folder / LATEST)
    if checkpoint.optimizer_state:
        save_checkpoint(folder / LATEST, checkpoint.state_dict, run_config=checkpoint.run_config,
                        tokenizer=checkpoint.tokenizer, train_state=checkpoint.train_state, rng=checkpoint.rng)
    shutil.rmtree(folder / BEST, ignore_errors=True)


def _source_init(spec: StudySpec, arm: Arm, run: RunConfig, seed: int) -> Checkpoint:
    """With ``--from SRC``, a new cell's initial weights: SRC's (the ``standard`` arm) or SRC converted exactly to
    the arm's type (:func:`~diffattn.experiments.study.source.arm_init`). Only a cell at step 0 asks: one with a
    checkpoint resumes from it."""
    from diffattn.experiments.study.source import arm_init  # lazy: it imports the conversion recipes

    # a retrofit (--retrofit-steps) starts from SRC itself: the run converts it in memory at the schedule's s = 0
    kind = "standard" if run.retrofit.active else arm.attention
    return Checkpoint(path=Path(spec.source), run_config=run, state_dict=arm_init(spec.source, kind, seed))


def _resumed_as(run: RunConfig, ckpt: Path) -> RunConfig:
    """The run a cell with a checkpoint continues: a retrofit recorded the model it converted SRC into (its
    checkpoint's), which the cell's own config (SRC's model and the schedule) does not name."""
    if not run.retrofit.active:
        return run
    return run.replace(model=load_checkpoint(ckpt, tensors=False).run_config.model)


@contextmanager
def _guarded(guard: StopRequest | None) -> Iterator[None]:
    """Around a cell's training loop: the worker's handler knows a loop is running (a signal before the loop's
    own handler is installed asks it to stop after its first step); a signal that came while the cell was set up
    keeps it from starting; a stop the loop never took (it had finished) is withdrawn after it."""
    if guard is None:
        yield
        return
    guard.training = True
    try:
        if guard.signum:  # the signal came while this cell was being set up: do not start it
            raise StudyInterrupted(guard.signum)
        yield
    finally:
        guard.training = False
        request_stop(0)  # a stop train never took (it had finished): the worker stops after this cell


def _progress_lines(folder: Path, name: str, steps: int, every_s: float, stop: threading.Event) -> None:
    """One readable line per interval while a cell trains (read from its metrics.csv): works the same when
    stderr is a file, where carriage-return progress bars pile up into one enormous line."""
    while not stop.wait(every_s):
        try:
            rows = read_metrics(folder / "metrics.csv")
            row, val = rows[-1], [r["val_loss"] for r in rows if r.get("val_loss") is not None]
            log(f"{name}: step {row['step']:.0f}/{steps}, train loss {row['train_loss']:.3f}"
                + (f", val {val[-1]:.3f}" if val else "")
                + (f", {row['tokens_per_s']:,.0f} tok/s" if row.get("tokens_per_s") else ""))
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            continue
