"""`diffattn study`: the grid on tiny models, pairing, reuse and resume, stale workers, two worker
processes, the budget planner, and the report against results.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState

from diffattn.cli import study
from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.findings import stats
from diffattn.experiments.study.budget import _val_batches, format_plan, make_plan, makespan, plan_steps
from diffattn.experiments.study.cell import load_data, run_cell
from diffattn.experiments.study.optuna_log import CellRecord, open_storage
from diffattn.experiments.study.spec import StudyError, StudySpec, default_lrs, default_sizes
from diffattn.experiments.study.workers import worker_main

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "You are all resolved rather to die than to famish? ") * 30
QUICK = ["--quick", "--steps", "4", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
         "--progress-seconds", "600", "--probe-seconds", "0", "--poll-seconds", "0.5"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("data") / "corpus.txt"
    f.write_text(TEXT)
    return f


def _starts(out: Path) -> list[tuple[str, str]]:
    """(cell, step) of every 'start' line in events.log."""
    lines = (out / "events.log").read_text().splitlines()
    return [(ln.split()[3], ln.split()[4]) for ln in lines if ln.split()[2] == "start"]


@pytest.fixture(scope="module")
def grid_run(corpus, tmp_path_factory):
    """2 arms × 2 LRs × 2 seeds, plus a ladder size, 4 steps each; then the same command again."""
    n = torch.get_num_threads()
    out = tmp_path_factory.mktemp("study") / "out"
    argv = [str(corpus), *QUICK, "--lrs", "1e-3,1e-2", "--seeds", "2", "--sizes", "8,16",
            "--lr-extensions", "0", "--out", str(out)]  # no LR extensions: the cell counts below are the grid's
    try:
        rc1 = study.run(_args(argv))
        starts1 = _starts(out)
        rc2 = study.run(_args(argv))
    finally:
        torch.set_num_threads(n)
    return out, rc1, rc2, starts1


def test_grid_runs_every_cell_once_and_rerun_reuses(grid_run):
    out, rc1, rc2, starts1 = grid_run
    assert rc1 == 0 and rc2 == 0
    grid = {cell_name(a, lr, s) for a in ("diff", "standard") for lr in (1e-3, 1e-2) for s in (0, 1)}
    ladder = {cell_name(a, lr, s, 8) for a in ("diff", "standard") for lr in (1e-3, 1e-2) for s in (0, 1)}
    cells = [c for c, _ in starts1]
    assert len(cells) == len(set(cells)) == 8 + 4  # every grid cell once, ladder: 2 arms × 2 seeds at best LR
    assert grid <= set(cells) and set(cells) - grid <= ladder
    assert _starts(out) == starts1  # the re-run trained nothing: every cell was reused
    for c in cells:
        folder = out / "cells" / c
        assert (folder / "cell.json").is_file() and (folder / "metrics.csv").is_file()
        assert (folder / "ckpt" / "config.json").is_file()
        assert json.loads((folder / "result.json").read_text())["step"] == 4


def test_results_json_schema_and_best_lr(grid_run):
    out = grid_run[0]
    res = json.loads((out / "results.json").read_text())
    assert [a["name"] for a in res["arms"]] == ["diff", "standard"]
    for a in res["arms"]:
        assert {"name", "attention", "params", "lr_sweep", "best_lr", "seeds", "val_loss_mean",
                "val_loss_ci95"} <= set(a)
        sweep = {p["lr"]: p for p in a["lr_sweep"]}
        assert set(sweep) == {1e-3, 1e-2}
        for p in a["lr_sweep"]:
            assert [s["seed"] for s in p["seeds"]] == [0, 1]
            assert p["val_loss"] == pytest.approx(sum(s["val_loss"] for s in p["seeds"]) / 2)
        assert a["best_lr"] == min(sweep, key=lambda lr: sweep[lr]["val_loss"])
        best = sweep[a["best_lr"]]["seeds"]
        assert [(s["seed"], s["val_loss"]) for s in a["seeds"]] == [(s["seed"], s["val_loss"]) for s in best]
        lo, hi = a["val_loss_ci95"]
        assert lo < a["val_loss_mean"] < hi
    v = res["verdict"]
    assert {"diff_minus_baseline", "ci95", "conclusion"} <= set(v)
    d, b = res["arms"]
    diffs = [x["val_loss"] - y["val_loss"] for x, y in zip(d["seeds"], b["seeds"])]
    assert v["diff_minus_baseline"] == pytest.approx(sum(diffs) / 2)
    assert v["conclusion"] in (stats.BETTER, stats.WORSE, stats.NO_DIFFERENCE)
    lad = res["ladder"]
    assert set(lad["arms"]) == {"diff", "standard"}
    assert all(len(x["points"]) == 2 and x["fit"] for x in lad["arms"].values())
    assert lad["matches"][0]["candidate"] == "diff"


def test_report_verdict_matches_results(grid_run):
    out = grid_run[0]
    res = json.loads((out / "results.json").read_text())
    md = (out / "report.md").read_text()
    v = res["verdict"]
    paragraphs = md.split("\n\n")
    assert paragraphs[1].startswith("**Smoke run (--quick)") and "not evidence" in paragraphs[1]
    first = paragraphs[2]  # the verdict paragraph comes right after the title and the smoke-run warning
    assert v["conclusion"] in first
    assert f"{v['diff_minus_baseline']:+.4f}" in first
    assert f"[{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]" in first
    assert "Best LR at the edge of the sweep" in md  # two LRs: the best is always at an edge
    load = md.split("load average at planning ")[1].split(")")[0]
    assert all(len(x.split(".")[1]) == 2 for x in load.split(", ")), load  # 2 decimals, not raw floats
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3  # LR sweep, curves, ladder: self-contained
    for png in ("lr_sweep.png", "loss_vs_tokens.png", "size_ladder.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_cell_checkpoint_is_an_ordinary_run(grid_run, tmp_path, capsys):
    """`diffattn eval` reads a cell like any run folder."""
    from diffattn.cli import eval as evaluate

    out = grid_run[0]
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    res_file = tmp_path / "eval.json"
    ck = out / "cells" / cell_name("diff", 1e-3, 0) / "ckpt"
    assert evaluate.run(p.parse_args([str(ck), "--what", "ppl", "--batches", "1", "--out", str(res_file)])) == 0
    assert json.loads(res_file.read_text())["ppl"]["ppl"] > 1
    capsys.readouterr()


class _Recording:
    """A batch source that records every training batch it hands out."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_batch(self, split, batch_size, generator):
        x, y = self.inner.get_batch(split, batch_size, generator)
        if split == "train":
            self.batches.append(x.clone())
        return x, y


def _spec(corpus: Path, **kw) -> StudySpec:
    base = dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3], seeds=[0, 1], seq_len=16,
                batch_size=2, steps=4)
    base.update(kw)
    return StudySpec.from_dict(base)


def test_same_seed_same_batches_across_arms(corpus, tmp_path, one_thread):
    spec = _spec(corpus)
    source, tok = load_data(tmp_path, spec)
    seen = {}
    for arm in spec.arms():
        for seed in (0, 1):
            rec = _Recording(source)
            run_cell(tmp_path, spec, arm, 1e-3, seed, rec, tok)
            seen[arm.name, seed] = torch.stack(rec.batches)
    assert torch.equal(seen["diff", 0], seen["standard", 0])
    assert torch.equal(seen["diff", 1], seen["standard", 1])
    assert not torch.equal(seen["diff", 0], seen["diff", 1])


class _Dies:
    def __init__(self, inner, after: int):
        self.inner, self.left = inner, after

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_batch(self, split, batch_size, generator):
        if split == "train":
            if self.left == 0:
                raise KeyboardInterrupt("killed")
            self.left -= 1
        return self.inner.get_batch(split, batch_size, generator)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the dead worker's trial is made by hand (ask)
def test_a_killed_workers_cell_is_taken_over_and_resumes_exactly(corpus, tmp_path, one_thread):
    """A worker killed mid-cell leaves a half-trained folder, whose lock the kernel let go, and a RUNNING trial in
    the study's Optuna log: the next worker claims the cell at once (no grace period to wait: the lock is the
    claim), the dead run's trial becomes FAIL (the lock proves its worker gone), and the cell resumes from its
    checkpoint, ending exactly where an uninterrupted run ends."""
    import optuna

    out = tmp_path / "out"
    spec = _spec(corpus, seeds=[0], steps=6)
    spec, plan = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1, command="test",
                           probe_s=0)
    source, tok = load_data(out, spec)
    names = [cell_name(a.name, 1e-3, 0) for a in spec.arms()]
    cell = names[-1]
    record = CellRecord(open_storage(out, None, grace_s=3600), plan["study_name"])  # Optuna's check: far off
    record.study.ask().set_user_attr("cell", cell)  # the killed worker's trial
    arm = next(a for a in spec.arms() if cell_name(a.name, 1e-3, 0) == cell)
    with pytest.raises(KeyboardInterrupt):  # the "killed" worker: 3 of 6 steps, checkpoint every step
        run_cell(out, spec, arm, 1e-3, 0, _Dies(source, 3), tok)
    assert worker_main(out, None, threads=1, poll_s=0.1, grace_s=3600)
    starts = _starts(out)
    assert [s for s in starts if s[0] == cell] == [(cell, "step=0"), (cell, "step=3")]  # resumed, not restarted
    trials = record.study.get_trials()
    assert [t.state for t in trials if t.user_attrs["cell"] == cell] == [optuna.trial.TrialState.FAIL,
                                                                          optuna.trial.TrialState.COMPLETE]
    assert sorted(t.user_attrs["cell"] for t in trials if t.state == optuna.trial.TrialState.COMPLETE) == sorted(names)
    # Resumed == uninterrupted.
    resumed = json.loads((out / "cells" / cell / "result.json").read_text())
    fresh = run_cell(tmp_path / "fresh", spec, arm, 1e-3, 0, source, tok)
    assert resumed["val_loss"] == fresh["val_loss"]
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in fresh["history"]]


def test_a_run_the_log_took_for_lost_keeps_its_result(tmp_path):
    """A live worker whose heartbeat came late finds its trial FAIL (Optuna's own check) when it closes it: Optuna
    refuses the value, and the cell's result, which its folder holds, stands."""
    record = CellRecord(open_storage(tmp_path, None), "s")

    def train() -> dict:
        t = record.study.get_trials(deepcopy=False)[-1]  # this run's trial, failed as Optuna's check fails it
        record.storage.set_trial_state_values(
            record.storage.get_trial_id_from_study_id_trial_number(record.study_id, t.number), TrialState.FAIL)
        return {"val_loss": 1.5}

    assert record.run("c", train) == {"val_loss": 1.5}
    assert [t.state for t in record.study.get_trials()] == [TrialState.FAIL]


@pytest.mark.slow
def test_two_worker_processes_run_each_cell_once(corpus, tmp_path):
    out = tmp_path / "out"
    spec = _spec(corpus, lrs=[1e-3, 3e-3])
    make_plan(out, spec, budget_minutes=None, jobs=2, threads=1, command="test", probe_s=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(stats.__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "diffattn", "study", "--worker", "--out", str(out), "--threads", "1",
           "--poll-seconds", "0.5"]
    procs = [subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:  # seconds normally; the generous timeout is for a starved CI machine
        errs = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    cells = [c for c, _ in _starts(out)]
    assert sorted(cells) == sorted({cell_name(a.name, lr, s) for a in spec.arms() for lr in spec.lrs
                                    for s in spec.seeds})  # 8 cells, each started exactly once
    done = [ln.split()[3] for ln in (out / "events.log").read_text().splitlines() if " done " in ln]
    assert sorted(done) == sorted(cells)


def test_plan_steps_fits_the_budget_on_fake_timing():
    rng = random.Random(0)
    for _ in range(20):
        cells = [(rng.uniform(0.05, 0.3), rng.uniform(1, 5)) for _ in range(rng.choice([6, 18, 30]))]
        budget, jobs = rng.uniform(300, 3000), rng.choice([1, 2, 3])
        steps = plan_steps(cells, budget, jobs)
        est = makespan([steps * s + f for s, f in cells], jobs)
        assert est <= budget  # the estimate fits
        assert makespan([(steps + 1) * s + f for s, f in cells], jobs) > budget  # and is the largest that does
        # The order cells really run in is random: list scheduling in any order stays within +25% here.
        for _ in range(5):
            loads = [0.0] * jobs
            for s, f in rng.sample(cells, len(cells)):
                loads[loads.index(min(loads))] += steps * s + f
            assert max(loads) <= 1.25 * budget


def test_the_plan_counts_every_evaluation_a_short_cell_runs(corpus, tmp_path, monkeypatch, one_thread):
    """A cell of fewer than 2·N_EVALS steps evaluates at every step; the plan counts those evaluations (it
    counted N_EVALS whatever the steps, and a short budgeted grid ran far past its budget)."""
    import csv

    from diffattn.train.loop import due

    spec = _spec(corpus, steps=18, eval_batches=2, diag_early_steps=18, seeds=[0])
    # every forward pass of an evaluation batch "takes" 1 s and nothing else any time: the estimate counts them
    monkeypatch.setattr("diffattn.experiments.study.budget.probe_timing",
                        lambda spec, source, threads, jobs=1, seconds=5.0, min_steps=3: {
        f"{a.name}@{spec.model.d_model}": {"step": 0.0, "fwd": 1.0, "start": 0.0, "jobs": jobs} for a in spec.arms()})
    out = tmp_path / "o"
    spec, plan = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1, command="x")
    source, tok = load_data(out, spec)
    arm = spec.arms()[0]
    run_cell(out, spec, arm, 1e-3, 0, source, tok)
    with open(out / "cells" / cell_name(arm.name, 1e-3, 0) / "metrics.csv") as f:
        evals = sum(1 for row in csv.DictReader(f) if row["val_loss"])
    assert evals == 18  # the real cell evaluated at every step
    final_pass = _val_batches(spec, source.split_size("val")) * 32 // spec.train.batch_size
    per_cell = plan["estimate_s"] / len(spec.arms())
    assert per_cell >= final_pass + evals * spec.train.eval_batches  # it counted 10 evaluations of 2 batches
    for steps in range(1, 300):  # the count is the loop's own cadence
        tcfg = spec.with_steps(steps, spec.train.warmup_steps).train_config(1e-3, 0)
        evals = sum(due(tcfg, d, True).evaluate for d in range(1, steps + 1))
        early = sum(d - 1 < tcfg.diag_early_steps and d % tcfg.log_every == 0 for d in range(1, steps + 1))
        assert spec.eval_passes(steps) == evals * (spec.train.eval_batches + 1) + early, steps


@pytest.mark.slow
def test_budget_plan_is_printed_and_recorded(corpus, tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    spec = _spec(corpus)
    # The budget pays for the probe and the report too: 5 min leaves this tiny grid enough for 10+ steps even on
    # a loaded machine (the probe measures this machine as it is now).
    spec2, plan = make_plan(out, spec, budget_minutes=5, jobs=2, threads=1, command="x", probe_s=0.2)
    assert plan["estimate_s"] + plan["overhead_s"] <= 300 and spec2.train.steps >= 10
    assert set(plan["timing_probe"]) == {"diff@16", "standard@16"}
    assert all(t["jobs"] == 2 and t["step"] > 0 for t in plan["timing_probe"].values())
    text = format_plan(spec2, plan)
    assert f"{spec2.train.steps} steps per cell" in text and "8 cells" not in text and "4 cells" in text
    # A re-run keeps the stored plan (no new probe), and another experiment in the same folder is refused.
    assert make_plan(out, spec, budget_minutes=5, jobs=1, threads=1, command="x")[0].train.steps == spec2.train.steps
    for other in (_spec(corpus, lrs=[5e-3]), _spec(corpus, steps=spec2.train.steps + 1)):
        with pytest.raises(StudyError, match="another experiment"):
            make_plan(out, other, budget_minutes=None, jobs=1, threads=1, command="x", probe_s=0)


def test_arms_heads_and_variants(corpus):
    s = _spec(corpus, heads=[2, 4], variants=["diff_v2"], d_model=32)
    assert [(a.name, a.attention, a.n_heads) for a in s.arms()] == [
        ("diff-h2", "diff", 2), ("standard-h2", "standard", 4), ("diff_v2-h2", "diff_v2", 4),
        ("diff-h4", "diff", 4), ("standard-h4", "standard", 8), ("diff_v2-h4", "diff_v2", 8)]
    from diffattn.experiments.study.collect import pairs

    assert [(c.name, b.name) for c, b in pairs(s)] == [
        ("diff-h2", "standard-h2"), ("diff_v2-h2", "standard-h2"), ("diff-h4", "standard-h4"),
        ("diff_v2-h4", "standard-h4")]
    assert default_lrs(128) == [1.5e-3, 3e-3, 6e-3]
    assert default_sizes(128, [4]) == [64, 128, 192]


@pytest.mark.parametrize("bad,msg", [
    (["--lrs", "1e-3,abc"], "--lrs"), (["--lrs", "-1"], "--lrs"), (["--variants", "nope"], "nope"),
    (["--jobs", "0"], "--jobs"), (["--budget-minutes", "0"], "--budget-minutes"), (["--heads", "3"], "d_model"),
    (["--budget-minutes", "1"], "probe"), (["--grace-seconds", "0"], "--grace-seconds"),
    (["--storage", "nosuchdb://x"], "cannot open the study's storage nosuchdb://x"),
    (["--storage", "mysql://u:secret@h/db"], "--storage mysql: its database driver is not installed"),
])
def test_bad_arguments_exit_2(corpus, tmp_path, capsys, bad, msg):
    quick = [a for a in QUICK if a != "--quick"] if msg == "probe" else QUICK  # --quick ignores a budget
    rc = study.run(_args([str(corpus), *quick, "--out", str(tmp_path / "o"), *bad]))
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0] and "secret" not in err[0]
    assert not (tmp_path / "o").exists()  # nothing written


def test_worker_without_a_plan_is_refused(tmp_path, capsys):
    assert study.run(_args(["x", "--worker", "--out", str(tmp_path)])) == 2
    assert "study.json" in capsys.readouterr().err


def test_quick_ignores_the_budget(tmp_path, capsys):
    """--quick is a smoke run even when a budget is given (README's commands are tested with --quick)."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 200)
    p = argparse.ArgumentParser()
    study.add_arguments(p)
    args = p.parse_args([str(text), "--quick", "--budget-minutes", "30", "--out", str(tmp_path / "o"),
                         "--seeds", "1", "--lrs", "0.003", "--no-progress", "--probe-seconds", "0"])
    assert study.run(args) == 0
    assert "--budget-minutes is ignored" in capsys.readouterr().err
    saved = json.loads((tmp_path / "o" / "study.json").read_text())
    assert saved["spec"]["steps"] == 8 and saved["plan"]["budget_minutes"] is None


def test_one_line_per_cell_unless_verbose(corpus, tmp_path, capsys):
    """`study --quick` printed 498 lines, ~470 of them the cells' `eval at step N`
    / `saved checkpoint` lines, burying the plan and the results (issue 25, item 6)."""
    from diffattn.cli import study

    def args(argv: list[str]) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        study.add_arguments(p)
        return p.parse_args(argv)

    argv = [str(corpus), *QUICK, "--lrs", "1e-3", "--seeds", "1", "--lr-extensions", "0"]
    n = torch.get_num_threads()
    try:
        assert study.run(args([*argv, "--out", str(tmp_path / "a")])) == 0
        err = capsys.readouterr().err.splitlines()
        assert study.run(args([*argv, "--verbose", "--out", str(tmp_path / "b")])) == 0
        verbose = capsys.readouterr().err.splitlines()
    finally:
        torch.set_num_threads(n)
    cells = [ln for ln in err if ln.endswith("nats/token") and ": val loss " in ln]
    assert len(cells) == 2, err
    assert not [ln for ln in err if "eval at step" in ln or "checkpoint" in ln or ln.startswith("attention backends")]
    # the plan (its first line and the indented ones, the folder line last), a line per cell, the report line
    assert [ln for ln in err if not ln.startswith(("plan: ", "      ", "report: "))] == cells, err
    assert sum("eval at step" in ln for ln in verbose) == 2 * 4 and sum("saved checkpoint" in ln for ln in verbose) == 8
