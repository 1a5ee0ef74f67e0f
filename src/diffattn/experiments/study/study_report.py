"""Render a collected ``diffattn study`` experiment (:func:`diffattn.experiments.study.collect.collect`): results.json,
report.md and a self-contained report.html (the same blocks; PNGs embedded), with the verdict first."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from diffattn.experiments import document, plots
from diffattn.experiments.plots import plt
from diffattn.experiments.study import analysis, early, stats
from diffattn.experiments.study.defaults import DEFAULT_LR_EXTENSIONS
from diffattn.experiments.study.depth import depth_sentence
from diffattn.fileio import atomic_write, printable


def _f(x: Any, nd: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{nd}f}"


def _ci(ci: list, nd: int = 4) -> str:
    if not ci or ci[0] is None:
        return "–"
    return f"[{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]"


def _signed_ci(ci: list, nd: int = 4) -> str:
    if not ci or ci[0] is None:
        return "–"
    return f"[{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}]"


def verdict_text(results: dict) -> str:
    """One paragraph with the numbers of the primary comparison (DIFF vs its matched baseline)."""
    v = results.get("verdict")
    arms = {a["name"]: a for a in results["arms"]}
    spec = results["spec"]
    if not v:
        return ("No verdict yet: the grid is not finished (re-run the same command to resume). "
                f"{results['cells']['finished']} of {results['cells']['grid']} cells are done.")
    c, b = arms[v["candidate"]], arms[v["baseline"]]
    n = len(v["seeds"])
    tok = spec["steps"] * spec["batch_size"] * spec["seq_len"]
    head = {
        "better": "DIFF is better than its parameter-matched baseline at this budget",
        "worse": "DIFF is worse than its parameter-matched baseline at this budget",
    }.get(v["conclusion"], f"DIFF vs its parameter-matched baseline: {v['conclusion']}")
    depth = results.get("depth") or {}
    if depth.get("barely"):
        head = (f"Barely trained: at this budget neither model is far below the unigram floor, so this comparison "
                f"says little about DIFF (on these numbers: {v['conclusion']})")
    return (
        f"**{head}.** " + (depth_sentence(depth, tok) + " " if depth else "")
        + f"{c['label']} vs {b['label']}, {c['params']:,} vs {b['params']:,} parameters, on "
        f"{document.name(Path(spec['data']).name)} ({spec['tokenizer']} tokenizer), {spec['steps']:,} steps × "
        f"{spec['batch_size']}×{spec['seq_len']} tokens ({tok:,} tokens) per run, each arm at its own best of "
        f"{_n_lrs(c, spec)} and {_n_lrs(b, spec)} learning rates ({c['best_lr']:g} and {b['best_lr']:g}; "
        f"{_bracket_words(c, b)}), {n} paired seeds{_width(spec)}. Validation loss "
        f"{_f(c['val_loss_mean'])} {_ci(c['val_loss_ci95'])} vs {_f(b['val_loss_mean'])} "
        f"{_ci(b['val_loss_ci95'])} nats/token ({_f(c['bpc_mean'], 3)} vs {_f(b['bpc_mean'], 3)} bits/char). "
        f"Paired per-seed difference DIFF − baseline: {v['diff_minus_baseline']:+.4f} nats/token, 95% CI "
        f"{_signed_ci(v['ci95'])} (Student t, {n - 1} df): {v['conclusion']}."
    )


def _n_lrs(arm: dict, spec: dict) -> int:
    return len(arm.get("lrs") or spec["lrs"])


def _bracket_words(*arms: dict) -> str:
    if all(a.get("bracketed") for a in arms):
        return "both bracketed: a lower and a higher LR were worse"
    return "**" + ", ".join(f"{a['label']} {'bracketed' if a.get('bracketed') else 'NOT bracketed'}"
                            for a in arms) + "**"


def _width(spec: dict) -> str:
    return f", Q/K head width {spec['head_dim']}" if spec.get("head_dim") else ""


def dynamics_blocks(v: dict) -> list[tuple]:
    """What the verdict says beyond the final number: an arm still unbracketed, the gap's trend over the
    last third, the token ratio next to the paper's, the parameter difference of a not-matched arm."""
    b: list[tuple] = [("p", f"**{note}**") for note in v.get("unbracketed") or []]
    if v.get("trend"):
        b.append(("p", v["trend"]["sentence"]))
    if v.get("token_ratio"):
        b.append(("p", analysis.token_ratio_sentence(v["token_ratio"], v["candidate"], v["baseline"])))
    pd = v.get("param_difference")
    if pd is not None and abs(pd) >= 0.02:  # DIFF V1 is within 1% by design (λ vectors, norm gains)
        b.append(("p", f"{v['candidate']} has {pd:+.1%} parameters against {v['baseline']} "
                  f"({v['candidate_params']:,} vs {v['baseline_params']:,}): not parameter-matched (a "
                  "TYPE+matched variant trains it with a smaller FFN that matches)."))
    return b


def trajectory_rows(v: dict) -> list[list]:
    return [[f"{p['step']:,}", f"{p['tokens']:,}", _f(p["diff_minus_baseline"]), _signed_ci(p["ci95"])]
            for p in v.get("trajectory") or []]


# ------------------------------------------------------------------------------------------------ plots
def arm_colors(arms: list[dict]) -> dict[str, str]:
    """{arm name: colour}: the registry's colour for the first arm of each attention type, a spare colour for
    every further arm of a type already drawn (V1 with and without its norm must not share a line colour)."""
    out: dict[str, str] = {}
    used: set[str] = set()
    spare = 0
    for i, a in enumerate(arms):
        c = plots.color_for(a["attention"], i)
        for _ in range(8):  # the spare palette is finite: past it, colours repeat
            if c not in used:
                break
            c = plots.color_for(f"spare{spare}", spare)
            spare += 1
        out[a["name"]] = c
        used.add(c)
    return out


def draw_trajectory(results: dict, ax) -> bool:
    """DIFF − baseline validation loss at each evaluation (each arm at its best LR), with its 95% band, on
    ``ax``; -> whether there was anything to draw."""
    drawn = False
    for i, v in enumerate(results["comparisons"]):
        pts = [p for p in v.get("trajectory") or [] if p["diff_minus_baseline"] is not None]
        if not pts:
            continue
        drawn = True
        c = plots.color_for("diff" if i == 0 else f"comparison{i}", i)
        ax.plot([p["tokens"] for p in pts], [p["diff_minus_baseline"] for p in pts], marker="o", lw=2, color=c,
                label=f"{v['candidate']} − {v['baseline']}")
        band = [(p["tokens"], *p["ci95"]) for p in pts if p["ci95"][0] is not None]
        if band:
            ax.fill_between([t for t, _, _ in band], [lo for _, lo, _ in band], [hi for _, _, hi in band],
                            color=c, alpha=0.2)
    if drawn:
        ax.axhline(0, color="grey", lw=1)
        plots.label_axes(ax, "training tokens", "Δ val loss (nats/token)",
                         "Paired gap over training (band: 95% CI; below 0: candidate better)")
    return drawn

def plot_lr_sweep(results: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = arm_colors(results["arms"])
    for a in results["arms"]:
        c = colors[a["name"]]
        lrs = [p["lr"] for p in a["lr_sweep"]]
        means = [p["val_loss"] if p["val_loss"] is not None else np.nan for p in a["lr_sweep"]]
        ax.plot(lrs, means, color=c, marker="o", lw=2, label=f"{a['label']} (mean)")
        for p in a["lr_sweep"]:
            ys = [s["val_loss"] for s in p["seeds"] if s["val_loss"] is not None]
            ax.scatter([p["lr"]] * len(ys), ys, color=c, s=12, alpha=0.5)
            if len(ys) > 1:
                ax.vlines(p["lr"], min(ys), max(ys), color=c, alpha=0.5, lw=1)
        ax.scatter([a["best_lr"]], [a["val_loss_mean"]], color=c, marker="*", s=160, zorder=5)
    ax.set_xscale("log")
    plots.label_each_tick(ax, sorted({p["lr"] for a in results["arms"] for p in a["lr_sweep"]}))
    plots.label_axes(ax, "peak learning rate (every LR tried)", "validation loss (nats/token)",
                     "Validation loss vs LR (dots: seeds; bar: seed range; star: best LR)")
    return plots.savefig_tight(fig, path)


def plot_curves(results: dict, path: Path) -> Path:
    """Loss vs tokens per arm; below it, when the verdict has one, the gap over training with its band (one
    figure: the report keeps its three images)."""
    gap = any(c.get("trajectory") for c in results["comparisons"])
    fig, axes = plt.subplots(2 if gap else 1, 1, figsize=(7, 7.6 if gap else 4.2), squeeze=False)
    ax = axes[0][0]
    if gap:
        draw_trajectory(results, axes[1][0])
    colors = arm_colors(results["arms"])
    for a in results["arms"]:
        c = colors[a["name"]]
        runs = []
        for s in a["seeds"]:
            pts = [(h["tokens_seen"], h["val_loss"]) for h in s["history"] if h.get("val_loss") is not None]
            if pts:
                runs.append(dict(pts))
        if not runs:
            continue
        xs = sorted(set.intersection(*(set(r) for r in runs)))
        ys = np.array([[r[x] for x in xs] for r in runs])
        ax.plot(xs, ys.mean(0), color=c, lw=2, label=f"{a['label']}, lr {a['best_lr']:g}")
        if len(runs) > 1:
            ax.fill_between(xs, ys.min(0), ys.max(0), color=c, alpha=0.2)
    plots.label_axes(ax, "training tokens", "validation loss (nats/token, sampled batches)",
                     "Loss vs tokens at each arm's best LR (band: seed range)")
    return plots.savefig_tight(fig, path)


def plot_ladder(results: dict, path: Path) -> Path:
    lad = results["ladder"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = {a["name"]: a for a in results["arms"]}
    colors = arm_colors(results["arms"])
    for name, arm in lad["arms"].items():
        a, c = names[name], colors[name]
        pts = [p for p in arm["points"] if p["val_loss_mean"] is not None]
        if not pts:
            continue
        n = np.array([p["non_embedding_params"] for p in pts], dtype=float)
        y = np.array([p["val_loss_mean"] for p in pts])
        err = [[p["val_loss_mean"] - (p["val_loss_ci95"][0] if p["val_loss_ci95"][0] is not None
                                      else p["val_loss_mean"]) for p in pts]]
        ax.errorbar(n, y, yerr=[err[0], err[0]], fmt="o", color=c, label=a["label"])
        if arm["fit"]:
            grid = np.geomspace(n.min() * 0.8, n.max() * 1.25, 50)
            ax.plot(grid, arm["fit"]["alpha"] - arm["fit"]["beta"] * np.log(grid), color=c, lw=1.5, alpha=0.8)
    ax.set_xscale("log")
    plots.label_axes(ax, "non-embedding parameters", "validation loss (nats/token)",
                     "Size ladder at each arm's best LR; lines: L = α − β·ln N")
    return plots.savefig_tight(fig, path)


# ----------------------------------------------------------------------------------------------- the report
def banners(results: dict) -> list[tuple]:
    """What the reader must know before any number: an unfinished study, a smoke run."""
    b: list[tuple] = []
    inc = results.get("incomplete")
    if inc:
        b.append(("p", f"**incomplete: {inc['finished']} of {inc['total']} cells — no "
                  f"{inc['withheld']}.** The numbers below come from the finished cells only. Re-run the same "
                  f"command to resume: {document.code(resume_command(results))}"))
    if (results.get("plan") or {}).get("quick"):
        b.append(("p", "**Smoke run (--quick): tiny models trained for a few steps. It checks that the pipeline "
                  "runs; its numbers are not evidence for or against DIFF.**"))
    return b


def resume_command(results: dict) -> str:
    plan = results.get("plan") or {}
    return plan.get("resume_command") or plan.get("command") or "diffattn study ... --out ..."


def _load(x: Any) -> str:
    return ", ".join(f"{v:.2f}" for v in x) if isinstance(x, (list, tuple)) and x else "unknown"


def early_blocks(results: dict) -> list[tuple]:
    """Early training: each differential arm against its variants over training, then the diagnostics that
    say why a DIFF arm starts slower (attention branch vs residual stream, λ, gradient norms)."""
    e = results.get("early") or {}
    b: list[tuple] = []
    for pair in e.get("between") or []:
        if not pair["gap"]:
            continue
        last = pair["gap"][-1]
        b.append(("h", 3, f"{pair['candidate']} − {pair['other']} over training (paired over seeds, each at its "
                  "best LR)"))
        b.append(("p", f"At the end: {last['mean']:+.4f} nats/token, 95% CI {_signed_ci(last['ci95'])} "
                  f"({stats.verdict(*[x if x is not None else math.nan for x in last['ci95']])} for "
                  f"{pair['candidate']} against {pair['other']})."))
        b.append(("table", ["step", "Δ nats/token", "95% CI"],
                  [[r["step"], f"{r['mean']:+.4f}", _signed_ci(r["ci95"])] for r in pair["gap"]]))
    tables = early.early_tables(e.get("arms") or {})
    if tables:
        b.append(("h", 3, "Early training diagnostics (mean over seeds at each arm's best LR)"))
        b.append(("p", "attn/resid: RMS of what the attention branch adds to the residual stream over the RMS of "
                  "the stream entering the block, per layer, on a fixed probe batch; λ (V1) or σ (V2); gradient "
                  "norms per parameter group before clipping, over all layers (each cell's diagnostics.csv)."))
        b += [("table", h, r) for h, r in tables]
    return b


def _verdict_blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The verdict's dynamics and the gap over training."""
    b: list[tuple] = []
    v = results.get("verdict")
    if v:
        b += dynamics_blocks(v)
        if v.get("trajectory"):
            b.append(("h", 3, f"The gap over training ({v['candidate']} − {v['baseline']}, paired over seeds, "
                      "the same validation batches at every point)"))
            b.append(("table", ["step", "tokens", "Δ nats/token", "95% CI"], trajectory_rows(v)))
            b.append(("p", f"The gap with its 95% band is plotted under the loss curves ({pngs['curves']})."))
    return b


def _comparison_blocks(results: dict) -> list[tuple]:
    """Every comparison, when there are several."""
    b: list[tuple] = []
    comps = results["comparisons"]
    if len(comps) > 1:
        b.append(("h", 3, "Every comparison (candidate − its baseline, paired over seeds)"))
        b.append(("table", ["candidate", "baseline", "params Δ", "LRs", "Δ nats/token", "95% CI", "Δ bits/char",
                            "token ratio", "verdict"], [
            [c["candidate"], c["baseline"], f"{c['param_difference']:+.1%}" if "param_difference" in c else "–",
             f"{c['candidate_lr']:g} / {c['baseline_lr']:g}",
             _f(c["diff_minus_baseline"]), _signed_ci(c["ci95"]), _f(c["bpc_diff_minus_baseline"]),
             analysis.token_ratio_text(c["token_ratio"]) if c.get("token_ratio") else "–",
             c["conclusion"]] for c in comps]))
    return b


def _arm_blocks(results: dict) -> list[tuple]:
    """Each arm at its best learning rate, and the paired differences per seed."""
    b: list[tuple] = []
    spec = results["spec"]
    b.append(("h", 2, "Results at each arm's best learning rate"))
    seeds = spec["seeds"]
    b.append(("table",
              ["arm", "attention", "heads", "params", "non-emb params", "best LR", "val loss (nats/token)",
               "95% CI", "bits/char", "95% CI"] + [f"seed {s}" for s in seeds],
              [[a["label"], a["attention"], a["n_heads"], f"{a['params']:,}", f"{a['non_embedding_params']:,}",
                f"{a['best_lr']:g}", _f(a["val_loss_mean"]), _ci(a["val_loss_ci95"]), _f(a["bpc_mean"]),
                _ci(a["bpc_ci95"])] + [_f(s["val_loss"]) for s in a["seeds"]] for a in results["arms"]]))
    v = results.get("verdict")
    if v:
        b.append(("table", ["seed", f"{v['candidate']} − {v['baseline']} (nats/token)"],
                  [[s, _f(d)] for s, d in zip(v["seeds"], v["differences"])]))
    return b


def _sweep_blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The learning-rate sweep, its bracketing, and the sweep and curve plots."""
    b: list[tuple] = []
    spec = results["spec"]
    b.append(("h", 3, "Learning-rate sweep (mean validation loss over seeds; each arm tuned on its own)"))
    lrs = sorted({p["lr"] for a in results["arms"] for p in a["lr_sweep"]})
    rows = []
    for a in results["arms"]:
        by = {p["lr"]: p for p in a["lr_sweep"]}
        rows.append([a["label"]] + [
            (_f(by[lr]["val_loss"]) + (" (diverged)" if any(s["diverged"] for s in by[lr]["seeds"]) else "")
             + (" *" if lr == a["best_lr"] else "")) if lr in by else "–" for lr in lrs])
    b.append(("table", ["arm"] + [f"lr {x:g}" for x in lrs], rows))
    k = spec.get("lr_extensions", DEFAULT_LR_EXTENSIONS)
    b.append(("table", ["arm", "LRs tried", "best LR", "bracketed", f"extensions used (of {k})"],
              [[a["label"], ", ".join(f"{x:g}" for x in a.get("lrs") or []), f"{a['best_lr']:g}",
                "yes" if a.get("bracketed") else "**no**", a.get("lr_extensions", 0)] for a in results["arms"]]))
    edge = [a for a in results["arms"] if a.get("lr_note")]
    if edge:
        b.append(("p", f"Best LR at the edge of the sweep for {', '.join(a['label'] for a in edge)}, after "
                  f"--lr-extensions {k}: the optimum may lie outside it. " + " ".join(a["lr_note"] for a in edge)))
    b.append(("img", pngs["lr"], "Validation loss vs learning rate, with seed spread"))
    b.append(("img", pngs["curves"], "Validation loss vs training tokens at each arm's best LR, seed bands; "
              "below: the paired gap over training with its 95% band"))
    return b


def _ladder_blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The size ladder and its fits, when there is one."""
    b: list[tuple] = []
    lad = results.get("ladder")
    if not lad:
        return b
    b.append(("h", 2, "Size ladder"))
    b.append(("p", "Each arm is trained at d_model " + ", ".join(map(str, lad["sizes"])) + " with its best "
              "LR from the grid, all seeds, the same steps. Fit per arm: L = α − β·ln N over non-embedding "
              "parameters N. With three sizes a three-parameter power law a·N^−b + c would pass through every "
              "point exactly and its offset c is ill-determined over this range, so the two-parameter "
              "log-linear form is used; read the parameter ratio as local, not as an extrapolation."))
    rows = []
    for name, arm in lad["arms"].items():
        for p in arm["points"]:
            rows.append([name, p["d_model"], f"{p['non_embedding_params']:,}", _f(p["val_loss_mean"]),
                         _ci(p["val_loss_ci95"]), p["seeds"]])
    b.append(("table", ["arm", "d_model", "non-emb params", "val loss", "95% CI", "seeds"], rows))
    for m in lad["matches"]:
        need = m["candidate_params_needed"]
        b.append(("p", f"{m['candidate']} needs {need:,.0f} non-embedding parameters to reach "
                  f"{m['baseline']}'s loss {m['baseline_loss']:.4f} at {m['baseline_params']:,}: a ratio of "
                  f"{m['ratio']:.0%} (paper: about 62%)"
                  + (" (extrapolated beyond the ladder)" if m["extrapolated"] else "") + "."
                  if need is not None else
                  f"{m['candidate']}'s fit does not decrease with size: no parameter ratio."))
    b.append(("img", pngs["ladder"], "Validation loss vs non-embedding parameters, with fits"))
    return b


def _how_blocks(results: dict) -> list[tuple]:
    """How the study was run: machine, jobs, timings, cells and the command."""
    b: list[tuple] = []
    plan = results["plan"]
    b.append(("h", 2, "How it was run"))
    tim = plan.get("timing_probe") or {}
    wall = results.get("wall") or {}
    est = plan.get("estimate_s")
    b.append(("p", f"Machine: {plan.get('machine', '?')}. {plan.get('jobs', 1)} job(s) × "
              f"{plan.get('threads_per_job', '?')} thread(s). Planned wall time "
              + (f"{est / 60:.1f} min" if est is not None else "not estimated (no timing probe)")
              + (f" for a budget of {plan['budget_minutes']:g} min" if plan.get("budget_minutes") else "")
              + f"; measured {wall.get('seconds', 0) / 60:.1f} min from the first cell start to the last "
              f"finish (load average at planning {_load(plan.get('load_average'))}). Validation loss is the mean over "
              f"the whole validation split ({results['data']['val_tokens']:,} tokens, non-overlapping windows); "
              f"bits/char = nats/token ÷ {results['data']['chars_per_token']:.4f} chars/token ÷ ln 2. Timing "
              "probe (s/step, jobs running at once): "
              + (", ".join(f"{k} {v['step']:.3f}" for k, v in tim.items()) or "none") + "."))
    b.append(("p", cells_sentence(results)))
    b.append(("pre", printable(plan.get("command", ""))))  # one line: no name can end the code block
    return b


def cells_sentence(results: dict) -> str:
    """The cells finished, by kind, and the Optuna trials behind them, so that the two counts add up."""
    cells = results["cells"]
    base = cells.get("base", cells["grid"])  # results.json of an older version: the grid as a whole
    parts = [f"{base} in the base grid (arms × LRs × seeds)"]
    if cells["grid"] > base:
        parts.append(f"{cells['grid'] - base} LR-extension cells")
    if cells.get("ladder"):
        parts.append(f"{cells['ladder']} size-ladder cells")
    study = results.get("study") or {}
    if "error" in study or not study:
        trials = f"the Optuna trial counts could not be read ({study.get('error', 'no study found')})"
    else:
        trials = "; ".join(f"`{name}` {', '.join(f'{k} {n}' for k, n in sorted(c.items()))}"
                           for name, c in study.items())
        trials = (f"each cell is one trial of the study's Optuna grids (the base grid, one per LR-extension round, "
                  f"the ladder): {trials}. A COMPLETE trial is a cell trained to the end (one trained again because "
                  "its folder was deleted counts twice); a PRUNED one was stopped by a signal or found running "
                  "elsewhere, a FAIL one crashed or lost its worker, and its cell was queued again")
    return (f"Cells finished: {cells['finished']} of {cells.get('total', cells['grid'])}: {', '.join(parts)}; "
            f"{trials}.")


def blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The whole report as blocks (:func:`diffattn.experiments.document.to_markdown`), the verdict first."""
    b: list[tuple] = [("h", 1, f"Does DIFF help on {document.name(Path(results['spec']['data']).name)}?")]
    b += banners(results)
    b.append(("p", verdict_text(results)))
    b += _verdict_blocks(results, pngs) + _comparison_blocks(results) + _arm_blocks(results)
    b += _sweep_blocks(results, pngs) + early_blocks(results) + _ladder_blocks(results, pngs) + _how_blocks(results)
    return b


def write_report(results: dict, out: Path) -> None:
    atomic_write(out / "results.json", json.dumps(results, indent=1, default=float) + "\n")
    if not results["arms"]:
        b = [("h", 1, "No finished cells yet"), *banners(results)]
        atomic_write(out / "report.html", document.to_html(b, out, "diffattn compare"))
        atomic_write(out / "report.md", document.to_markdown(b))
        return
    pngs = {"lr": plot_lr_sweep(results, out / "lr_sweep.png").name,
            "curves": plot_curves(results, out / "loss_vs_tokens.png").name}
    if results.get("ladder"):
        pngs["ladder"] = plot_ladder(results, out / "size_ladder.png").name
    b = blocks(results, pngs)
    atomic_write(out / "report.html", document.to_html(b, out, "diffattn study"))
    atomic_write(out / "report.md", document.to_markdown(b))
