"""Classification runs through the one training loop (diffattn.train.loop.train with a ClassifyTask), so it gets
what a language model gets: bf16 autocast, Ctrl-C safety with bit-exact resume, DDP/FSDP2 under torchrun, the
same non-finite error, metrics.csv and resolved.toml, and the same log lines with --no-progress and off a TTY."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clirun import Ran, interruptible, run_main

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli.train import main as train_main
from diffattn.configs.run_config import RunConfig
from diffattn.train.launch import RunRequest, launch
from diffattn.train.runlog import read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.max_seq_len", "32",
         "--model.attention", "standard"]


def _data(tmp: Path, n: int = 60) -> Path:
    path = tmp / "data.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        w.writerows((("near", f"ab {i}") if i % 2 else ("far", f"axxxb {i}")) for i in range(n))
    return path


def _popen(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(interruptible([sys.executable, "-m", "diffattn", "train", *args]), cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*args: str) -> Ran:
    return run_main("train", *args, cwd=REPO)


def _rows(path: Path) -> int:
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


@pytest.mark.slow
def test_sigint_mid_run_with_bf16_resumes_bit_exactly(tmp_path: Path, one_thread) -> None:
    steps = 150  # long enough that the run cannot finish between its third step and the signal
    args = ["--task", "classify", "--data.path", str(_data(tmp_path)), *MODEL, "--train.steps", str(steps),
            "--train.batch_size", "4", "--train.eval_every", "10", "--train.log_every", "1",
            "--train.warmup_steps", "2", "--train.dtype", "bfloat16", "--train.deterministic", "--no-progress"]
    full = _popen(*args, "--out", str(tmp_path / "full"))
    cut_dir = tmp_path / "cut"
    cut = _popen(*args, "--out", str(cut_dir))
    deadline = time.time() + 120
    while _rows(cut_dir / "metrics.csv") < 3:
        assert cut.poll() is None, cut.communicate()
        assert time.time() < deadline, "no steps logged within 120 s"
        time.sleep(0.005)
    cut.send_signal(signal.SIGINT)
    _, err = cut.communicate(timeout=120)
    assert cut.returncode == 130, err
    assert "attention backends (cpu, bfloat16)" in err  # autocast was on
    ck = load_checkpoint(cut_dir / "ckpt")
    step = ck.train_state["step"]
    assert 3 <= step < steps and ck.train_state["train_config"]["dtype"] == "bfloat16"
    assert f"saved checkpoint at step {step}; resume with: diffattn train --out {cut_dir} --resume" in err
    assert err.count(f"saved checkpoint at step {step}") == 1 and "Traceback" not in err
    _, err_full = full.communicate(timeout=300)
    assert full.returncode == 0, err_full
    res = _run("--out", str(cut_dir), "--resume", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert f"resuming from step {step} of {steps}" in res.stderr
    reference, resumed = read_metrics(tmp_path / "full" / "metrics.csv"), read_metrics(cut_dir / "metrics.csv")
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    keys = ("train_loss", "val_loss", "grad_norm", "lr", "val_accuracy", "val_macro_f1")
    for ra, rb in zip(reference, resumed):  # bit for bit
        assert [ra[k] for k in keys] == [rb[k] for k in keys], ra["step"]


def test_no_progress_lines_metrics_csv_and_resolved_toml(tmp_path: Path, one_thread) -> None:
    out = tmp_path / "cls"
    args = ["--task", "classify", "--data.path", str(_data(tmp_path)), *MODEL, "--train.batch_size", "4",
            "--train.eval_every", "5", "--out", str(out)]
    res = _run(*args, "--train.steps", "10", "--no-progress")
    assert res.returncode == 0, res.stderr
    err = res.stderr
    assert "training standard classifier: " in err and "2 classes, 10 steps, world size 1, 1 thread; out" in err
    for step in (5, 10):
        assert f"eval at step {step}: val loss " in err and f"saved checkpoint at step {step}" in err
    assert "val accuracy" in err.split("eval at step 5:")[1].splitlines()[0]
    assert "done: step 10, train loss " in err and f"; checkpoint {out / 'ckpt'}" in err
    assert "step 1/10 |" not in err  # --no-progress: no per-step lines
    assert "val accuracy" in res.stdout and f"checkpoint in {out / 'ckpt'}" in res.stdout
    # the LM's run folder: metrics.csv (with the classifier's columns) and resolved.toml, no metrics.jsonl
    assert not (out / "metrics.jsonl").exists()
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows if r["val_accuracy"] is not None] == [5, 10]
    assert 0.0 <= rows[-1]["val_macro_f1"] <= 1.0 and rows[-1]["val_loss"] > 0
    resolved = tomllib.loads((out / "resolved.toml").read_text())
    assert resolved["task"] == "classify" and resolved["classify"]["labels"] == ["far", "near"]
    assert resolved["train"]["steps"] == 10
    # resumed, with progress but not on a terminal: per-step lines with an ETA, and the resume line
    res = _run("--out", str(out), "--resume", "--train.steps", "12")
    assert res.returncode == 0, res.stderr
    assert "resuming from step 10 of 12" in res.stderr
    assert "step 12/12 | loss " in res.stderr and "ETA" in res.stderr  # every log_every steps and the last
    assert "eval at step 12: val loss" in res.stderr and "done: step 12" in res.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [5, 10, 12]


def test_non_finite_loss_is_the_lm_loops_error(tmp_path: Path, capsys) -> None:
    cfg = {"task": "classify",
           "model": {"d_model": 16, "n_layers": 1, "n_heads": 2, "attention": "standard", "max_seq_len": 16},
           "train": {"steps": 5, "batch_size": 4, "lr": 1e30, "warmup_steps": 0, "eval_every": 0, "grad_clip": 0.0},
           "data": {"path": str(_data(tmp_path, 40)), "tokenizer": "char"}, "classify": {}}
    assert launch(RunRequest(config=RunConfig.from_dict(cfg), out=tmp_path / "run", progress=False)) == 3
    assert "error: non-finite gradient norm (nan) at step 2: training stopped" in capsys.readouterr().err


WORKER = """
import sys
import torch.distributed as dist
from diffattn.cli.train import main
dist.init_process_group("gloo")
common = sys.argv[1:]
assert main([*common, "--out", "{tmp}/ddp", "--train.parallel", "ddp"]) == 0
assert main([*common, "--out", "{tmp}/fsdp", "--train.parallel", "fsdp"]) == 0
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_classification_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    """2 processes × batch 2 (DDP, then FSDP2) follow 1 process × batch 4: the same data, the same mean."""
    common = ["--task", "classify", "--data.path", str(_data(tmp_path)), *MODEL, "--train.steps", "6",
              "--train.eval_every", "3", "--train.log_every", "1", "--train.seed", "3", "--no-progress"]
    (tmp_path / "worker.py").write_text(WORKER.format(tmp=tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp_path / "worker.py"), *common, "--train.batch_size", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main([*common, "--train.batch_size", "4", "--out", str(tmp_path / "ref")]) == 0
    finally:
        torch.set_num_threads(n)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out\n{err[-3000:]}")
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    ref = read_metrics(tmp_path / "ref" / "metrics.csv")
    for mode in ("ddp", "fsdp"):
        rows = read_metrics(tmp_path / mode / "metrics.csv")
        assert [r["step"] for r in rows] == list(range(1, 7)), mode
        for ra, rb in zip(ref, rows):
            for k in ("train_loss", "grad_norm", "val_loss", "val_accuracy"):
                if ra[k] is None:
                    assert rb[k] is None, (mode, ra["step"], k)
                else:  # only the reduction order (and each rank's padding width) differs
                    assert rb[k] == pytest.approx(ra[k], rel=2e-4, abs=1e-5), (mode, ra["step"], k)
        ck = load_checkpoint(tmp_path / mode / "ckpt")
        assert ck.train_state["world_size"] == 2 and ck.run_config.task == "classify"
        assert ck.build_model().head.out_features == 2
