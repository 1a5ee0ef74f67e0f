"""A user's work is never lost: no silent overwrite, Ctrl-C/SIGTERM save a checkpoint and resume exactly,
resume works from any folder and notices changed data, the previous checkpoint is a fallback, and the logs say
what happened when output is not a terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import interruptible

from diffattn.checkpoint.format import load_checkpoint, save_checkpoint
from diffattn.cli.train import main as train_main
from diffattn.train.runlog import eta_seconds, read_metrics

REPO = Path(__file__).resolve().parents[2]
CORPUS = "the quick brown fox jumps over the lazy dog. " * 40


def _config(tmp: Path, steps: int = 30, **train) -> Path:
    cfg = tmp / "run.toml"
    train = {"steps": steps, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2, "eval_every": 10,
             "eval_batches": 1, "log_every": 1, "deterministic": "true", "seed": 5, **train}
    lines = "".join(f"{k} = {v}\n" for k, v in train.items())
    cfg.write_text(f"""
[model]
attention = "diff"
d_model = 32
n_layers = 1
n_heads = 2
[train]
{lines}[data]
tokenizer = "char"
""")
    (tmp / "corpus.txt").write_text(CORPUS)
    return cfg


def _train(*args: str) -> int:
    was = torch.are_deterministic_algorithms_enabled()
    try:
        return train_main(list(args))
    finally:
        torch.use_deterministic_algorithms(was)


def _popen(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", "train", *args]), cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def test_refuses_to_overwrite_a_run_and_overwrite_replaces_it(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, steps=4)
    data = ["--data.path", str(tmp_path / "corpus.txt"), "--no-progress"]
    out = tmp_path / "run"
    assert _train("--config", str(cfg), "--out", str(out), *data) == 0
    before = (out / "ckpt" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert _train("--config", str(cfg), "--out", str(out), "--train.steps", "2", *data) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "ckpt" / "model.safetensors").read_bytes() == before  # nothing was touched
    assert load_checkpoint(out / "ckpt").train_state["step"] == 4
    (out / "notes.txt").write_text("mine")
    assert _train("--config", str(cfg), "--out", str(out), "--train.steps", "2", "--overwrite", *data) == 0
    assert "removed the previous run" in capsys.readouterr().err
    assert load_checkpoint(out / "ckpt").train_state["step"] == 2
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files are replaced


@pytest.mark.slow
def test_sigint_and_sigterm_save_a_checkpoint_and_resume_is_exact(tmp_path: Path) -> None:
    steps = 150  # long enough that neither run can finish between its third step and its signal
    cfg = _config(tmp_path, steps=steps, eval_every=50)
    data = ["--data.path", str(tmp_path / "corpus.txt"), "--no-progress"]
    full = _popen("--config", str(cfg), "--out", str(tmp_path / "full"), *data)
    cut = {sig: _popen("--config", str(cfg), "--out", str(tmp_path / sig.name), *data)
           for sig in (signal.SIGINT, signal.SIGTERM)}
    deadline, waiting = time.time() + 120, dict(cut)
    while waiting:  # signal each run as soon as it has logged 3 steps
        for sig, proc in list(waiting.items()):
            assert proc.poll() is None, proc.communicate()
            if _rows(tmp_path / sig.name / "metrics.csv") >= 3:
                proc.send_signal(sig)
                del waiting[sig]
        assert time.time() < deadline, "the runs logged no steps within 120 s"
        time.sleep(0.005)
    _, err_full = full.communicate(timeout=180)
    assert full.returncode == 0, err_full
    reference = read_metrics(tmp_path / "full" / "metrics.csv")
    for sig, proc in cut.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, err
        run = tmp_path / sig.name
        step = load_checkpoint(run / "ckpt").train_state["step"]
        assert 3 <= step < steps, "the signal should arrive mid-run"
        assert f"saved checkpoint at step {step}; resume with: diffattn train --out {run} --resume" in err
        assert err.count(f"saved checkpoint at step {step}") == 1, err  # one line, not the loop's and the CLI's
        assert "Traceback" not in err
        assert _train("--out", str(run), "--resume", *data) == 0
        resumed = read_metrics(run / "metrics.csv")
        assert [r["step"] for r in resumed] == list(range(1, steps + 1))
        for ra, rb in zip(reference, resumed):  # bit-for-bit
            assert (ra["train_loss"], ra["val_loss"], ra["grad_norm"]) == \
                (rb["train_loss"], rb["val_loss"], rb["grad_norm"]), (sig.name, ra["step"])


def test_resume_from_another_folder_and_changed_data(tmp_path: Path, monkeypatch, capsys) -> None:
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir()
    elsewhere.mkdir()
    cfg = _config(first, steps=4)
    monkeypatch.chdir(first)
    assert _train("--config", str(cfg), "--out", "run", "--data.path", "corpus.txt", "--no-progress") == 0
    run = first / "run"
    monkeypatch.chdir(elsewhere)  # the data path was relative to `first`
    capsys.readouterr()
    assert _train("--out", str(run), "--resume", "--train.steps", "6", "--no-progress") == 0
    assert "resuming from step 4 of 6" in capsys.readouterr().err
    assert load_checkpoint(run / "ckpt").train_state["step"] == 6

    (first / "corpus.txt").write_text(CORPUS + "something new. ")
    assert _train("--out", str(run), "--resume", "--train.steps", "8", "--no-progress") == 2
    err = capsys.readouterr().err
    assert "data changed since the run started" in err and str(first / "corpus.txt") in err
    assert "--data.path" in err
    assert load_checkpoint(run / "ckpt").train_state["step"] == 6  # nothing was touched
    assert _train("--out", str(run), "--resume", "--train.steps", "8", "--no-progress",
                  "--data.path", str(first / "corpus.txt")) == 0
    assert "--data.path given" in capsys.readouterr().err
    assert load_checkpoint(run / "ckpt").train_state["step"] == 8
    # the new data is now the recorded one: a plain resume accepts it
    assert _train("--out", str(run / "ckpt"), "--resume", "--train.steps", "9", "--no-progress") == 0

    # moved: the message names the new location to pass, not the old path (issue 25, item 8)
    moved = elsewhere / "moved.txt"
    os.replace(first / "corpus.txt", moved)
    capsys.readouterr()
    assert _train("--out", str(run), "--resume", "--train.steps", "10", "--no-progress") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot resume: the run's data {first / 'corpus.txt'} no longer exists. If it has moved, "
                   "pass its new location: --data.path NEW_PATH (the data found there is recorded in the run)."]
    assert _train("--out", str(run), "--resume", "--train.steps", "10", "--no-progress",
                  "--data.path", str(moved)) == 0
    assert load_checkpoint(run / "ckpt").train_state["step"] == 10


def test_log_lines_when_not_a_terminal(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, steps=4, eval_every=2, log_every=2)
    data = ["--data.path", str(tmp_path / "corpus.txt")]
    assert _train("--config", str(cfg), "--out", str(tmp_path / "a"), *data) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/4", "step 4/4"]
    for field in ("loss ", "lr ", "tok/s", "elapsed ", "ETA "):
        assert field in lines[0]
    assert "eval at step 2: val loss" in err and "saved checkpoint at step 4" in err
    assert _train("--config", str(cfg), "--out", str(tmp_path / "b"), *data, "--no-progress") == 0
    err = capsys.readouterr().err
    assert not any(ln.startswith("step ") for ln in err.splitlines())
    for line in ("training diff LM", "eval at step 4", "saved checkpoint at step 4", "done: step 4"):
        assert line in err
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.csv")] == [2, 4]


def test_keeps_previous_checkpoints_and_falls_back_when_the_newest_is_corrupt(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, steps=10, ckpt_every=2, eval_every=0)
    data = ["--data.path", str(tmp_path / "corpus.txt"), "--no-progress"]
    out = tmp_path / "run"
    assert _train("--config", str(cfg), "--out", str(out), "--train.keep_checkpoints", "3", *data) == 0
    assert sorted(p.name for p in out.glob("ckpt*")) == ["ckpt", "ckpt-step-6", "ckpt-step-8"]
    assert load_checkpoint(out / "ckpt-step-8").train_state["step"] == 8
    weights = out / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    capsys.readouterr()
    assert _train("--out", str(out), "--resume", "--train.steps", "12", *data) == 0
    err = capsys.readouterr().err
    assert "truncated" in err and str(out / "ckpt") in err and str(out / "ckpt-step-8") in err
    assert "resuming from step 8 of 12" in err
    assert load_checkpoint(out / "ckpt").train_state["step"] == 12
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == list(range(1, 13))


@pytest.mark.slow
def test_ctrl_c_saves_a_classification_run(tmp_path: Path) -> None:
    rows = ["label,text"] + [f"{'near' if i % 2 else 'far'},{'ab' if i % 2 else 'axxxb'} {i}" for i in range(60)]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "cls"
    proc = _popen("--task", "classify", "--data.path", str(tmp_path / "data.csv"), "--out", str(run),
                  "--model.d_model", "32", "--model.n_layers", "1", "--model.max_seq_len", "32",
                  "--train.steps", "400", "--train.eval_every", "1", "--train.batch_size", "4", "--no-progress")
    deadline = time.time() + 120
    while _rows(run / "metrics.csv") < 4:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no evaluation within 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    step = load_checkpoint(run / "ckpt").train_state["step"]
    assert 3 <= step < 400
    assert f"saved checkpoint at step {step}; resume with: diffattn train --out {run} --resume" in err
    assert _train("--out", str(run), "--resume", "--train.steps", str(step + 2), "--no-progress") == 0
    assert load_checkpoint(run / "ckpt").train_state["step"] == step + 2


def test_eta_after_a_resume_uses_this_process_steps_only() -> None:
    # resumed at step 990 of 1000 after 27 min; this process ran 2 steps in 1 s: 8 steps left take ~4 s, not the
    # 27 min / 2 steps * 8 the cumulative clock gave
    assert eta_seconds(elapsed_here_s=1.0, steps_here=2, steps_left=8) == 4.0
    assert eta_seconds(0.0, 0, 5) == 0.0 and eta_seconds(3.0, 3, 0) == 0.0


def test_eta_line_after_a_resume(tmp_path: Path, capsys) -> None:
    """A resumed run's log lines carry an ETA at this process's pace, however long the first part took."""
    cfg = _config(tmp_path, steps=4, eval_every=0, log_every=1)
    data = ["--data.path", str(tmp_path / "corpus.txt")]
    out = tmp_path / "run"
    assert _train("--config", str(cfg), "--out", str(out), *data) == 0
    # the first 4 steps "took" 10 hours: the old ETA (that time / this process's 1 step × 4 left) read 40 hours
    ck = load_checkpoint(out / "ckpt")
    save_checkpoint(out / "ckpt", ck.state_dict, run_config=ck.run_config, tokenizer=ck.tokenizer,
                    optimizer=ck.optimizer_state, train_state={**ck.train_state, "elapsed_s": 36000.0}, rng=ck.rng)
    capsys.readouterr()
    assert _train("--out", str(out), "--resume", "--train.steps", "9", *data) == 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("step 5/9"))
    assert "elapsed 10h00m" in line  # the run's total training time is still reported
    assert line.rsplit("| ", 1)[1].startswith("ETA 0m"), line  # under a minute for 4 tiny steps, not 40 h
