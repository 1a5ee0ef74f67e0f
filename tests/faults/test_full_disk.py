"""A full disk at every write: for each k, the k-th write operation of a command (``faultinject``: a file opened
for writing, a write, a safetensors save, a rename, a new folder, an fsync, a journal append) fails with ENOSPC.
After each failure the command must print one line (the path, the cause, what was kept, how to continue) and
exit 74, leave no partial output (no temp file, no half file, no lock), keep the previous checkpoint intact;
and the command it says to run, once the disk has room again, must finish with the uninterrupted run's results.

In the default run ``train`` is tried at every k but the middle of a run of writes into one file (a streamed
safetensors file writes once per tensor: its first, second and last write are tried), ``eval --out`` and
``python -m diffattn.data`` at every k, and
``study --quick`` (the smallest shapes) at a spread of k covering each kind of write and each phase;
``DIFFATTN_FAULTS=all`` tries every k of the study too (minutes: for a nightly job)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from faultinject import CORPUS, inject, leftovers, tiny_run

import diffattn.train.runlog as runlog
from diffattn.checkpoint.format import verify_checkpoint
from diffattn.cli.main import main
from diffattn.data.lm import main as data_main
from diffattn.system.io_errors import EX_IOERR
from diffattn.train.runlog import read_metrics

EXHAUSTIVE = os.environ.get("DIFFATTN_FAULTS") == "all"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch, one_thread):
    # TensorBoard writes from its own thread (its failure is tried in test_io_errors.py): off, so that the
    # sequence of writes is the same in every run. Deterministic kernels, restored afterwards.
    monkeypatch.setattr(runlog, "tensorboard_writer", lambda *a, **k: None)
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


def _setup(tmp: Path) -> tuple[Path, Path]:
    return tiny_run(tmp)


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "No space left on device [ENOSPC]" in lines[0], lines[0]
    return lines[0]


def _advised(line: str, argv: list[str]) -> list[str]:
    """The command the error line says to run, as arguments for ``main`` (or ``argv`` for "the same command")."""
    if "then run: diffattn " in line:
        return shlex.split(line.split("then run: diffattn ", 1)[1])
    assert "then run the same command again" in line, line
    return argv


def _losses(run: Path) -> list[tuple]:
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run / "metrics.csv")]


def _write_sites(ops: list[tuple[str, str]]) -> list[int]:
    """Every k, but of a run of writes into one file (a streamed safetensors file is a write per tensor) only its
    first, second and last: the writes between differ only in their offset. ``DIFFATTN_FAULTS=all``: every k."""
    if EXHAUSTIVE:
        return list(range(1, len(ops) + 1))

    def in_run(i: int) -> bool:  # 0-based; ops[i] is a write with a write into the same file before and after it
        return 1 < i < len(ops) - 1 and all(ops[j] == ("write", ops[i][1]) for j in (i - 2, i - 1, i, i + 1))

    return [i + 1 for i in range(len(ops)) if not in_run(i)]


def test_write_sites_keep_each_file_s_first_second_and_last_write() -> None:
    ops = [("open", "a"), *[("write", "a")] * 5, ("fsync", "a"), ("write", "b"), ("write", "a")]
    assert _write_sites(ops) == ([1, 2, 3, 6, 7, 8, 9] if not EXHAUSTIVE else list(range(1, 10)))


@pytest.mark.slow
def test_train_at_every_write(tmp_path: Path, monkeypatch, capsys) -> None:
    cfg, corpus = _setup(tmp_path)
    argv = ["train", "--config", str(cfg), "--data.path", str(corpus), "--no-progress"]
    with inject(monkeypatch, tmp_path) as counting:
        assert main([*argv, "--out", str(tmp_path / "ref")]) == 0
    reference = _losses(tmp_path / "ref")
    assert {k for k, _ in counting.ops} >= {"open", "write", "safetensors", "replace", "mkdir", "fsync"}
    for k in _write_sites(counting.ops):
        run = tmp_path / f"k{k}"
        args = [*argv, "--out", str(run)]
        capsys.readouterr()
        with inject(monkeypatch, tmp_path, fail_at=k) as inj:
            rc = main(args)
        err = capsys.readouterr().err
        assert inj.failed is not None and rc == EX_IOERR, (k, inj.failed, rc, err)
        line = _one_error_line(err)
        assert str(run) in line, line  # the path, as the user named it
        assert leftovers(tmp_path) == [], (k, inj.failed)
        if (run / "ckpt").exists():  # the checkpoint before the failure is whole
            verify_checkpoint(run / "ckpt")
            assert "kept: the checkpoint at step" in line
        else:
            assert not run.exists() or not any(run.iterdir()), (k, inj.failed, sorted(run.iterdir()))
        assert main(_advised(line, args)) == 0, (k, inj.failed, capsys.readouterr().err)
        assert _losses(run) == reference, (k, inj.failed)
        assert leftovers(tmp_path) == [], (k, inj.failed)


def test_interrupt_whose_save_hits_a_full_disk_exits_130_and_keeps_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                          capsys) -> None:
    """Ctrl-C, then the save it asks for fails: the signal's exit code (the user stopped it), one line saying the
    checkpoint could not be written and which one is kept; the resume is exact."""
    import signal

    from diffattn.train import loop

    cfg, corpus = _setup(tmp_path)
    argv = ["train", "--config", str(cfg), "--data.path", str(corpus), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "ref")]) == 0
    reference = _losses(tmp_path / "ref")
    run = tmp_path / "cut"
    real = loop.Training._step

    def step(self, step, stop):  # Ctrl-C during step 3, after the checkpoint of step 2
        if step == 2:
            stop.signum = signal.SIGINT
        return real(self, step, stop)

    monkeypatch.setattr(loop.Training, "_step", step)
    with inject(monkeypatch, tmp_path) as counting:
        assert main([*argv, "--out", str(tmp_path / "count")]) == 130
    saves = [i for i, (k, p) in enumerate(counting.ops, 1) if k == "safetensors" and "/count/" in p]
    capsys.readouterr()
    with inject(monkeypatch, tmp_path, fail_at=saves[-1]):  # the last save: the one the signal asked for
        rc = main([*argv, "--out", str(run)])
    err = capsys.readouterr().err
    assert rc == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1:]) == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (SIGINT) after step 3, but its checkpoint could not be saved: "), last
    assert "kept: the checkpoint at step 2" in last and f"then run: diffattn train --out {run} --resume" in last
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(loop.Training, "_step", real)
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert _losses(run) == reference


def test_eval_out_at_every_write(tmp_path: Path, monkeypatch, capsys) -> None:
    cfg, corpus = _setup(tmp_path)
    assert main(["train", "--config", str(cfg), "--data.path", str(corpus), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    argv = ["eval", str(tmp_path / "run"), "--what", "ppl", "--batches", "1", "--batch-size", "2"]
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    with inject(monkeypatch, tmp_path / "out") as counting:
        assert main([*argv, "--out", str(tmp_path / "out" / "ref.json")]) == 0
    reference = json.loads((tmp_path / "out" / "ref.json").read_text())
    assert len(counting.ops) >= 4  # open, write, fsync, rename
    for k in range(1, len(counting.ops) + 1):
        target = tmp_path / "out" / f"k{k}.json"
        args = [*argv, "--out", str(target)]
        capsys.readouterr()
        with inject(monkeypatch, tmp_path / "out", fail_at=k):
            assert main(args) == EX_IOERR
        line = _one_error_line(capsys.readouterr().err)
        assert str(target) in line and not target.exists()  # no 0-byte file to block the rerun
        assert leftovers(tmp_path) == []
        assert main(_advised(line, args)) == 0
        assert json.loads(target.read_text()) == reference


def test_token_file_at_every_write(tmp_path: Path, monkeypatch, capsys) -> None:
    """`python -m diffattn.data`: never a .bin without its .json (nor the reverse)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    out = tmp_path / "tok"
    out.mkdir()
    with inject(monkeypatch, out) as counting:
        assert data_main([str(corpus), str(out / "ref.bin")]) == 0
    ref = ((out / "ref.bin").read_bytes(), json.loads((out / "ref.json").read_text()))
    for k in range(1, len(counting.ops) + 1):
        args = [str(corpus), str(out / f"k{k}.bin")]
        capsys.readouterr()
        with inject(monkeypatch, out, fail_at=k):
            assert data_main(args) == EX_IOERR
        line = _one_error_line(capsys.readouterr().err)
        assert f"k{k}" in line
        assert not (out / f"k{k}.bin").exists() and not (out / f"k{k}.json").exists()
        assert leftovers(out) == []
        assert data_main(_advised(line, args)) == 0
        assert ((out / f"k{k}.bin").read_bytes(), json.loads((out / f"k{k}.json").read_text())) == ref


def _study_args(corpus: Path, out: Path) -> list[str]:
    return ["study", str(corpus), "--quick", "--out", str(out), "--seeds", "1", "--lrs", "0.01",
            "--lr-extensions", "0", "--steps", "2", "--d-model", "16", "--n-layers", "1",
            "--head-dim", "8", "--seq-len", "8", "--batch-size", "2", "--diag-early-steps", "0",
            "--probe-seconds", "0", "--progress-seconds", "3600", "--no-progress",
            "--grace-seconds", "1", "--poll-seconds", "0.05"]  # a trial a failure left RUNNING: taken over in 2 s


def _study_result(out: Path) -> dict:
    cells = {}
    for f in sorted((out / "cells").glob("*/result.json")):
        r = json.loads(f.read_text())
        cells[r["cell"]] = (r["val_loss"], r["history"])
    return cells


# The study's own files, each tried at its first write in the default run (a temp file counts as its file).
# (The study's database is SQLite's to write, in transactions: tests/faults/test_io_errors.py fails it.)
_STUDY_FILES = ("tokenizer.json", "study.json", "cell.json", "events.log", "result.json", "results.json",
                "lr_sweep.png", "report.md")


def _spread(ops: list[tuple[str, str]]) -> list[int]:
    """A spread of k for the default run: the first write operation on each of the study's own files, the
    folder's and a cell's creation, the first checkpoint save in a cell, and the last write.
    The other writes of a cell's training run are `train`'s, which test_train_at_every_write tries at every k."""
    first: dict[str, int] = {}
    for i, (kind, p) in enumerate(ops, 1):
        name = re.sub(r"\.tmp-\d+-\w+$", "", Path(p).name).lstrip(".")
        first.setdefault(name if name in _STUDY_FILES else kind if kind in ("mkdir", "safetensors") else "", i)
    first.pop("", None)
    mkdirs = [i for i, (k, _) in enumerate(ops, 1) if k == "mkdir"]
    writes = [i for i, (k, _) in enumerate(ops, 1) if k == "write"]
    return sorted({*first.values(), mkdirs[1], writes[-1]})


@pytest.mark.slow
def test_study_at_a_spread_of_writes(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    corpus = tmp_path / "corpus.txt"
    with inject(monkeypatch, tmp_path) as counting:
        assert main(_study_args(corpus, tmp_path / "ref")) == 0
    reference = _study_result(tmp_path / "ref")
    assert len(reference) == 2
    kinds = {k for k, p in counting.ops}
    assert kinds >= {"open", "write", "safetensors", "replace", "mkdir", "fsync", "link"}
    ks = range(1, len(counting.ops) + 1) if EXHAUSTIVE else _spread(counting.ops)
    for k in ks:
        out = tmp_path / f"k{k}"
        args = _study_args(corpus, out)
        capsys.readouterr()
        with inject(monkeypatch, tmp_path, fail_at=k) as inj:
            rc = main(args)
        err = capsys.readouterr().err
        assert rc == EX_IOERR, (k, inj.failed, rc, err)
        line = _one_error_line(err)
        assert "cell failed" not in err, err  # one failure stops the study, no retry loop
        assert leftovers(tmp_path) == [], (k, inj.failed)
        for ck in out.glob("cells/*/ckpt"):
            verify_checkpoint(ck)
        assert main(_advised(line, args)) == 0, (k, inj.failed, capsys.readouterr().err)
        assert _study_result(out) == reference, (k, inj.failed)
        assert (out / "report.md").is_file() and leftovers(tmp_path) == [], (k, inj.failed)
