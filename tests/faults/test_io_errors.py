"""Storage failures other than a full disk at one write, in-process: a read-only disk, TensorBoard's writer thread,
the study's database full or damaged, a worker that must stop at the first failure, a checkpoint replaced while it
is read, a second command on a run folder (the lock), leftovers of killed processes, a run stopped before its first
checkpoint, and readers of a run whose data changed or whose ckpt/ was deleted."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from faultinject import CORPUS, inject, leftovers, tiny_run

import diffattn.train.runlog as runlog
from diffattn.checkpoint import format as ckmod
from diffattn.checkpoint.format import load_checkpoint, verify_checkpoint
from diffattn.checkpoint.output_guard import clean_leftovers
from diffattn.cli.main import main
from diffattn.experiments.study.optuna_log import CellRecord, open_storage
from diffattn.experiments.study.workers import _wait, run_cells
from diffattn.system.io_errors import EX_IOERR, io_error_in
from diffattn.system.run_lock import LOCK_NAME, RunLock
from diffattn.train.runlog import read_metrics


@pytest.fixture(autouse=True)
def _deterministic(one_thread):
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def _train(tmp: Path, out: Path, *extra: str) -> int:
    cfg, corpus = tiny_run(tmp)
    return main(["train", "--config", str(cfg), "--data.path", str(corpus), "--out", str(out), "--no-progress",
                 *extra])


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------ storage failures


def test_a_read_only_disk_under_metrics_is_one_line_and_resume_is_exact(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(runlog, "tensorboard_writer", lambda *a, **k: None)
    assert _train(tmp_path, tmp_path / "ref") == 0
    with inject(monkeypatch, tmp_path) as counting:
        assert _train(tmp_path, tmp_path / "count") == 0
    appends = [i for i, (k, p) in enumerate(counting.ops, 1) if k == "open" and p.endswith("count/metrics.csv")]
    run = tmp_path / "run"
    capsys.readouterr()
    with inject(monkeypatch, tmp_path, fail_at=appends[-1], err=errno.EROFS):  # the last row, after step 2's save
        assert _train(tmp_path, run) == EX_IOERR
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert line.startswith(f"error: {run / 'metrics.csv'}: Read-only file system [EROFS]; kept: the checkpoint at "
                           f"step 2 ({run / 'ckpt'}); to continue: make the filesystem writable again (it is "
                           f"mounted read-only), then run: diffattn train --out {run} --resume"), line
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert _losses(run) == _losses(tmp_path / "ref")


def _losses(run: Path) -> list[tuple]:
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run / "metrics.csv")]


def test_tensorboard_failing_in_its_writer_thread_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    assert _train(tmp_path, tmp_path / "run", "--train.steps", "40") == EX_IOERR
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'run'}: No space left on device [ENOSPC]")


def test_a_safetensors_storage_error_names_the_file() -> None:
    from safetensors import SafetensorError

    err = io_error_in(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert err is not None and err.errno == errno.ENOSPC
    assert io_error_in(ValueError("no errno here")) is None
    assert io_error_in(BrokenPipeError()) is None  # `| head`: not a storage failure


# ------------------------------------------------------------------------------------------ the study's database


def _study(corpus: Path, out: Path) -> list[str]:
    return ["study", str(corpus), "--quick", "--out", str(out), "--seeds", "1", "--lrs", "0.01",
            "--lr-extensions", "0", "--steps", "2", "--d-model", "16", "--n-layers", "1", "--head-dim", "8",
            "--seq-len", "8", "--batch-size", "2", "--diag-early-steps", "0", "--probe-seconds", "0",
            "--progress-seconds", "3600", "--no-progress",
            "--grace-seconds", "1", "--poll-seconds", "0.05"]  # a trial a failure left RUNNING: taken over in 2 s


def _cells(out: Path) -> dict:
    return {f.parent.name: json.loads(f.read_text())["val_loss"] for f in (out / "cells").glob("*/result.json")}


def _database_full(real):
    """RDBStorage.set_trial_state_values failing once as SQLite does on a full disk (inside its transaction)."""
    import sqlite3

    import optuna
    import sqlalchemy

    calls = []

    def set_state(self, *a, **k):
        calls.append(a)
        if len(calls) == 1:  # the first cell's COMPLETE: its result.json is written, Optuna's record is not
            cause = sqlalchemy.exc.OperationalError("UPDATE trials", {}, sqlite3.OperationalError(
                "database or disk is full"))
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from cause
        return real(self, *a, **k)

    return set_state


def test_a_full_database_is_one_line_and_the_command_it_advises_finishes(tmp_path, monkeypatch, capsys) -> None:
    """The study's database is SQLite (or PostgreSQL): a write is a transaction, so a full disk leaves no torn
    record (as the journal file before it did); its failure is the storage-failure line, exit 74, and the command
    it advises finishes the study with the cells of an uninterrupted run (the cell whose trial the failure left
    RUNNING is done by its result.json, which the folder holds: reused)."""
    import optuna

    monkeypatch.setattr(runlog, "tensorboard_writer", lambda *a, **k: None)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS * 4)
    assert main(_study(corpus, tmp_path / "ref")) == 0
    out = tmp_path / "full"
    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values",
                        _database_full(optuna.storages.RDBStorage.set_trial_state_values))
    capsys.readouterr()
    assert main(_study(corpus, out)) == EX_IOERR
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].startswith(f"error: {out.resolve() / 'optuna.db'}: "
                                                                     "database or disk is full [ENOSPC]; kept: ")
    assert "free some space, then run: diffattn study" in err[-1]
    assert main(_study(corpus, out)) == 0
    assert _cells(out) == _cells(tmp_path / "ref") and (out / "report.md").is_file()


def test_a_damaged_database_is_refused_naming_the_file(tmp_path, capsys) -> None:
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "exp"
    assert main(_study(tmp_path / "corpus.txt", out)) == 0
    (out / "optuna.db").write_bytes(b"not a database" * 100)
    capsys.readouterr()
    assert main(_study(tmp_path / "corpus.txt", out)) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(f"error: {out.resolve() / 'optuna.db'}: ")
    assert "mv " in line and "finished cells are reused" in line


def test_a_worker_stops_at_the_first_storage_failure_and_never_loops(tmp_path) -> None:
    calls = []

    def cell():
        calls.append(1)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "cells")

    with pytest.raises(OSError):
        run_cells(dict.fromkeys("xyz", cell), lambda c: False, lambda: None, 0.01)
    assert len(calls) == 1  # the other cells would fail the same way: not tried

    # a failure in the study's own bookkeeping (its Optuna log, around each cell) fails each cell once: the worker
    # ends (re-run to retry them) rather than looping, and trains nothing it could not record
    record = CellRecord(open_storage(tmp_path, None), "t")
    record.study.optimize = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bookkeeping"))
    calls.clear()
    cells = {c: (lambda c=c: record.run(c, lambda: calls.append(c))) for c in "xy"}
    assert run_cells(cells, lambda c: False, lambda: None, 0.01) is False
    assert calls == []


def test_the_first_worker_with_a_storage_failure_stops_the_others() -> None:
    class Proc:
        def __init__(self, code_after: int, code: int):
            self.polls, self.code_after, self.code, self.returncode = 0, code_after, code, None

        def poll(self):
            self.polls += 1
            if self.polls >= self.code_after:
                self.returncode = self.code
            return self.returncode

    procs = [Proc(1, EX_IOERR), Proc(10**9, 143)]  # the second runs until it is told to stop
    told = []

    def tell(p, signum):
        told.append(p)
        p.code_after = 0

    assert _wait(procs, tell) == [EX_IOERR, 143]
    assert procs[1] in told


# ------------------------------------------------------------------------------------------ readers


def test_a_checkpoint_replaced_while_it_is_read_is_read_again(tmp_path, monkeypatch) -> None:
    model = torch.nn.Linear(2, 2)
    run_config = {"model": {"vocab_size": 8, "d_model": 8, "n_layers": 1, "n_heads": 1}}
    ckmod.save_checkpoint(tmp_path / "ckpt", model.state_dict(), run_config=run_config, train_state={"step": 1})
    real, swapped = ckmod.verify_checkpoint, []

    def verify(path):
        manifest = real(path)
        if not swapped:  # a training run saves its next checkpoint right now
            swapped.append(1)
            ckmod.save_checkpoint(tmp_path / "ckpt", model.state_dict(), run_config=run_config,
                                  train_state={"step": 2})
        return manifest

    monkeypatch.setattr(ckmod, "verify_checkpoint", verify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "corrupt" warning, no fallback
        ck = load_checkpoint(tmp_path / "ckpt")
    assert ck.train_state["step"] == 2 and swapped


def test_readers_fall_back_when_ckpt_is_deleted(tmp_path, capsys) -> None:
    import shutil

    run = tmp_path / "run"
    assert _train(tmp_path, run) == 0
    shutil.rmtree(run / "ckpt")
    for argv in (["info", str(run)], ["generate", str(run), "--prompt", "the", "--max-new-tokens", "3"],
                 ["eval", str(run), "--what", "ppl", "--batches", "1", "--batch-size", "2"]):
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # each command is its own process for a user: each says it
            assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert err.count("warning: ") == 1 and "falling back to the previous checkpoint" in err, (argv, err)
        assert f"{run / 'ckpt-step-2'}" in err and "Traceback" not in err


def test_eval_refuses_a_run_whose_data_changed(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert _train(tmp_path, run) == 0
    (tmp_path / "corpus.txt").write_text(CORPUS[: len(CORPUS) // 2])  # the text shrank under the run
    capsys.readouterr()
    assert main(["eval", str(run), "--what", "ppl", "--batches", "1", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "the data changed since the run trained on it" in err and "changed size" in err
    assert f"--data {tmp_path / 'corpus.txt'}" in err
    assert main(["eval", str(run), "--what", "ppl", "--batches", "1", "--batch-size", "2", "--data",
                 str(tmp_path / "corpus.txt")]) == 0


# ------------------------------------------------------------------------------------------ the lock


def test_a_second_command_on_a_run_folder_is_refused_naming_the_holder(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert _train(tmp_path, run) == 0
    before = (run / "metrics.csv").read_text()
    with RunLock(run, "diffattn train"):  # as another process holds it (a flock on another open file)
        capsys.readouterr()
        assert main(["train", "--out", str(run), "--resume", "--no-progress", "--train.steps", "6"]) == 2
        assert _train(tmp_path, run, "--overwrite") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and all(ln.startswith(f"error: {run} is in use by diffattn train (pid {os.getpid()} "
                                                   f"on {socket.gethostname()}, since ") for ln in err), err
        assert "kill " in err[0]
    assert (run / "metrics.csv").read_text() == before and not (run / LOCK_NAME).exists()
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--train.steps", "6"]) == 0


def test_a_second_study_on_the_same_folder_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "exp"
    out.mkdir()
    with RunLock(out, "diffattn study"):
        capsys.readouterr()
        assert main(_study(tmp_path / "corpus.txt", out)) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by diffattn study" in err and "study --worker --out" in err
        assert main(["compare", "--quick", "--out", str(out), "--no-progress"]) == 2
        assert f"{out} is in use" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_lock_file_left_by_a_killed_process_does_not_block(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(),
                                             "command": "diffattn train", "since": "earlier"}))
    assert _train(tmp_path, run) == 0  # the kernel released the dead holder's lock; its file is reused
    assert not (run / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------ kill -9 leftovers


def test_leftovers_of_a_killed_save_are_tidied(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert _train(tmp_path, run) == 0
    dead = _dead_pid()
    import shutil

    shutil.copytree(run / "ckpt", run / f".ckpt.tmp-{dead}-abcd1234")  # a save killed before its swap
    (run / f".metrics.csv.tmp-{dead}-abc123").write_text("step,")  # a metrics rewrite killed half-way
    (run / f".ckpt.tmp-{os.getppid()}-live1234").mkdir()  # a live process's: not touched
    notes = clean_leftovers(run)
    assert sorted(p for p in os.listdir(run) if p.startswith(".")) == [f".ckpt.tmp-{os.getppid()}-live1234"]
    assert len(notes) == 2
    (run / f".ckpt.tmp-{os.getppid()}-live1234").rmdir()
    # a save killed between its two renames: ckpt/ moved aside, the new one not yet in place
    os.replace(run / "ckpt", run / f".ckpt.old-{dead}")
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--train.steps", "6"]) == 0
    assert "put back as ckpt/, step 4" in capsys.readouterr().err
    assert verify_checkpoint(run / "ckpt") and leftovers(tmp_path) == []


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg, corpus = tiny_run(tmp_path)
    (run / "resolved.toml").write_text(cfg.read_text().replace('[data]\n', f'[data]\npath = "{corpus}"\n'))
    (run / "metrics.csv").write_text("step,train_loss\n1,3.3\n")  # killed at step 1, before any checkpoint
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    again = f"diffattn train --config {run / 'resolved.toml'} --out {run}"
    assert "holds no checkpoint (the run stopped before its first save)" in err and again in err
    assert main(again.split()[1:] + ["--no-progress"]) == 0  # the command it gives, as it is
    assert "held a run stopped before its first checkpoint" in capsys.readouterr().err
    assert verify_checkpoint(run / "ckpt")
