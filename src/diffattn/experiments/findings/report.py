"""Render a collected ``diffattn study`` experiment (:func:`diffattn.experiments.study.collect.collect`): results.json,
report.md and a self-contained report.html (the same blocks; PNGs embedded), section by section, the verdict first
(its words: :mod:`.report_text`; its figures: :mod:`.figures`; the retrofit section of a ``--from`` study)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from diffattn.experiments import document
from diffattn.experiments.findings import analysis, early, stats
from diffattn.experiments.findings.figures import plot_curves, plot_ladder, plot_lr_sweep
from diffattn.experiments.findings.report_text import (
    banners,
    cells_sentence,
    ci_text,
    dynamics_blocks,
    num,
    signed_ci_text,
    verdict_text,
)
from diffattn.system.atomic_files import atomic_write, printable


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
        b.append(("p", f"At the end: {last['mean']:+.4f} nats/token, 95% CI {signed_ci_text(last['ci95'])} "
                  f"({stats.verdict(*[x if x is not None else math.nan for x in last['ci95']])} for "
                  f"{pair['candidate']} against {pair['other']})."))
        b.append(("table", ["step", "Δ nats/token", "95% CI"],
                  [[r["step"], f"{r['mean']:+.4f}", signed_ci_text(r["ci95"])] for r in pair["gap"]]))
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
    v = results.get("verdict")
    if not v:
        return []
    return dynamics_blocks(v) + ([
        ("h", 3, f"The gap over training ({v['candidate']} − {v['baseline']}, paired over seeds, the same validation "
         "batches at every point)"),
        ("table", ["step", "tokens", "Δ nats/token", "95% CI"],
         [[f"{p['step']:,}", f"{p['tokens']:,}", num(p["diff_minus_baseline"]), signed_ci_text(p["ci95"])]
          for p in v["trajectory"]]),
        ("p", f"The gap with its 95% band is plotted under the loss curves ({pngs['curves']}).")]
        if v.get("trajectory") else [])


def _comparison_blocks(results: dict) -> list[tuple]:
    """Every comparison, when there are several."""
    comps = results["comparisons"]
    if len(comps) < 2:
        return []
    return [("h", 3, "Every comparison (candidate − its baseline, paired over seeds)"),
            ("table", ["candidate", "baseline", "params Δ", "LRs", "Δ nats/token", "95% CI", "Δ bits/char",
                       "token ratio", "verdict"],
             [[c["candidate"], c["baseline"], f"{c['param_difference']:+.1%}" if "param_difference" in c else "–",
               f"{c['candidate_lr']:g} / {c['baseline_lr']:g}", num(c["diff_minus_baseline"]),
               signed_ci_text(c["ci95"]), num(c["bpc_diff_minus_baseline"]),
               analysis.token_ratio_text(c["token_ratio"]) if c.get("token_ratio") else "–", c["conclusion"]]
              for c in comps])]


def _arm_blocks(results: dict) -> list[tuple]:
    """Each arm at its best learning rate, and the paired differences per seed."""
    v = results.get("verdict")
    b: list[tuple] = [
        ("h", 2, "Results at each arm's best learning rate"),
        ("table", ["arm", "attention", "heads", "params", "non-emb params", "best LR", "val loss (nats/token)",
                   "95% CI", "bits/char", "95% CI"] + [f"seed {s}" for s in results["spec"]["seeds"]],
         [[a["label"], a["attention"], a["n_heads"], f"{a['params']:,}", f"{a['non_embedding_params']:,}",
           f"{a['best_lr']:g}", num(a["val_loss_mean"]), ci_text(a["val_loss_ci95"]), num(a["bpc_mean"]),
           ci_text(a["bpc_ci95"])] + [num(s["val_loss"]) for s in a["seeds"]] for a in results["arms"]])]
    return b + ([("table", ["seed", f"{v['candidate']} − {v['baseline']} (nats/token)"],
                  [[s, num(d)] for s, d in zip(v["seeds"], v["differences"])])] if v else [])


def _sweep_blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The learning-rate sweep, its bracketing, and the sweep and curve plots."""
    lrs = sorted({p["lr"] for a in results["arms"] for p in a["lr_sweep"]})
    rows = []
    for a in results["arms"]:
        by = {p["lr"]: p for p in a["lr_sweep"]}
        rows.append([a["label"]] + [
            (num(by[lr]["val_loss"]) + (" (diverged)" if any(s["diverged"] for s in by[lr]["seeds"]) else "")
             + (" *" if lr == a["best_lr"] else "")) if lr in by else "–" for lr in lrs])
    k = results["spec"].get("lr_extensions", 0)  # a results.json from before bracketing: none
    b: list[tuple] = [("h", 3, "Learning-rate sweep (mean validation loss over seeds; each arm tuned on its own)"),
                      ("table", ["arm"] + [f"lr {x:g}" for x in lrs], rows)]
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
    lad = results.get("ladder")
    if not lad:
        return []
    b: list[tuple] = [("h", 2, "Size ladder")]
    b.append(("p", "Each arm is trained at d_model " + ", ".join(map(str, lad["sizes"])) + " with its best "
              "LR from the grid, all seeds, the same steps. Fit per arm: L = α − β·ln N over non-embedding "
              "parameters N. With three sizes a three-parameter power law a·N^−b + c would pass through every "
              "point exactly and its offset c is ill-determined over this range, so the two-parameter "
              "log-linear form is used; read the parameter ratio as local, not as an extrapolation."))
    b.append(("table", ["arm", "d_model", "non-emb params", "val loss", "95% CI", "seeds"],
              [[name, p["d_model"], f"{p['non_embedding_params']:,}", num(p["val_loss_mean"]),
                ci_text(p["val_loss_ci95"]), p["seeds"]] for name, arm in lad["arms"].items() for p in arm["points"]]))
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
    plan, wall, est = results["plan"], results.get("wall") or {}, results["plan"].get("estimate_s")
    tim = plan.get("timing_probe") or {}
    return [("h", 2, "How it was run"),
            ("p", f"Machine: {plan.get('machine', '?')}. {plan.get('jobs', 1)} job(s) × "
             f"{plan.get('threads_per_job', '?')} thread(s). Planned wall time "
             + (f"{est / 60:.1f} min" if est is not None else "not estimated (no timing probe)")
             + (f" for a budget of {plan['budget_minutes']:g} min" if plan.get("budget_minutes") else "")
             + f"; measured {wall.get('seconds', 0) / 60:.1f} min from the first cell start to the last "
             f"finish (load average at planning {_load(plan.get('load_average'))}). Validation loss is the mean over "
             f"the whole validation split ({results['data']['val_tokens']:,} tokens, non-overlapping windows); "
             f"bits/char = nats/token ÷ {results['data']['chars_per_token']:.4f} chars/token ÷ ln 2. Timing "
             "probe (s/step, jobs running at once): "
             + (", ".join(f"{k} {v['step']:.3f}" for k, v in tim.items()) or "none") + "."),
            ("p", cells_sentence(results)),
            ("pre", printable(plan.get("command", "")))]  # one line: no name can end the code block


def retrofit_blocks(results: dict[str, Any]) -> list[tuple]:
    """The report's blocks for the retrofit section (empty for a study without --from)."""
    r = results.get("retrofit")
    if not r:
        return []
    b: list[tuple] = [("h", 2, "The retrofit verdict")]
    n = r.get("retrofit_steps")
    how = ("no retrofit schedule: the conversion's λ / σ move only as training moves them" if n is None else
           f"annealed from the exact conversion into a real model of its type over {n} steps, the retrofit "
           "schedule of `train --retrofit.steps`")
    b.append(("p", f"Every arm started from {r['source']}: `standard` is the source continued on the same tokens "
              f"with the same seeds; every other arm is the source converted exactly to its type, then fine-tuned "
              f"({how}). Each arm at its own best learning rate."))
    s0 = r["step0"]
    b.append(("p", f"Step 0: each arm's initial model on one validation batch ({s0['tokens']:,} tokens), against "
              f"the source's loss {s0['source']:.6f} nats/token (the conversions are exact: equal to float "
              "rounding)."))
    b.append(("table", ["arm", "step-0 loss", "|Δ| vs source"],
              [[x["arm"], f"{x['loss']:.6f}", f"{x['abs_diff']:.2e}"] for x in s0["arms"]]))
    if r["verdicts"]:
        b.append(("table", ["retrofitted arm", "Δ held-out loss vs SRC continued (nats/token)", "95% CI",
                            "after retrofitting"],
                  [[v["arm"], num(v["delta"]), f"[{num(v['ci95'][0])}, {num(v['ci95'][1])}]", v["word"]]
                   for v in r["verdicts"]]))
    m = r.get("measures")
    if m:
        b.append(("h", 3, "Where the papers say DIFF helps"))
        rows = m["rows"]
        b.append(("p", f"On each model: activation outliers on {rows[0]['sequences']} validation sequences of "
                  f"{rows[0]['seq_len']} tokens (|attention logits| — both maps for DIFF — and |block outputs|), and "
                  f"the validation loss with the attention logits absmax-quantized to {', '.join(map(str, m['bits']))} "
                  f"bits on {rows[0]['ppl_tokens']} tokens (the rise over the unquantized loss, ± its standard "
                  "error over tokens). Small samples: read the differences against that error."))
        b.append(("table", ["model", "seed", "logits top-1", "logits top-10", "logits median", "hidden top-1",
                            "hidden median", "loss fp32"] + [f"rise {q['bits']}-bit" for q in rows[0]["quant"]],
                  [[x["model"], "–" if x["seed"] is None else x["seed"], num(x["attn_logits"].get("top1"), 2),
                    num(x["attn_logits"].get("top10"), 2), num(x["attn_logits"].get("median"), 3),
                    num(x["hidden"].get("top1"), 2), num(x["hidden"].get("median"), 3), num(x["loss_fp32"])]
                   + [f"{num(q['rise'])} ± {num(q['rise_se'])}" for q in x["quant"]] for x in rows]))
        b.append(("p", "Not measured: " + m["not_measured"] + "."))
    return b


def blocks(results: dict, pngs: dict[str, str]) -> list[tuple]:
    """The whole report as blocks (:func:`diffattn.experiments.document.to_markdown`), the verdict first."""
    data, src = document.name(Path(results['spec']['data']).name), results["spec"].get("from")
    b: list[tuple] = [("h", 1, f"Does retrofitting {document.name(Path(src).name)} help on {data}?" if src else
                       f"Does DIFF help on {data}?")]
    b += banners(results)
    b.append(("p", verdict_text(results)))
    b += retrofit_blocks(results) + _verdict_blocks(results, pngs) + _comparison_blocks(results) + _arm_blocks(results)
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
