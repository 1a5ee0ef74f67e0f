"""The synthetic `diffattn compare` report: generated claims and verdicts, the harder needle grid, figures, the
attention-example flag and line-based progress output."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch
import torch.nn as nn

from diffattn.cli import compare
from diffattn.data.synthetic import NDL, make_synthetic
from diffattn.experiments import document, plots
from diffattn.experiments.needle import claims as C
from diffattn.experiments.needle import compare_report as needle_report
from diffattn.experiments.needle import defaults, settings
from diffattn.experiments.needle import run as needle


# ------------------------------------------------------------------------------------------ hand-built results
def _model(attention: str, *, loss: float, grid_acc: float, multi: dict, answer: float, noise: float,
           top1: float, quant_drop: float, ppl_rise: float) -> dict:
    n = 400
    grid = [{"depth": d, "length": 64, "acc": grid_acc, "queries": n} for d in (0.0, 0.5, 1.0)]
    shares = {"answer_pos_share": answer, "noise_pos_share": noise}
    se = {"answer_pos_share": 0.005, "noise_pos_share": 0.005}
    spread = {"mean": top1, "se": 0.1, "n": 5}
    return {
        "label": {"diff": "DIFF", "standard": "Transformer"}[attention],
        "attention": attention,
        "ppl": {"loss": loss, "loss_se": 0.01},
        "needle": {"grid": grid, "mean": grid_acc, "n_needles": 4, "multi": multi,
                   "multi_queries": {k: 2000 for k in multi}},
        "noise": {"mean": shares, "last_layer": shares, "mean_se": se, "last_layer_se": se, "sequences": 480},
        "outliers": {"spread": {"attn_logits_top1": spread, "hidden_top1": spread}},
        "quant": [
            {"bits": None, "multi_acc": 0.6, "multi_queries": 2000, "ppl_loss": loss, "ppl_loss_se": 0.01},
            {"bits": 8, "multi_acc": 0.6, "multi_queries": 2000, "ppl_loss": loss, "ppl_loss_se": 0.01},
            {"bits": 4, "multi_acc": 0.6 - quant_drop, "multi_queries": 2000, "ppl_loss": loss + ppl_rise,
             "ppl_loss_se": 0.01},
        ],
    }


def _results(diff: dict, base: dict) -> dict:
    return {"settings": {"quick": False}, "task": {"seq_len": 64}, "models": [diff, base]}


GOOD = dict(loss=1.0, grid_acc=0.9, multi={"1,1": 1.0, "2,2": 0.9, "4,2": 0.8}, answer=0.5, noise=0.2,
            top1=5.0, quant_drop=0.01, ppl_rise=0.01)
BAD = dict(loss=1.2, grid_acc=0.5, multi={"1,1": 1.0, "2,2": 0.6, "4,2": 0.3}, answer=0.2, noise=0.6,
           top1=9.0, quant_drop=0.3, ppl_rise=0.5)


def test_every_claim_reproduced_when_diff_is_clearly_better():
    cl = C.check_claims(_results(_model("diff", **GOOD), _model("standard", **BAD)))
    assert len(cl) == 13  # loss, grid, 2 multi, growth, 4 attention, 2 outliers, quant acc, quant loss
    assert all(c.verdict == "reproduced" for c in cl), [(c.claim, c.verdict) for c in cl]


def test_every_claim_fails_the_other_way_round():
    cl = C.check_claims(_results(_model("diff", **BAD), _model("standard", **GOOD)))
    assert [c.verdict for c in cl] == ["not reproduced (opposite)"] * len(cl)


def test_equal_models_are_within_noise():
    cl = C.check_claims(_results(_model("diff", **GOOD), _model("standard", **GOOD)))
    assert {c.verdict for c in cl} == {"not reproduced (within noise)"}


def test_verdict_threshold_is_two_standard_errors():
    c = C.Claim("x", "p", "m", "lower", 1.0, 0.15, 1.5, 0.2)  # delta -0.5, se 0.25: exactly 2 se
    assert c.verdict == "not reproduced (within noise)"
    c.diff = 0.99
    assert c.verdict == "reproduced"
    c.want = "higher"
    assert c.verdict == "not reproduced (opposite)"


def test_summary_text_says_what_the_numbers_say():
    good = dict(GOOD)
    diff = _model("diff", **{**BAD, "loss": good["loss"]})  # only the loss claim goes DIFF's way
    res = _results(diff, _model("standard", **BAD))
    cl = C.check_claims(res)
    md = document.to_markdown(C.summary_blocks(cl))
    assert f"**1 of the {len(cl)} paper claims checked here reproduced" in md
    reproduced = md.split("**Reproduced:**")[1].split("**Not reproduced")[0]
    assert "lower loss" in reproduced and "DIFF 1.000 ± 0.010 vs Transformer 1.200 ± 0.010" in reproduced
    assert "difference -0.200 ± 0.014" in reproduced
    assert "multi-needle" not in reproduced
    assert "**Not reproduced, the difference is within the noise:**" in md


def test_claims_missing_baseline_gives_no_claims():
    res = _results(_model("diff", **GOOD), _model("standard", **GOOD))
    res["models"] = res["models"][:1]
    assert C.check_claims(res) == []
    assert "No paper claim" in document.to_markdown(C.summary_blocks([]))


def test_binomial_and_grid_standard_errors():
    assert C.binomial_se(0.5, 100) == pytest.approx(0.05)
    assert C.binomial_se(1.0, 10) == 0.0
    grid = [{"acc": 0.5, "queries": 100}, {"acc": 0.5, "queries": 100}]
    assert C.grid_se(grid) == pytest.approx(0.05 / 2**0.5)


# ----------------------------------------------------------------------------------- the harder needle grid
class FirstNeedle(nn.Module):
    """A weak retriever that needs no training: it answers every query with the value of the first needle in
    the context. Perfect with one needle, wrong whenever a distractor needle comes first."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        first = (ids == NDL).float().argmax(1)  # position of the first NDL token
        value = ids[torch.arange(b), (first + 2).clamp_max(t - 1)]
        out = torch.zeros(b, t, self.vocab_size)
        out[torch.arange(b)[:, None], torch.arange(t)[None, :], value[:, None]] = 1.0
        return out


def test_default_grid_separates_a_weak_retriever():
    from diffattn.data.synthetic import needle_accuracy

    s = settings.CompareSettings.from_knobs(dict(samples=16), seed=0)
    task = make_synthetic("needle", s.train.seq_len, **defaults.TASK_PARAMS)
    cells = needle.grid_cells(task, s)
    assert {c.n_needles for c in cells} == {defaults.GRID_NEEDLES} and defaults.GRID_NEEDLES >= 2
    assert sorted({c.length for c in cells})[-1] == s.train.seq_len
    weak = FirstNeedle(task.vocab_size)
    acc = needle_accuracy(weak, cells)
    # At depth 100% the distractor always comes first (no room after the queried needle): always wrong.
    assert acc[(1.0, s.train.seq_len)] == 0.0 and min(acc.values()) < 1.0
    assert acc[(0.0, s.train.seq_len)] == 1.0  # at depth 0 it is the first needle: the retriever is right
    # The same retriever is perfect on the old single-needle grid: that grid could not separate anything.
    single = needle.default_cells(task, depths=s.depths, n_needles=1, n_samples=16, seed=1)
    assert set(needle_accuracy(weak, single).values()) == {1.0}


def test_task_fits_agrees_with_sampling():
    task = make_synthetic("needle", 64, max_needles=4, max_queries=2)
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    g = torch.Generator().manual_seed(0)
    for length in range(15, 30):
        ok = task.fits(length, 4, 1, depths)
        for d in depths:
            if ok:
                task.sample(g, length, 4, 1, depth=d)
        if not ok:
            with pytest.raises(ValueError):
                for d in depths:
                    task.sample(g, length, 4, 1, depth=d)
    assert task.shortest_fit(4, 1, depths, at_least=16) == 17
    with pytest.raises(ValueError, match="do not fit"):
        make_synthetic("needle", 18, max_needles=4, max_queries=2).shortest_fit(6, 1, depths)


# ---------------------------------------------------------------------------------------- example flag
def _ex_models(diff_share: float, base_share: float) -> list[dict]:
    ms = [_model("diff", **GOOD), _model("standard", **BAD)]
    for m, share in zip(ms, (diff_share, base_share)):
        m["_example"] = {"answer_share": share, "n_needles": 3, "length": 64}
    return ms


def test_example_note_flags_an_example_against_the_paper():
    note = needle_report.example_note(_ex_models(0.10, 0.30))
    assert "cuts against the paper" in note and "10.0%" in note and "30.0%" in note
    assert "0.500 ± 0.005" in note  # the evaluation-set mean is quoted next to it
    assert "not typical" in note  # DIFF's evaluation-set share (0.5) is above the baseline's (0.2)
    note = needle_report.example_note(_ex_models(0.30, 0.10))
    assert "agrees" in note and "same way round" in note


# ------------------------------------------------------------------------------------ the report end to end
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "r"
    err = io.StringIO()
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    with contextlib.redirect_stderr(err):  # a StringIO: not a TTY, like a log file
        needle.run_compare(compare.resolve(p.parse_args(["--quick"])), out, progress=False)
    return out, err.getvalue()


def test_report_summary_matches_results_json(quick_run):
    out, _ = quick_run
    res = json.loads((out / "results.json").read_text())
    again = C.check_claims(res)
    assert [c["verdict"] for c in res["claims"]] == [c.verdict for c in again] and again
    md = (out / "report.md").read_text()
    assert md.index("## Summary") < md.index("## Results")
    summary = (out / "summary.md").read_text()
    assert summary.strip() in md
    for c in again:  # every claim's row in the report carries its verdict and numbers
        claim, measure = document._md_cell(c.claim), document._md_cell(c.measure)
        row = next(line for line in md.splitlines() if line.startswith(f"| {claim} |") and measure in line)
        assert row.rstrip(" |").endswith(c.verdict)
        assert c.fmt(c.diff, c.diff_se) in row
    for name in ("multi_needle.png", "quantization.png", "needle_heatmaps.png", "attention_maps.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in md
    assert "N,R=2,2" in md and " ± " in md.split("N,R=2,2")[1]  # multi-needle entries carry their error
    ex = res["models"][0]["example"]  # the attention example is drawn like the grid: one distractor needle
    assert len(ex["distractors"]) == ex["n_needles"] - 1 == 1 and ex["span"][0] not in ex["distractors"]
    assert "In this example" in md


def test_progress_output_is_lines(quick_run):
    _, err = quick_run
    assert "\r" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("[1/2] training DIFF") and any("evaluated Transformer" in x for x in lines)


def test_quantization_figure_has_a_perplexity_panel(tmp_path, monkeypatch):
    ms = [_model("diff", **GOOD), _model("standard", **GOOD)]  # identical numbers: the lines coincide
    for m in ms:
        for r in m["quant"]:
            r["ppl_ppl"] = 2.0
    captured = []
    real = plots.plt.subplots

    def spy(*a, **k):
        fig, axes = real(*a, **k)
        captured.append(axes)
        return fig, axes

    monkeypatch.setattr(plots.plt, "subplots", spy)
    plots.plot_quantization(ms, tmp_path / "q.png")
    axes = captured[0][0]
    assert [a.get_ylabel() for a in axes] == ["exact-match accuracy", "perplexity"]
    for ax in axes:  # the two models' points sit side by side, not on top of each other
        xs = [tuple(c.lines[0].get_xdata()) for c in ax.containers if c.get_label() in ("DIFF", "Transformer")]
        assert len(xs) == 2 and all(a != b for a, b in zip(*xs))
    assert (tmp_path / "q.png").stat().st_size > 0
