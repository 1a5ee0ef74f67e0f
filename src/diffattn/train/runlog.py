"""What a training run reports while it runs: ``metrics.csv`` (one row per ``log_every`` steps and per
evaluation), the same scalars to the trackers ``train.tracker`` names (TensorBoard events in ``tb/`` when
tensorboard imports, Weights & Biases: :mod:`diffattn.train.trackers`), and on stderr either a progress bar (on a
terminal) or one line per logged step with an ETA, plus the lines every mode but ``quiet`` prints (evaluations,
checkpoints). Only the main rank writes or prints."""

from __future__ import annotations

import csv
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from diffattn.system.atomic_files import atomic_output, names_path, open_nofollow
from diffattn.train.trackers import WandbTracker

METRIC_FIELDS = (
    "step",
    "train_loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_seen",
    "tokens_per_s",
    "elapsed_s",
)
TB_SCALARS = ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s")


def eta_seconds(elapsed_here_s: float, steps_here: int, steps_left: int) -> float:
    """Seconds left at the rate of the steps run in this process. After a resume the checkpoint's elapsed time
    covers steps this process never ran, so dividing it by this process's steps made the ETA many times too
    long."""
    return elapsed_here_s / max(steps_here, 1) * max(steps_left, 0)


def fmt_duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _csv_row(row: dict[str, Any], fields: tuple[str, ...]) -> dict[str, str]:
    return {k: ("" if row.get(k) is None else repr(row[k])) for k in fields}


def write_metrics(path: Path, history: list[dict[str, Any]], fields: tuple[str, ...] = METRIC_FIELDS) -> None:
    """The whole file from ``history``, atomically (a resume that fails half-way keeps the old file)."""
    with atomic_output(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in history:
            w.writerow(_csv_row(row, fields))


def append_metrics(path: Path, row: dict[str, Any], fields: tuple[str, ...] = METRIC_FIELDS) -> None:
    """One row. A row torn by a failed write is dropped on resume, which rewrites the file from the checkpoint."""
    with names_path(path), open_nofollow(path, "a", newline="") as f:  # a planted link is refused, not followed
        csv.DictWriter(f, fieldnames=fields, extrasaction="ignore").writerow(_csv_row(row, fields))


def read_metrics(path: str | os.PathLike) -> list[dict[str, float | None]]:
    """metrics.csv -> list of dicts (empty cells -> None)."""
    with open_nofollow(path, newline="") as f:
        return [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]


_tb_notice_shown = False
_held_notes: list[str] | None = None  # inside notes_last(): the notes it prints when it ends


@contextmanager
def notes_last() -> Iterator[None]:
    """While active, the notes about an optional tracker (a missing TensorBoard) wait, and are printed once when
    it ends: after the command's own closing lines (``compare``'s verdict), not as its first line. Outside it
    they are printed as they come (``train``'s note before its first step)."""
    global _held_notes
    if _held_notes is not None:  # nested: the outermost prints
        yield
        return
    _held_notes = []
    try:
        yield
    finally:
        held, _held_notes = _held_notes, None
        for note in held:
            print(note, file=sys.stderr, flush=True)


def _note(text: str) -> None:
    if _held_notes is not None:
        _held_notes.append(text)
    else:
        print(text, file=sys.stderr, flush=True)


def tensorboard_writer(out_dir: Path, purge_step: int | None) -> Any:
    """A SummaryWriter on ``out_dir/tb``, or None when TensorBoard cannot be imported: it is optional, so training
    goes on, and one line per process says why there is no tb/ (a study or compare trains many models)."""
    global _tb_notice_shown
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency
    except Exception as e:  # not installed, or broken (e.g. a protobuf mismatch raises other errors than ImportError)
        if not _tb_notice_shown:
            _tb_notice_shown = True
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            where = "no run folder's tb/" if _held_notes is not None else f"no {out_dir / 'tb'}"
            _note(f"note: TensorBoard logging is off ({where}): cannot import torch.utils.tensorboard ({reason}); "
                  "`pip install tensorboard` turns it on")
        return None
    return SummaryWriter(str(out_dir / "tb"), purge_step=purge_step)


class RunLog:
    """The run's outputs other than checkpoints. ``out`` is None on other ranks than the main one and for a run
    without a folder; ``main`` says whether this process prints. ``history`` (the rows so far, restored on
    resume) is extended in place by :meth:`row`."""

    def __init__(self, out: Path | None, history: list[dict[str, Any]], *, steps: int, start: int, main: bool,
                 progress: bool, quiet: bool, fields: tuple[str, ...] = METRIC_FIELDS,
                 trackers: tuple[str, ...] = ("tensorboard",), config: dict[str, Any] | None = None) -> None:
        self.history, self.steps, self.start, self.main = history, steps, start, main
        self.progress, self.quiet, self.fields = progress, quiet, fields
        self.interactive = progress and main and sys.stderr.isatty()
        self.metrics: Path | None = None
        self.tb: Any = None
        self.wandb: WandbTracker | None = None
        self.bar: Any = None
        self.elapsed_here = 0.0  # training time of this process alone (the ETA's rate; elapsed_s includes resumed)
        self._window_tokens, self._window_time, self._ema = 0, 0.0, None
        if out is not None and main:
            out.mkdir(parents=True, exist_ok=True)
            self.metrics = out / "metrics.csv"
            write_metrics(self.metrics, history, fields)  # on resume this drops rows logged after the checkpoint
            if "tensorboard" in trackers:
                self.tb = tensorboard_writer(out, purge_step=start + 1 if start else None)
            if "wandb" in trackers:
                self.wandb = WandbTracker(out, resumed=start > 0, config=config)

    def say(self, msg: str) -> None:
        if self.quiet or not self.main:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def open_bar(self) -> None:
        if self.interactive:
            # quiet: the caller prints its own line when this run ends (a study cell), so the bar leaves none
            self.bar = tqdm(total=self.steps, initial=self.start, unit="step", dynamic_ncols=True, file=sys.stderr,
                            leave=not self.quiet)

    def timed(self, tokens: int, dt: float, train_loss: float) -> None:
        """One optimizer step took ``dt`` seconds for ``tokens`` tokens."""
        self.elapsed_here += dt
        self._window_tokens += tokens
        self._window_time += dt
        self._ema = train_loss if self._ema is None else 0.9 * self._ema + 0.1 * train_loss

    def scalars(self, values: dict[str, float], step: int, prefix: str = "") -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{prefix}{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}{k}": v for k, v in values.items()}, step)

    def row(self, row: dict[str, Any], elapsed_s: float) -> None:
        """Log one metrics row (``row["step"]`` steps done); its tokens_per_s is the rate since the last row."""
        row["tokens_per_s"] = self._window_tokens / max(self._window_time, 1e-9)
        self.history.append(row)
        self._window_tokens, self._window_time = 0, 0.0
        if self.metrics is not None:
            append_metrics(self.metrics, row, self.fields)
        scalars = TB_SCALARS + tuple(f for f in self.fields if f not in METRIC_FIELDS)
        self.scalars({k: row[k] for k in scalars if row.get(k) is not None}, row["step"])
        if self.progress and not self.interactive:
            step = row["step"]
            eta = eta_seconds(self.elapsed_here, step - self.start, self.steps - step)
            self.say(f"step {step}/{self.steps} | loss {row['train_loss']:.4f} | lr {row['lr']:.2e} | "
                     f"{row['tokens_per_s']:,.0f} tok/s | elapsed {fmt_duration(elapsed_s)} | "
                     f"ETA {fmt_duration(eta)}")

    def tick(self, tokens: int, dt: float, best_val_loss: float | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{self._ema:.4f}", "tok/s": f"{tokens / max(dt, 1e-9):,.0f}"}
            if best_val_loss is not None:
                post["val"] = f"{best_val_loss:.4f}"
            self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
