"""torchrun on CPU (gloo): 2 processes × batch b must follow the loss curve of 1 process × batch 2b,
with DDP and with FSDP2 (fully_shard), with activation checkpointing, across a resume at world size 2; a
checkpoint written at world size 2 resumes at world size 1 on the same curve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli.train import main as train_main
from diffattn.train.runlog import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
]

CONFIG = """
[model]
attention = "diff"
d_model = 32
n_layers = 2
n_heads = 2
[train]
batch_size = 4
seq_len = 16
lr = 3e-3
min_lr = 3e-3     # constant lr: extending a run with more steps does not change the schedule
warmup_steps = 0
eval_every = 3
eval_batches = 2
log_every = 1
seed = 5
[data]
tokenizer = "char"
"""


def _args(tmp: Path, out: str, *extra: str) -> list[str]:
    return ["--config", str(tmp / "run.toml"), "--out", str(tmp / out), "--no-progress",
            "--data.path", str(tmp / "corpus.txt"), *extra]


# One torchrun launch runs both the DDP and the FSDP2 training (start-up dominates on 2 cores): the worker
# initializes the process group once (re-initializing after a destroy hangs under torchrun's agent store) and
# calls the `diffattn train` entry point twice.
WORKER = """
import sys
import torch.distributed as dist
from diffattn.cli.train import main
dist.init_process_group("gloo")
common = sys.argv[1:]
# Each run stops after step 3 and resumes at world size 2 (the constant lr makes 3 + 3 steps the same as 6);
# DDP with selective and FSDP2 with full activation checkpointing: both must still follow the reference curve
# (one process, no checkpointing). The model is built on the meta device; FSDP2 shards it before it exists.
for mode, ac in (("ddp", "selective"), ("fsdp", "full")):
    run = [*common, "--out", "{tmp}/" + mode, "--train.parallel", mode, "--train.activation_checkpointing", ac]
    assert main([*run, "--train.steps", "3"]) == 0
    assert main([*run, "--resume"]) == 0
dist.barrier()  # no rank tears gloo down while another still talks to it (once seen: an abort at exit)
dist.destroy_process_group()
"""


def _torchrun(tmp: Path, *args: str) -> subprocess.Popen:
    (tmp / "worker.py").write_text(WORKER.format(tmp=tmp))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp / "worker.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> None:
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()  # torchrun's agent takes its workers down with it
        out, err = p.communicate()
        pytest.fail(f"torchrun timed out\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"


def _same_curve(a: list[dict], b: list[dict], steps: range) -> None:
    ra = {int(r["step"]): r for r in a}
    rb = {int(r["step"]): r for r in b}
    for s in steps:
        for k in ("train_loss", "val_loss", "grad_norm"):
            if ra[s][k] is None:
                assert rb[s][k] is None, (s, k)
            else:  # the same data and the same mean gradient; only the reduction order differs
                assert rb[s][k] == pytest.approx(ra[s][k], rel=2e-4, abs=1e-5), (s, k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dist")
    text = "".join(f"a {w} and {v}; " for w in ("cat", "dog", "owl") for v in ("red", "blue", "green")) * 60
    (tmp / "corpus.txt").write_text(text)
    (tmp / "run.toml").write_text(CONFIG)
    dist_runs = _torchrun(tmp, "--config", str(tmp / "run.toml"), "--no-progress", "--data.path",
                          str(tmp / "corpus.txt"), "--train.steps", "6", "--train.batch_size", "2")
    # the single-process reference runs in this process (1 thread: the 2 cores are busy) while the
    # 2-process runs work
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main(_args(tmp, "ref", "--train.steps", "9", "--train.batch_size", "4")) == 0
    finally:
        torch.set_num_threads(n)
    _finish(dist_runs)
    return tmp


def test_ddp_two_processes_match_one_process_double_batch(runs: Path) -> None:
    ref, ddp = read_metrics(runs / "ref" / "metrics.csv"), read_metrics(runs / "ddp" / "metrics.csv")
    assert [int(r["step"]) for r in ddp] == list(range(1, 7))
    _same_curve(ref, ddp, range(1, 7))


def test_fsdp2_two_processes_match_one_process_double_batch(runs: Path) -> None:
    ref, fsdp = read_metrics(runs / "ref" / "metrics.csv"), read_metrics(runs / "fsdp" / "metrics.csv")
    assert [int(r["step"]) for r in fsdp] == list(range(1, 7))
    _same_curve(ref, fsdp, range(1, 7))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_world_size_2_checkpoint_resumes_at_world_size_1(runs: Path, mode: str) -> None:
    ck = load_checkpoint(runs / mode / "ckpt")  # full (unsharded) state written by rank 0
    assert ck.train_state["world_size"] == 2 and ck.train_state["step"] == 6
    model = ck.build_model()  # loads strictly into a plain single-process model
    assert sum(p.numel() for p in model.parameters()) == model.num_params()
    # continue at world size 1 with the same global batch (1 × 4 rows): steps 7..9 follow the reference run
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_main(_args(runs, mode, "--resume", "--train.steps", "9", "--train.batch_size", "4")) == 0
    finally:
        torch.set_num_threads(n)
    resumed = read_metrics(runs / mode / "metrics.csv")
    assert [int(r["step"]) for r in resumed] == list(range(1, 10))
    _same_curve(read_metrics(runs / "ref" / "metrics.csv"), resumed, range(1, 10))
