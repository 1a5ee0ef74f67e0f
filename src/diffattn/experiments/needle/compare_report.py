"""The report of a ``diffattn compare`` run (:mod:`diffattn.experiments.needle.run`): plots, files, sections.

:func:`write_report` draws the plots (:func:`draw_plots`), writes ``config.json``, ``command.txt`` and
``results.json`` (:func:`write_artifacts`), then ``report.md``, ``summary.md`` and ``report.html`` from the
blocks of :func:`blocks`, one section builder per table of the paper. Every number comes from ``results``
(and, for the attention figure, the in-memory example maps of ``models``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffattn.eval.needles import MULTI_FACTOR
from diffattn.experiments import document, plots
from diffattn.experiments.needle.claims import check_claims, summary_table
from diffattn.experiments.needle.claims import summary_blocks as claim_blocks
from diffattn.experiments.needle.claims import verdict_lines as claim_lines
from diffattn.experiments.needle.defaults import BITS
from diffattn.experiments.needle.settings import command_line
from diffattn.system.atomic_files import atomic_write


def fmt(x, nd: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _acc_se(needle: dict, key: str) -> str:
    """A multi-needle entry as "acc ± se" (binomial over its answers) when its count is known."""
    acc = needle["multi"].get(key)
    n = (needle.get("multi_queries") or {}).get(key)
    if acc is None or not n:
        return fmt(acc, 2)
    return f"{acc:.2f} ± {(acc * (1 - acc) / n) ** 0.5:.2f}"


def _multi_title(m: dict) -> str:
    q = m.get("quant_multi_setting") or {}
    return f"N={q.get('n_needles')} needles, R={q.get('n_queries')} queried, L={q.get('length')}"


def _grid_title(m: dict) -> str:
    k = m["needle"].get("n_needles", 1)
    if k == 1:
        return "1 needle, depth × length grid"
    other = "1 distractor needle" if k == 2 else f"{k - 1} distractor needles"
    return f"the needle at each depth plus {other}, depth × length grid"


def example_note(models: list[dict]) -> str | None:
    """The sentence set next to the attention figure: whether the example agrees with the paper's Table 3
    (DIFF attends more to the answer span) and how it compares with the evaluation-set means."""
    by = {m["attention"]: m for m in models}
    if "diff" not in by or "standard" not in by:
        return None
    d, b = by["diff"], by["standard"]
    ed, eb = d.get("_example") or d.get("example"), b.get("_example") or b.get("example")
    if not ed or not eb or ed.get("answer_share") is None:
        return None
    sd, sb = ed["answer_share"], eb["answer_share"]
    agree = sd > sb
    text = (
        f"In this example (the queried needle at 50% depth among {ed.get('n_needles', '?')} needles, "
        f"L={ed.get('length', '?')}) {d['label']} puts {sd:.1%} of its positive last-layer attention at the "
        f"query on the answer span and {b['label']} {sb:.1%}: "
        + (
            "the example agrees with the paper's Table 3 (DIFF attends more to the answer)."
            if agree
            else "**the example cuts against the paper's Table 3**, which has DIFF attending more to the answer."
        )
    )
    nd, nb = d.get("noise"), b.get("noise")
    if nd and nb and "last_layer_se" in nd:
        k = "answer_pos_share"
        text += (
            f" Over all {nd.get('sequences', '?')} evaluation sequences the same share is "
            f"{nd['last_layer'][k]:.3f} ± {nd['last_layer_se'][k]:.3f} for {d['label']} and "
            f"{nb['last_layer'][k]:.3f} ± {nb['last_layer_se'][k]:.3f} for {b['label']}"
        )
        if agree != (nd["last_layer"][k] > nb["last_layer"][k]):
            text += ", the other way round: the example is not typical of the run."
        else:
            text += ", the same way round as the example (the summary says whether that gap is beyond the noise)."
    return text


def summary_blocks(results: dict) -> list[tuple]:
    """The report's summary: generated paragraphs (what reproduced, what did not, in numbers) and the claims
    table; every number and verdict comes from ``results``."""
    claims = check_claims(results)
    labels = {m["attention"]: m["label"] for m in results["models"]}
    d_label, b_label = labels.get("diff", "DIFF"), labels.get("standard", "Transformer")
    b = claim_blocks(claims, d_label, b_label)
    if results["settings"].get("quick"):  # first, before any count or verdict is read as a finding
        b.insert(0, ("p", "**Smoke run (--quick): not evidence for or against any claim.** The models are tiny "
                          "and barely trained; the verdicts below only show that the pipeline runs. Run "
                          "`diffattn compare` without --quick for the real comparison."))
    if claims:
        b.append(summary_table(claims, d_label, b_label))
    return b


def verdict_lines(results: dict) -> list[str]:
    """The summary as the lines ``diffattn compare`` prints: the verdict on each claim, after a --quick run's
    caveat."""
    labels = {m["attention"]: m["label"] for m in results["models"]}
    lines = claim_lines(check_claims(results), labels.get("diff", "DIFF"), labels.get("standard", "Transformer"))
    if results["settings"].get("quick"):
        lines.insert(0, "smoke run (--quick): not evidence for or against any claim; the models are tiny and barely "
                        "trained (run diffattn compare without --quick for the real comparison)")
    return lines


# ------------------------------------------------------------------------------------------------ plots
def draw_plots(results: dict, models: list[dict], out: Path) -> dict[str, str]:
    """Draw every figure of the report into ``out``; -> {section: PNG file name}. ``models`` carry the
    in-memory attention example (``_example``) the attention figure needs."""
    s = results["settings"]
    pngs = {
        "loss": plots.plot_loss_curves(models, out / "loss_curves.png").name,
        "needle": plots.plot_needle_heatmaps(
            [{"label": m["label"], "grid": m["needle"]["grid"]} for m in models],
            out / "needle_heatmaps.png",
            title=f"Needle retrieval accuracy: {_grid_title(models[0])}",
        ).name,
        "multi": plots.plot_multi_needle(
            [
                {"label": m["label"], "attention": m["attention"], "multi": m["needle"]["multi"],
                 "multi_queries": m["needle"].get("multi_queries")}
                for m in models
            ],
            out / "multi_needle.png",
            length=s["seq_len"],
        ).name,
        "attn": plots.plot_attention_maps(
            [{**m["_example"], "label": m["label"], "attention": m["attention"]} for m in models],
            out / "attention_maps.png",
        ).name,
        "outliers": plots.plot_outliers(models, out / "outliers.png").name,
        "quant": plots.plot_quantization(
            [{**m, "multi_title": _multi_title(m), "grid_title": _grid_title(m)} for m in models],
            out / "quantization.png",
        ).name,
    }
    if any(m.get("diagnostics") for m in models):
        pngs["diagnostics"] = plots.plot_diagnostics(models, out / "diagnostics.png").name
    return pngs


# -------------------------------------------------------------------------------------------- artifacts
def write_artifacts(results: dict, models: list[dict], out: Path) -> str:
    """``config.json`` (the full settings), ``command.txt`` and ``results.json``; -> the rerun command."""
    s = results["settings"]
    cmd = command_line(s, out)
    config = {
        "command": cmd,
        "settings": s,
        "task": results["task"],
        "train": results["train"],
        "models": [m["config"] for m in models],
        "eval": {"bits": list(BITS), "cells_seed": s["seed"] + 1, "grid_needles": models[0]["needle"]["n_needles"]},
        "torch": torch.__version__,
    }
    atomic_write(out / "config.json", json.dumps(config, indent=2) + "\n")
    atomic_write(out / "command.txt", cmd + "\n")
    atomic_write(out / "results.json", json.dumps(results, indent=2, default=float) + "\n")
    return cmd


# --------------------------------------------------------------------------------------------- sections
def _intro(results: dict, models: list[dict]) -> list[tuple]:
    """The title, the summary of the paper's claims, and what was run."""
    s, task = results["settings"], results["task"]
    n_multi = MULTI_FACTOR * s["samples"] // 5 * 5
    b: list[tuple] = [("h", 1, "DIFF vs Transformer on synthetic needle retrieval")]
    b.append(("h", 2, "Summary: the paper's claims against this run"))
    b += summary_blocks(results)
    b.append(
        (
            "p",
            f"Task: {task['seq_len']}-token training context, up to "
            f"{task['max_needles']} needles and {task['max_queries']} queries per "
            f"sequence; {s['steps']} steps of batch "
            f"{s['batch_size']} per model, same data order and seed ({s['seed']}). Wall time "
            f"{results['wall_time_s']:.0f} s. Evaluation: {s['samples']} examples per depth × length cell "
            f"({models[0]['needle'].get('n_needles', 1)} needles in every context, the one at the cell's depth "
            f"queried); {n_multi} per multi-needle entry (the quantization sweep reuses the N=4, R=2 "
            f"ones). Accuracies carry sampling error of up to ±{1 / (2 * n_multi**0.5):.2f}"
            f" (one standard error at 50%) on multi-needle entries."
            + (" QUICK smoke run: numbers are not meaningful." if s["quick"] else ""),
        )
    )
    return b


def _results_table(models: list[dict]) -> list[tuple]:
    head = ["model", "attention", "params", "train loss", "val loss", "answer ppl", "needle acc (grid mean)",
            "train time (s)"]
    rows = [
        [m["label"], m["attention"], f"{m['params']:,}", fmt(m["final_train_loss"]), fmt(m["final_val_loss"]),
         fmt(m["ppl"]["ppl"]), fmt(m["needle"]["mean"]), f"{m['train_time_s']:.1f}"]
        for m in models
    ]
    return [("h", 2, "Results"), ("table", head, rows)]


def _needle_grid(models: list[dict], pngs: dict[str, str]) -> list[tuple]:
    grid0 = models[0]["needle"]["grid"]
    lengths = sorted({g["length"] for g in grid0})
    depths = sorted({g["depth"] for g in grid0})
    rows = []
    for m in models:
        acc = {(g["depth"], g["length"]): g["acc"] for g in m["needle"]["grid"]}
        for d in depths:
            rows.append([m["label"], f"{d:.0%}"] + [fmt(acc[(d, n)], 2) for n in lengths])
    return [
        ("h", 3, f"Needle accuracy per depth × length ({_grid_title(models[0])})"),
        ("table", ["model", "depth"] + [f"L={n}" for n in lengths], rows),
        ("img", pngs["needle"], "Needle accuracy heatmaps"),
    ]


def _multi_needle(models: list[dict], seq_len: int, pngs: dict[str, str]) -> list[tuple]:
    keys = list(models[0]["needle"]["multi"])
    return [
        ("h", 3, f"Multi-needle retrieval at L={seq_len} (N needles, R queried; paper Table 2 style)"),
        ("table", ["model"] + [f"N,R={k}" for k in keys],
         [[m["label"]] + [_acc_se(m["needle"], k) for k in keys] for m in models]),
        ("img", pngs["multi"], "Multi-needle accuracy vs number of needles"),
    ]


# (results key, noise-analysis entry, column name) of the attention table
_NOISE_COLUMNS = (
    ("answer_signed", "mean", "answer signed (all)"),
    ("noise_signed", "mean", "noise signed (all)"),
    ("answer_signed", "last_layer", "answer signed (last)"),
    ("noise_signed", "last_layer", "noise signed (last)"),
    ("answer_pos_share", "last_layer", "answer +share (last)"),
    ("noise_pos_share", "last_layer", "noise +share (last)"),
    ("neg_mass", "last_layer", "neg mass (last)"),
)


def _attention(models: list[dict], pngs: dict[str, str]) -> list[tuple]:
    b: list[tuple] = [
        ("h", 3, "Attention on the answer span vs the noise context (paper Table 3 style)"),
        (
            "p",
            "At the query position: 'signed' = plain sum of the effective map over the region (DIFF's map "
            "A1 − λA2 has negative entries and rows summing to 1 − λ, so signed values of the regions do not "
            "add up to 1); '+share' = the region's share of the row's positive mass. 'neg mass' = sum of the "
            "negative entries of the row. 'all' = mean over all layers and heads; 'last' = last layer.",
        ),
        ("table", ["model"] + [name for _, _, name in _NOISE_COLUMNS],
         [[m["label"]] + [fmt(m["noise"][w][k]) for k, w, _ in _NOISE_COLUMNS] for m in models]),
    ]
    note = example_note(models)
    if note:
        b.append(("p", note))
    b.append(("img", pngs["attn"], "Attention maps on one example"))
    return b


def _outliers(models: list[dict], pngs: dict[str, str]) -> list[tuple]:
    st = ["top1", "top2", "top3", "top10", "top100", "median"]
    rows = [
        [m["label"], what] + [fmt(m["outliers"][key].get(k), 2) for k in st]
        for m in models
        for key, what in (("attn_logits", "|attention logits|"), ("hidden", "|hidden states|"))
    ]
    return [
        ("h", 3, "Activation outliers (paper Table 5 style)"),
        ("table", ["model", "of"] + st, rows),
        ("img", pngs["outliers"], "Activation outliers"),
    ]


def _quantization(models: list[dict], pngs: dict[str, str]) -> list[tuple]:
    qbits = [r["bits"] for r in models[0]["quant"]]
    qname = ["fp32" if q is None else f"{q}-bit" for q in qbits]
    rows = (
        [[m["label"], f"needle acc ({_grid_title(m)})"] + [fmt(r.get("needle_acc")) for r in m["quant"]]
         for m in models]
        + [[m["label"], f"needle acc ({_multi_title(m)})"] + [fmt(r.get("multi_acc")) for r in m["quant"]]
           for m in models]
        + [[m["label"], f"answer ppl ({m['quant'][0].get('ppl_tokens', '?')} answer tokens, training mix)"]
           + [fmt(r.get("ppl_ppl")) for r in m["quant"]] for m in models]
    )
    return [
        ("h", 3, "Attention-logit quantization (absmax per batch×head, paper Fig. 8 style)"),
        ("table", ["model", "metric"] + qname, rows),
        ("img", pngs["quant"], "Needle accuracy and answer perplexity vs logit bits"),
    ]


def _training(pngs: dict[str, str]) -> list[tuple]:
    b: list[tuple] = [("h", 3, "Training curves"), ("img", pngs["loss"], "Loss curves")]
    if "diagnostics" in pngs:
        b.append(("p", "DIFF diagnostics at each evaluation on a fixed validation probe batch (diagnostics.csv "
                       "in each run folder; means over layers): λ or V2's mean gate σ, the mass of the negative "
                       "part of the differential map, and the row entropy of each softmax map."))
        b.append(("img", pngs["diagnostics"], "DIFF diagnostics"))
    return b


def _rerun(cmd: str) -> list[tuple]:
    return [
        ("h", 2, "Rerun"),
        ("pre", cmd),
        (
            "p",
            "Full settings in config.json, every number in results.json, checkpoints under runs/ "
            "(evaluate one with `diffattn eval runs/diff/ckpt`).",
        ),
    ]


def blocks(results: dict, models: list[dict], pngs: dict[str, str], cmd: str) -> list[tuple]:
    """The whole report as blocks (:func:`diffattn.experiments.document.to_markdown`), section by section."""
    return [
        *_intro(results, models),
        *_results_table(models),
        *_needle_grid(models, pngs),
        *_multi_needle(models, results["settings"]["seq_len"], pngs),
        *_attention(models, pngs),
        *_outliers(models, pngs),
        *_quantization(models, pngs),
        *_training(pngs),
        *_rerun(cmd),
    ]


def write_report(results: dict, models: list[dict], out: Path) -> None:
    """Record the claims' verdicts in ``results`` (so results.json holds them), draw the plots, write the
    artifacts, then report.md, summary.md (the summary alone, for quoting) and report.html."""
    results["claims"] = [c.to_dict() for c in check_claims(results)]
    pngs = draw_plots(results, models, out)
    cmd = write_artifacts(results, models, out)
    b = blocks(results, models, pngs, cmd)
    atomic_write(out / "summary.md", document.to_markdown(summary_blocks(results)))
    atomic_write(out / "report.html", document.to_html(b, out, "diffattn compare"))
    atomic_write(out / "report.md", document.to_markdown(b))  # last: a folder with report.md holds a finished run
