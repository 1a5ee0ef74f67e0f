"""`diffattn study` with issue 16 wired in: per-arm LR bracketing through the worker (fake cells: an
edge best runs an extension cell, an interior best stops, K caps it, a rerun reuses every cell), the planner
counting extensions, --head-dim parameter counts per arm, TYPE+option variants, the early diagnostics, and one
end-to-end CLI run on tiny settings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from diffattn.cli import study
from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.study.budget import (
    cell_costs,
    estimate_s,
    extension_costs,
    format_plan,
    make_plan,
    plan_steps,
)
from diffattn.experiments.study.collect import collect_cells, lr_brackets, study_progress
from diffattn.experiments.study.spec import StudySpec, write_spec
from diffattn.experiments.study.workers import worker_main
from diffattn.model.transformer import TransformerLM

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "You are all resolved rather to die than to famish? ") * 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("data") / "corpus.txt"
    f.write_text(TEXT)
    return f


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.add_arguments(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------ bracketing through the worker
OPTIMUM = {"diff": 2.5e-4, "standard": 2e-3}  # diff's best is below the base list, standard's inside it


def _fake_run_cell(calls: list[str]):
    """A run_cell that trains nothing: loss is a bowl in log LR around the arm's optimum, plus a seed offset;
    like the real one it reuses a finished cell's result.json."""

    def run_cell(out, spec, arm, lr, seed, source, tokenizer, d_model=None, **show):
        name = cell_name(arm.name, lr, seed)
        f = out / "cells" / name / "result.json"
        if f.exists():
            return json.loads(f.read_text())
        calls.append(name)
        loss = 2.0 + 0.1 * math.log(lr / OPTIMUM[arm.name]) ** 2 + 0.01 * seed
        hist = [{"step": s, "tokens_seen": s * 32, "train_loss": loss + 1 / s, "val_loss": loss + 1 / s}
                for s in range(1, spec.train.steps + 1)]
        r = {"cell": name, "arm": arm.name, "attention": arm.attention, "n_heads": arm.n_heads,
             "d_model": spec.model.d_model, "lr": lr, "seed": seed, "steps": spec.train.steps, "step": spec.train.steps,
             "params": 100, "non_embedding_params": 80, "val_loss": loss, "diverged": None, "history": hist}
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(r))
        return r

    return run_cell


def _fake_study(corpus: Path, out: Path, k: int, monkeypatch) -> tuple[StudySpec, list[str]]:
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3, 2e-3, 4e-3],
                               seeds=[0, 1],
                     seq_len=16, batch_size=2, steps=4, lr_extensions=k))
    spec, _ = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1, command="test", probe_s=0)
    calls: list[str] = []
    monkeypatch.setattr("diffattn.experiments.study.workers.run_cell", _fake_run_cell(calls))
    return spec, calls


def test_edge_best_runs_extension_cells_until_bracketed_and_rerun_reuses(corpus, tmp_path, monkeypatch):
    out = tmp_path / "o"
    spec, calls = _fake_study(corpus, out, 3, monkeypatch)
    assert worker_main(out, None, 1, poll_s=0.1)
    base = {cell_name(a, lr, s) for a in ("diff", "standard") for lr in spec.lrs for s in (0, 1)}
    ext = {cell_name("diff", lr, s) for lr in (5e-4, 2.5e-4, 1.25e-4) for s in (0, 1)}
    assert set(calls) == base | ext and len(calls) == len(set(calls))  # standard (interior best) never extends
    br = lr_brackets(spec, collect_cells(out, spec))
    assert br["diff"].bracketed and br["diff"].best_lr == 2.5e-4 and br["diff"].lr_extensions == 3
    assert br["standard"].bracketed and br["standard"].lr_extensions == 0
    prog = study_progress(out, spec)
    assert prog["done"] == prog["total"] == len(base | ext)
    calls.clear()
    assert worker_main(out, None, 1, poll_s=0.1) and calls == []  # a rerun reuses every cell


def test_k_caps_the_extensions_and_the_verdict_says_unbracketed(corpus, tmp_path, monkeypatch):
    out = tmp_path / "o"
    spec, calls = _fake_study(corpus, out, 1, monkeypatch)
    assert worker_main(out, None, 1, poll_s=0.1)
    assert sorted(c for c in calls if "lr0.0005" in c) == [cell_name("diff", 5e-4, s) for s in (0, 1)]
    assert not any("lr0.00025" in c for c in calls)  # K = 1: one round only
    from diffattn.experiments.study.collect import collect

    res = collect(out, spec, {})
    arms = {a["name"]: a for a in res["arms"]}
    d = arms["diff"]
    assert (d["lrs"], d["best_lr"], d["bracketed"], d["lr_extensions"]) == ([5e-4, 1e-3, 2e-3, 4e-3], 5e-4, False, 1)
    assert arms["standard"]["bracketed"] and arms["standard"]["lr_extensions"] == 0
    v = res["verdict"]
    assert len(v["unbracketed"]) == 1 and "still the lowest learning rate tried" in v["unbracketed"][0]
    assert res["incomplete"] is None
    # raising K on a rerun keeps every cell and runs the next round only
    calls.clear()
    write_spec(out, dataclasses.replace(spec, lr_extensions=2), {}, k_given=True)
    assert worker_main(out, None, 1, poll_s=0.1)
    assert sorted(calls) == [cell_name("diff", 2.5e-4, s) for s in (0, 1)]


def test_plan_counts_the_extensions(corpus):
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3, 2e-3], seeds=[0, 1],
                     steps=100, lr_extensions=2))
    timing = {f"{a.name}@16": {"step": 0.01, "fwd": 0.001} for a in spec.arms()}
    rounds = extension_costs(spec, timing, 1000)
    assert [len(r) for r in rounds] == [4, 4]  # 2 arms × 2 seeds per round, 2 rounds
    costs = [(s, f, fwd) for s, f, fwd, _ in cell_costs(spec, timing, 1000)]
    assert estimate_s(costs, rounds, 100, 1) > estimate_s(costs, [], 100, 1)
    assert plan_steps(costs, 60, 1, rounds=rounds) < plan_steps(costs, 60, 1)
    text = format_plan(spec, {"estimate_s": 10.0, "estimate_without_lr_extensions_s": 5.0, "jobs": 1})
    assert "up to 8 LR-extension cells" in text and "if no LR extension is needed" in text


# ----------------------------------------------------------------------------- head width and variants
def _n(spec: StudySpec, name: str) -> tuple[int, object]:
    cfg = spec.arm_config(spec.arm(name), 64)
    return TransformerLM(cfg).num_params(), cfg


@pytest.mark.parametrize("d_model,head_dim", [(128, 32), (128, 64), (64, 16)])
def test_head_dim_sets_every_arms_heads_and_parameter_counts(corpus, d_model, head_dim):
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=d_model, n_layers=2, head_dims=[head_dim], lrs=[1e-3],
                     variants=["diff_v2", "diff+nosubln", "diff_v2+matched"]))
    assert spec.head_dim == spec.to_dict()["head_dim"] == head_dim
    heads = {a.name: a.n_heads for a in spec.arms()}
    assert heads == {"diff": d_model // (2 * head_dim), "standard": d_model // head_dim,
                     "diff_v2": d_model // head_dim, "diff+nosubln": d_model // (2 * head_dim),
                     "diff_v2+matched": d_model // head_dim}
    n = {a: _n(spec, a)[0] for a in heads}
    cfg_diff = _n(spec, "diff")[1]
    assert cfg_diff.d_model // (2 * cfg_diff.n_heads) == head_dim  # Q/K sub-head width D, V 2D
    # DIFF matches its baseline up to λ vectors and the sub-layer norm gains (per layer: 4·D + 2·D)
    assert n["diff"] - n["standard"] == 2 * 6 * head_dim
    assert n["diff"] - n["diff+nosubln"] == 2 * 2 * head_dim  # only the norm's gains go
    assert not _n(spec, "diff+nosubln")[1].options.subln
    assert n["diff_v2"] > n["standard"] * 1.01  # V2 is not parameter-matched ...
    assert abs(n["diff_v2+matched"] / n["standard"] - 1) < 0.01  # ... its +matched arm is, within 1%
    assert _n(spec, "diff_v2+matched")[1].ffn_hidden < _n(spec, "diff_v2")[1].ffn_dim


def test_head_dims_ladder_groups_arms_and_pairs_within_groups(corpus):
    from diffattn.experiments.study.collect import pairs

    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=128, n_layers=1, head_dims=[16, 32, 64], lrs=[1e-3]))
    assert [(a.name, a.n_heads) for a in spec.arms()] == [
        ("diff-hd16", 4), ("standard-hd16", 8), ("diff-hd32", 2), ("standard-hd32", 4), ("diff-hd64", 1),
        ("standard-hd64", 2)]
    assert [(c.name, b.name) for c, b in pairs(spec)] == [
        ("diff-hd16", "standard-hd16"), ("diff-hd32", "standard-hd32"), ("diff-hd64", "standard-hd64")]
    assert spec.head_dim is None and spec.to_dict()["head_dims"] == [16, 32, 64]


def test_default_shape_follows_the_advice_and_bad_widths_are_refused(corpus, tmp_path, capsys):
    spec = compare_spec(corpus, [])
    assert spec.head_dims == [32] and [(a.name, a.n_heads) for a in spec.arms()] == [("diff", 2), ("standard", 4)]
    assert compare_spec(corpus, ["--heads", "4"]).head_dims == []  # the old way still works
    assert compare_spec(corpus, ["--head-dims", "16,64"]).head_dims == [16, 64]
    for bad, msg in ((["--head-dim", "48"], "does not fit"), (["--head-dim", "32", "--heads", "2"], "not both"),
                     (["--variants", "diff+bogus"], "bogus"), (["--variants", "standard+nosubln"], "nosubln")):
        rc = study.run(_args([str(corpus), "--out", str(tmp_path / "o"), *bad]))
        assert rc == 2 and msg in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def compare_spec(corpus: Path, extra: list[str]) -> StudySpec:
    from diffattn.experiments.study.request import spec_from_options

    return spec_from_options(vars(_args([str(corpus), *extra])))


# --------------------------------------------------------------------------------- early diagnostics
def test_early_diagnostics_columns_are_finite_and_training_is_unchanged(corpus, tmp_path):
    from diffattn.configs.run_config import TrainConfig
    from diffattn.data.lm import make_source
    from diffattn.model.transformer import ModelConfig
    from diffattn.train.diagnostics import read_diagnostics
    from diffattn.train.loop import train

    source, _ = make_source({"path": str(corpus), "tokenizer": "char"}, 16)
    losses = {}
    for early in (0, 6):
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(vocab_size=source.vocab_size, d_model=16, n_layers=2, n_heads=2,
                                          max_seq_len=16, attention="diff"))
        tcfg = TrainConfig(steps=8, batch_size=2, seq_len=16, eval_every=4, eval_batches=1, log_every=2,
                           diag_early_steps=early, seed=3)
        r = train(model, source, tcfg, out_dir=tmp_path / f"e{early}", progress=False)
        losses[early] = [h["train_loss"] for h in r.history]
    assert losses[0] == losses[6]  # read-only: the same numbers with and without
    rows = read_diagnostics(tmp_path / "e6" / "diagnostics.csv")
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]  # every log step up to 6, then evaluations
    for i in (0, 1):
        cols = [f"layer{i}.{c}" for c in ("attn_rms", "resid_rms", "attn_to_resid", "lambda", "grad.q", "grad.k",
                                          "grad.v", "grad.out", "grad.lambda", "grad.norm", "grad.mlp")]
        for row in rows[:3]:
            assert all(math.isfinite(row[c]) for c in cols), row
        assert math.isnan(rows[3][f"layer{i}.attn_rms"]) and math.isfinite(rows[3][f"layer{i}.lambda"])
    assert all(math.isfinite(r["grad.emb"]) for r in rows[:3])


# ------------------------------------------------------------------------------------- end to end
def test_cli_end_to_end_tiny(corpus, tmp_path):
    out = tmp_path / "o"
    n = torch.get_num_threads()
    try:
        rc = study.run(_args([str(corpus), "--quick", "--steps", "5", "--seq-len", "16", "--d-model",
                                "16", "--batch-size", "2", "--threads", "1", "--progress-seconds", "600",
                                "--probe-seconds", "0", "--poll-seconds", "0.2", "--lrs", "1e-3,2e-3",
                                "--seeds", "2", "--lr-extensions", "1", "--head-dim", "4", "--out", str(out)]))
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["spec"]["head_dim"] == 4 and res["spec"]["lr_extensions"] == 1
    for a in res["arms"]:
        assert {"lrs", "best_lr", "bracketed", "lr_extensions"} <= set(a)
        assert a["lr_extensions"] <= 1 and len(a["lrs"]) == 2 + a["lr_extensions"] and a["best_lr"] in a["lrs"]
    v = res["verdict"]
    assert [p["step"] for p in v["trajectory"]] == [1, 2, 3, 4, 5]
    assert all({"step", "tokens", "diff_minus_baseline", "ci95"} <= set(p) for p in v["trajectory"])
    assert ("mean" in v["token_ratio"] and "target_loss" in v["token_ratio"]) or "reason" in v["token_ratio"]
    assert v["trend"]["trend"] in ("narrowing", "widening", "no detectable trend", "undetermined")
    report = (out / "report.md").read_text()
    assert "Token efficiency" in report and "the paper reports ~64%" in report
    assert "The gap with its 95% band is plotted under the loss curves (loss_vs_tokens.png)" in report
    assert "over the last third" in report
    diag = out / "cells" / cell_name("diff", 1e-3, 0) / "diagnostics.csv"
    assert "layer0.attn_to_resid" in diag.read_text().splitlines()[0]


def _cell(arm: str, lr: float, loss: float) -> dict:
    return {"cell": cell_name(arm, lr, 0), "arm": arm, "lr": lr, "seed": 0, "d_model": 16, "steps": 4,
            "val_loss": loss}


def test_a_round_counts_only_when_every_arm_has_finished_it(corpus):
    """A worker that reaches the LR-extension round late, when one arm's cells of it are finished and the other's
    still train, derives the same round (both arms), not a later one for the first arm alone: that named a different
    Optuna study, whose cells the first worker held, and the late worker waited on them for ever (CI, 2026-11)."""
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3], seeds=[0],
                                    seq_len=16, batch_size=2, steps=4, lr_extensions=1))
    base = [_cell("diff", 1e-3, 3.0), _cell("standard", 1e-3, 3.0)]
    first = lr_brackets(spec, base)
    assert {a: (b.status, b.next_lrs) for a, b in first.items()} == {a: ("extend", [5e-4, 2e-3])
                                                                      for a in ("diff", "standard")}
    standard_done = base + [_cell("standard", 5e-4, 2.9), _cell("standard", 2e-3, 3.1)]
    late = lr_brackets(spec, standard_done)
    assert {a: (b.status, b.next_lrs) for a, b in late.items()} == {a: (b.status, b.next_lrs) for a, b in first.items()}
    both_done = standard_done + [_cell("diff", 5e-4, 3.1), _cell("diff", 2e-3, 2.9)]
    final = lr_brackets(spec, both_done)
    assert {a: (b.status, b.best_lr, b.lr_extensions) for a, b in final.items()} == {
        "diff": ("cap", 2e-3, 1), "standard": ("cap", 5e-4, 1)}


def test_a_cell_held_elsewhere_is_waited_for_and_run_once():
    """A cell whose folder another worker holds (CellInUse) is not run here while it is held, and is not lost
    either (each worker would otherwise wait on it for ever): it is looked at again each poll and run once free;
    one that its holder finished meanwhile is not run again."""
    import functools

    from diffattn.experiments.study.cell import CellInUse
    from diffattn.experiments.study.workers import run_cells

    ran: list[str] = []
    finished: set[str] = set()
    held = {"a": 2, "b": 1}  # the looks that find it held

    def run(c: str) -> None:
        if held[c]:
            held[c] -= 1
            if c == "b":
                finished.add(c)  # its holder finishes it
            raise CellInUse(f"{c} is in use")
        ran.append(c)
        finished.add(c)

    assert run_cells({c: functools.partial(run, c) for c in "ab"}, finished.__contains__, lambda: None, 0.01)
    assert ran == ["a"] and held == {"a": 0, "b": 0}
