"""Plain-text tables for ``diffattn eval`` (the results dict of :func:`diffattn.eval.suite.evaluate_model`).

``format_results(res, ...)`` turns each section into an aligned table and adds one line saying why the
sections count different numbers of tokens; ``format_classification(res, ...)`` does the same for a
classifier's accuracy and macro-F1; ``diffattn eval --json`` prints the dict itself instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def count(n: int, word: str) -> str:
    """``1 layer``, ``2 layers``: a number and its noun, for the lines commands print."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ", *, left: int = 1) -> list[str]:
    """Aligned text rows: the first ``left`` columns left-aligned, the others right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[j])) for r in rows)) for j, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).ljust(w) if j < left else str(c).rjust(w) for j, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) >= 1e4:
        return f"{x:.3g}"
    return f"{x:.{nd}f}"


def counts_note(res: dict[str, Any], *, synthetic: bool, ppl_batches: int, batch_size: int) -> str:
    """One line saying what each section counts, so that its different totals do not look like an error."""
    parts = []
    if "ppl" in res:
        what = ("only the answer tokens (a synthetic task puts its loss on answers)" if synthetic
                else "every predicted token (each position of a window predicts the next one)")
        parts.append(f"ppl averages over {what} of {ppl_batches} random val batches of {batch_size}:"
                     f" {res['ppl']['tokens']:,} tokens")
    if "needle" in res:
        n = res["needle"]
        parts.append(f"needle accuracy counts one answer token per query on a fixed grid ({n['queries']:,}), and"
                     f" the multi-needle table R per sequence ({sum(n['multi_queries'].values()):,})")
    if "noise" in res:
        parts.append(f"noise reads one attention row per sequence ({res['noise']['sequences']:,})")
    if "outliers" in res:
        parts.append(f"outliers pool every causally visible logit and every hidden value of"
                     f" {res['outliers']['sequences']} sequences")
    if "quant" in res:
        tok = next((r.get("ppl_tokens") for r in res["quant"] if r.get("ppl_tokens")), None)
        q = []
        if any("needle_acc" in r for r in res["quant"]):
            q.append("quant repeats the needle sequences")
        if tok:
            q.append(f"quant's ppl uses half the batches ({max(1, ppl_batches // 2)}: {tok:,} tokens)")
        parts += q
    return "why the counts differ: " + "; ".join(parts) + "." if parts else ""


def run_sample_line(sample: dict[str, Any], seq_len: int | None) -> str:
    """How the loss above relates to the validation loss the run recorded (``windows.run_sample``)."""
    theirs = (f"the run's validation loss at step {sample['step']} was {sample['val_loss']:.4f}, on its training "
              f"evaluations' sample ({sample['batches']} batches of {sample['batch_size']} windows of "
              f"{sample['seq_len']} tokens, a fixed seed)")
    if sample.get("same"):
        later = sample.get("checkpoint_step") not in (None, sample["step"])
        tail = (f"; this checkpoint is from step {sample['checkpoint_step']}, so its weights are later than that "
                "evaluation's") if later else ""
        return f"  this is that sample: {theirs}{tail}"
    return (f"  {theirs}; this reads another sample (windows of {seq_len} tokens, --batches/--batch-size/--seq-len "
            "as given), so the two differ by sampling; leave those unset to read the run's own")


def format_results(res: dict[str, Any], *, title: str = "", synthetic: bool = False, ppl_batches: int = 8,
                   batch_size: int = 16) -> str:
    """All sections of an evaluation result as text tables."""
    out: list[str] = [title] if title else []
    note = counts_note(res, synthetic=synthetic, ppl_batches=ppl_batches, batch_size=batch_size)
    if note:
        out.append(note)
    if "ppl" in res:
        p = res["ppl"]
        out += ["", "perplexity (validation split)"]
        out += table(["loss (nats)", "ppl", "bits/token", "tokens"],
                     [[_f(p["loss"], 4), _f(p["ppl"]), _f(p["bits_per_token"]), f"{p['tokens']:,}"]])
        if p.get("run_sample"):
            out.append(run_sample_line(p["run_sample"], p.get("seq_len")))
    if "needle" in res:
        n = res["needle"]
        depths = sorted({g["depth"] for g in n["grid"]})
        lengths = sorted({g["length"] for g in n["grid"]})
        acc = {(g["depth"], g["length"]): g["acc"] for g in n["grid"]}
        per = sorted({g["queries"] for g in n["grid"]})
        out += ["", f"needle: 1-needle accuracy by depth and length ({'/'.join(map(str, per))} queries per cell,"
                f" {n['queries']:,} in all; mean {_f(n['mean'])})"]
        out += table(["depth \\ length", *map(str, lengths)],
                     [[f"{d:.2f}", *(_f(acc.get((d, L)), 2) for L in lengths)] for d in depths])
        if n["multi"]:
            out += ["", "multi-needle: N needles in the context, R of them queried"]
            out += table(["N,R", "accuracy", "queries"],
                         [[k, _f(v, 3), f"{n['multi_queries'].get(k, 0):,}"] for k, v in n["multi"].items()])
    if "noise" in res:
        z = res["noise"]
        keys = [("answer_signed", "answer"), ("noise_signed", "noise"), ("query_signed", "query"),
                ("answer_pos_share", "answer+"), ("noise_pos_share", "noise+"), ("neg_mass", "neg mass")]
        per = z["per_layer_head"]
        rows = [[f"layer {i}", *(_f(sum(per[k][i]) / len(per[k][i])) for k, _ in keys)]
                for i in range(len(per["answer_signed"]))]
        rows.append(["all layers", *(_f(z["mean"][k]) for k, _ in keys)])
        out += ["", "noise: attention at the answering query, by region (signed sums; '+': share of the"
                " positive mass)"]
        out += table(["", *(h for _, h in keys)], rows)
    if "outliers" in res:
        o = res["outliers"]
        stats = [k for k in o["attn_logits"] if k != "median"] + ["median"]
        out += ["", f"outliers: |x| over {o['sequences']} sequences (top-k = k-th largest)"]
        out += table(["", *stats], [["attention logits", *(_f(o["attn_logits"].get(s), 2) for s in stats)],
                                    ["hidden states", *(_f(o["hidden"].get(s), 2) for s in stats)]])
        out += table(["top-1 per layer", *(str(i) for i in range(len(o["hidden_top1_per_layer"])))],
                     [["attention logits", *(_f(x, 2) for x in o["attn_logits_top1_per_layer"])],
                      ["hidden states", *(_f(x, 2) for x in o["hidden_top1_per_layer"])]])
    if "quant" in res:
        rows = res["quant"]
        cols = [(k, h) for k, h in (("needle_acc", "needle acc"), ("multi_acc", "multi acc"), ("ppl_ppl", "ppl"))
                if any(k in r for r in rows)]
        setting = res.get("quant_multi_setting")
        extra = (f"; multi: {setting['n_needles']} needles, {setting['n_queries']} queried, length"
                 f" {setting['length']}" if setting else "")
        out += ["", f"quant: attention logits fake-quantized to b bits (absmax per head){extra}"]
        out += table(["bits", *(h for _, h in cols)],
                     [["fp32" if r["bits"] is None else str(r["bits"]), *(_f(r.get(k)) for k, _ in cols)]
                      for r in rows])
    return "\n".join(out)


def format_classification(res: dict[str, Any], *, title: str = "") -> str:
    """A classifier's evaluation (``res["classify"]``: labels and per-split rows, accuracy, macro-F1) as text."""
    c = res["classify"]
    out: list[str] = [title] if title else []
    out += ["", f"classification: accuracy and macro-F1 (mean of the per-class F1 over the classes that occur;"
                f" labels {', '.join(map(str, c['labels']))})"]
    out += table(["split", "rows", "accuracy", "macro-F1"],
                 [[name, f"{s['rows']:,}", _f(s["accuracy"], 4), _f(s["macro_f1"], 4)]
                  for name, s in c["splits"].items()])
    return "\n".join(out)
