"""The plots a reader looks at (issue 32): lr_sweep.png labels every learning rate tried (it labelled only the
decades), every diagnostics.png panel has its y label and legend, no offset ("1e-5 + 2.548") and whole-number
steps, and the attention row's legend sits beside the curves, not over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffattn.experiments import plots
from diffattn.experiments.findings import figures as study_plots


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures the plot functions would write, kept open for the test to read."""
    figs: list = []
    monkeypatch.setattr(plots, "savefig", lambda fig, path, dpi=110: figs.append(fig) or path)
    yield figs
    for f in figs:
        plots.plt.close(f)


def _arm(name: str, attention: str, lrs: list[float]) -> dict:
    sweep = [{"lr": lr, "val_loss": 3.0 - i * 0.1, "seeds": [{"val_loss": 3.0 - i * 0.1}]} for i, lr in enumerate(lrs)]
    return {"name": name, "attention": attention, "label": name, "lr_sweep": sweep, "best_lr": lrs[-1],
            "val_loss_mean": sweep[-1]["val_loss"]}


def test_the_lr_sweep_labels_every_learning_rate_tried(drawn) -> None:
    results = {"arms": [_arm("diff", "diff", [0.00075, 0.0015, 0.003, 0.006]),
                        _arm("standard", "standard", [0.0015, 0.003, 0.006, 0.012])]}
    study_plots.plot_lr_sweep(results, Path("unused.png"))
    ax = drawn[0].axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["0.00075", "0.0015", "0.003", "0.006", "0.012"]
    assert not ax.xaxis.get_minorticklocs().size  # no unlabelled minor ticks between them


def test_every_diagnostics_panel_has_a_y_label_and_a_legend(drawn) -> None:
    rows = [{"step": s, "layer0.lambda": 0.1 + s / 1e4, "layer0.neg_mass": s / 1e5, "layer0.entropy1": 2.548,
             "layer0.entropy2": 2.548 + 1e-5 * s / 100} for s in (100, 200, 300)]
    std = [{"step": s, "layer0.entropy1": 2.5} for s in (100, 200, 300)]
    plots.plot_diagnostics([{"label": "DIFF", "attention": "diff", "diagnostics": rows},
                            {"label": "Transformer", "attention": "standard", "diagnostics": std}], Path("u.png"))
    fig = drawn[0]
    fig.canvas.draw()
    for ax in fig.axes:
        assert ax.get_ylabel() and ax.get_legend() is not None, ax.get_title()
        assert not ax.yaxis.get_offset_text().get_text()  # no "1e-5 + 2.548" above the axis
        assert all(float(t).is_integer() for t in ax.get_xticks())
    labels = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert labels == ["DIFF, A1", "DIFF, A2", "Transformer"]


def test_the_attention_row_legend_is_outside_the_curves(drawn) -> None:
    import numpy as np

    t = 16
    ex = {"label": "DIFF", "attention": "diff", "map": np.tril(np.ones((t, t))) / t, "rows": np.full((2, t), 0.06),
          "query_pos": t - 1, "span": (5, 7), "context_end": 12, "distractors": [2], "answer_share": 0.2}
    plots.plot_attention_maps([ex], Path("u.png"))
    fig = drawn[0]
    fig.canvas.draw()
    ax = next(a for a in fig.axes if a.get_legend() is not None)  # the query-row panel
    legend, frame = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= frame.x1  # beside the axes, not over the curves
