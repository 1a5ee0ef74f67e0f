"""The study's verdict in words: the paragraph that opens the report, what it says beyond the final number (LR
bracketing, the gap's trend, the token ratio, the parameter difference), the banners before any number, the cell
and trial counts, and the number formats the report's tables share."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from diffattn.experiments import document
from diffattn.experiments.findings import analysis
from diffattn.experiments.findings.depth import barely_note, depth_sentence


def num(x: Any, nd: int = 4) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def ci_text(ci: list, nd: int = 4, sign: str = "") -> str:
    """"[lo, hi]" (``sign="+"``: signed), or "–" without an interval."""
    return "–" if not ci or ci[0] is None else f"[{ci[0]:{sign}.{nd}f}, {ci[1]:{sign}.{nd}f}]"


def signed_ci_text(ci: list, nd: int = 4) -> str:
    return ci_text(ci, nd, "+")


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
        f"{len(c.get('lrs') or spec['lrs'])} and {len(b.get('lrs') or spec['lrs'])} learning rates "
        f"({c['best_lr']:g} and {b['best_lr']:g}; {_bracket_words(c, b)}), {n} paired seeds"
        + (f", Q/K head width {spec['head_dim']}" if spec.get("head_dim") else "") + ". Validation loss "
        f"{num(c['val_loss_mean'])} {ci_text(c['val_loss_ci95'])} vs {num(b['val_loss_mean'])} "
        f"{ci_text(b['val_loss_ci95'])} nats/token ({num(c['bpc_mean'], 3)} vs {num(b['bpc_mean'], 3)} bits/char). "
        f"Paired per-seed difference DIFF − baseline: {v['diff_minus_baseline']:+.4f} nats/token, 95% CI "
        f"{signed_ci_text(v['ci95'])} (Student t, {n - 1} df): {v['conclusion']}."
    )


def _bracket_words(*arms: dict) -> str:
    if all(a.get("bracketed") for a in arms):
        return "both bracketed: a lower and a higher LR were worse"
    return "**" + ", ".join(f"{a['label']} {'bracketed' if a.get('bracketed') else 'NOT bracketed'}"
                            for a in arms) + "**"


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


def banners(results: dict) -> list[tuple]:
    """What the reader must know before any number: an unfinished study, a smoke run."""
    b: list[tuple] = []
    inc, command = results.get("incomplete"), (results.get("plan") or {}).get("command")
    if inc:
        b.append(("p", f"**incomplete: {inc['finished']} of {inc['total']} cells — no "
                  f"{inc['withheld']}.** The numbers below come from the finished cells only. Re-run the same "
                  f"command to resume: {document.code(command or 'diffattn study ... --out ...')}"))
    if (results.get("plan") or {}).get("quick"):
        b.append(("p", "**Smoke run (--quick): tiny models trained for a few steps. It checks that the pipeline "
                  "runs; its numbers are not evidence for or against DIFF.**"))
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
        trials = (f"each run of a cell is one trial of the study's Optuna log (the base grid, one per LR-extension "
                  f"round, the ladder): {trials}. A COMPLETE trial is a cell trained to the end (one trained again "
                  "because its folder was deleted counts twice); a PRUNED one was stopped by a signal, a FAIL one "
                  "crashed or lost its worker, and another run took its cell over")
    return (f"Cells finished: {cells['finished']} of {cells.get('total', cells['grid'])}: {', '.join(parts)}; "
            f"{trials}.")


def verdict_lines(results: dict, smoke: bool = False) -> list[str]:
    """The command's closing lines on a complete study: each retrofit verdict, the verdict, a barely-trained note,
    each unbracketed arm and the token ratio (``smoke``: a --quick run, said on each verdict)."""
    v = results.get("verdict") or {}
    ci, diff = v.get("ci95") or [None, None], v.get("diff_minus_baseline")
    tag = " (--quick smoke run: not evidence)" if smoke else ""
    lines = []
    for r in (results.get("retrofit") or {}).get("verdicts") or []:
        lo, hi = r["ci95"]
        ci_part = f", 95% CI [{lo:+.4f}, {hi:+.4f}]" if lo is not None and hi is not None else ""
        delta = f"{r['delta']:+.4f} nats/token" if r["delta"] is not None else "no difference (a diverged cell)"
        lines.append(f"retrofit verdict: {r['arm']} − SRC continued = {delta}{ci_part}: {r['word']}{tag}")
    if diff is not None and None not in ci:
        lines.append(f"verdict: DIFF − baseline = {diff:+.4f} nats/token, 95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}]: "
                     f"{v['conclusion']}{tag}")
    elif v.get("conclusion"):  # e.g. one seed: no interval can be computed
        lines.append(f"verdict: {v['conclusion']}{tag}")
    if (results.get("depth") or {}).get("barely"):
        lines.append(barely_note(results["depth"]))
    lines += [f"note: {note}" for note in v.get("unbracketed") or []]
    if v.get("token_ratio"):
        lines.append(f"token ratio: {analysis.token_ratio_text(v['token_ratio'])} "
                     f"(paper: ~{analysis.PAPER_TOKEN_RATIO:.0%})")
    return lines
