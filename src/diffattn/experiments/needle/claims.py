"""The paper's claims checked against a ``diffattn compare`` run: each claim, the two measured numbers with
their standard errors, and a verdict computed from them (never written by hand).

A claim is **reproduced** when DIFF is better than the baseline in the paper's direction by more than
``Z`` standard errors of the difference, and **not reproduced** otherwise: either the opposite holds by
more than ``Z`` standard errors, or the difference is within the noise. The standard error of a difference
is ``√(se_DIFF² + se_baseline²)``; both models are scored on the same examples, so their errors are
positively correlated and this is on the conservative side (a paired test would call more differences).

Sources of the standard errors (all in ``results.json``): accuracies, binomial ``√(p(1−p)/n)`` over the
``n`` answers; answer loss, the spread of the per-token losses; attention shares, the spread over the
evaluation sequences; outlier statistics, the spread over evaluation batches; a model's change under
quantization, the spread of its per-answer (per-token) changes on the same examples (a paired error).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

Z = 2.0  # standard errors a difference must exceed to count

# The paper's figures each claim is checked against (Ye et al. 2024; see PAPERS.md).
PAPER_MULTI = {"1,1": (1.00, 1.00), "2,2": (0.92, 0.85), "4,2": (0.84, 0.62), "6,2": (0.85, 0.35)}


@dataclass
class Claim:
    """One paper claim: DIFF's and the baseline's measured value and standard error, and the verdict."""

    claim: str  # what the paper says, in words
    paper: str  # the paper's numbers (DIFF vs Transformer)
    measure: str  # what was measured here
    want: str  # "higher" or "lower": the direction the paper claims for DIFF
    diff: float
    diff_se: float
    base: float
    base_se: float
    nd: int = 3  # decimals to print

    @property
    def delta(self) -> float:
        return self.diff - self.base

    @property
    def delta_se(self) -> float:
        return math.hypot(self.diff_se, self.base_se)

    @property
    def verdict(self) -> str:
        """"reproduced", "not reproduced (opposite)" or "not reproduced (within noise)"."""
        gain = self.delta if self.want == "higher" else -self.delta
        if gain > Z * self.delta_se:
            return "reproduced"
        if -gain > Z * self.delta_se:
            return "not reproduced (opposite)"
        return "not reproduced (within noise)"

    @property
    def reproduced(self) -> bool:
        return self.verdict == "reproduced"

    def fmt(self, x: float, se: float) -> str:
        return f"{x:.{self.nd}f} ± {se:.{self.nd}f}"

    def to_dict(self) -> dict:
        return {**asdict(self), "delta": self.delta, "delta_se": self.delta_se, "verdict": self.verdict}


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` measured on ``n`` answers."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else float("nan")


def grid_se(grid: Sequence[dict]) -> float:
    """Standard error of the mean accuracy over the cells of a needle grid (each cell its own binomial)."""
    if not grid or any("queries" not in g for g in grid):
        return float("nan")
    return math.sqrt(sum(binomial_se(g["acc"], g["queries"]) ** 2 for g in grid)) / len(grid)


def pair(results: dict) -> tuple[dict, dict] | None:
    """DIFF (attention "diff") and its matched baseline ("standard") from ``results["models"]``."""
    by = {m["attention"]: m for m in results.get("models", [])}
    if "diff" not in by or "standard" not in by:
        return None
    return by["diff"], by["standard"]


def _quant_rows(m: dict) -> tuple[dict, dict] | None:
    """The unquantized row and the lowest-bit row of a model's quantization sweep."""
    rows = m.get("quant") or []
    ref = [r for r in rows if r["bits"] is None]
    low = [r for r in rows if r["bits"] is not None]
    if not ref or not low:
        return None
    return ref[0], min(low, key=lambda r: r["bits"])


def _acc_drop(rows: tuple[dict, dict], key: str, n_key: str) -> tuple[float, float]:
    """Accuracy lost from the unquantized row to the low-bit row, and its standard error: the paired one
    (same examples in both rows) when the sweep recorded it, else the two binomial errors combined."""
    ref, low = rows
    paired = key.replace("_acc", "_drop")
    if paired in low and f"{paired}_se" in low:
        return low[paired], low[f"{paired}_se"]
    return ref[key] - low[key], math.hypot(binomial_se(ref[key], ref[n_key]), binomial_se(low[key], low[n_key]))


def _loss_rise(rows: tuple[dict, dict]) -> tuple[float, float]:
    """Answer loss gained from the unquantized row to the low-bit row, and its standard error (paired over
    the same tokens when recorded)."""
    ref, low = rows
    if "ppl_rise" in low and "ppl_rise_se" in low:
        return low["ppl_rise"], low["ppl_rise_se"]
    return low["ppl_loss"] - ref["ppl_loss"], math.hypot(ref["ppl_loss_se"], low["ppl_loss_se"])


def _loss_claims(d: dict, b: dict, results: dict) -> list[Claim]:
    """Answer-token loss (paper Table 6)."""
    if not ("ppl" in d and "loss_se" in d["ppl"]):
        return []
    return [
        Claim(
            "lower loss than a Transformer of the same size",
            "Table 6 (1.4B): 3.062 vs 3.087 val loss",
            "cross-entropy on answer tokens (nats)",
            "lower",
            d["ppl"]["loss"],
            d["ppl"]["loss_se"],
            b["ppl"]["loss"],
            b["ppl"]["loss_se"],
        )
    ]


def _retrieval_claims(d: dict, b: dict, results: dict) -> list[Claim]:
    """Needle retrieval (paper Table 2): the depth × length grid, each multi-needle entry with N >= 2, and
    whether the advantage grows with N."""
    nd, nb = d.get("needle"), b.get("needle")
    if not (nd and nb):
        return []
    k = nd.get("n_needles", 1)
    out = [
        Claim(
            "retrieves a needle among distractors better" if k > 1 else "retrieves a single needle as well",
            "Table 2: ≥ Transformer at every N (1.00 vs 1.00 at N=1)",
            f"accuracy over the depth × length grid, {k} needle{'s' if k > 1 else ''} in context, 1 queried",
            "higher",
            nd["mean"],
            grid_se(nd["grid"]),
            nb["mean"],
            grid_se(nb["grid"]),
            nd=2,
        )
    ]
    counts_d, counts_b = nd.get("multi_queries", {}), nb.get("multi_queries", {})
    keys = [k for k in nd.get("multi", {}) if k in nb.get("multi", {}) and k in counts_d and k in counts_b]
    multi = [k for k in keys if int(k.split(",")[0]) >= 2]
    for k in multi:
        pd_, pb = PAPER_MULTI.get(k, (None, None))
        out.append(
            Claim(
                f"better multi-needle retrieval, N,R = {k}",
                f"Table 2 (4K): {pd_:.2f} vs {pb:.2f}" if pd_ is not None else "Table 2: DIFF higher",
                f"accuracy, N,R = {k} at L={results.get('task', {}).get('seq_len', '?')}",
                "higher",
                nd["multi"][k],
                binomial_se(nd["multi"][k], counts_d[k]),
                nb["multi"][k],
                binomial_se(nb["multi"][k], counts_b[k]),
                nd=2,
            )
        )
    if len(multi) >= 2:
        lo, hi = multi[0], multi[-1]

        def gap_se(m: dict, counts: dict) -> float:
            return math.hypot(binomial_se(m["multi"][lo], counts[lo]), binomial_se(m["multi"][hi], counts[hi]))

        # Claim: the advantage grows with N. "DIFF" side = its drop from N_lo to N_hi (lower is better).
        out.append(
            Claim(
                "the advantage grows with N",
                "Table 2: drop 0.92→0.85 (0.07) vs 0.85→0.35 (0.50)",
                f"accuracy lost from N,R = {lo} to {hi}",
                "lower",
                nd["multi"][lo] - nd["multi"][hi],
                gap_se(nd, counts_d),
                nb["multi"][lo] - nb["multi"][hi],
                gap_se(nb, counts_b),
                nd=2,
            )
        )
    return out


def _noise_claims(d: dict, b: dict, results: dict) -> list[Claim]:
    """Attention on the answer span and on the noise context (paper Table 3), over all layers and the last."""
    sd, sb = d.get("noise"), b.get("noise")
    if not (sd and sb and "mean_se" in sd and "mean_se" in sb):
        return []
    out = []
    for region, want, paper in (
        ("answer", "higher", "Table 3: 0.27–0.40 vs 0.03–0.09"),
        ("noise", "lower", "Table 3: 0.01–0.02 vs 0.49–0.54"),
    ):
        for where, name in (("mean", "all layers and heads"), ("last_layer", "last layer")):
            key = f"{region}_pos_share"
            out.append(
                Claim(
                    f"{'more' if want == 'higher' else 'less'} attention on the "
                    f"{'answer span' if region == 'answer' else 'noise context'}",
                    paper,
                    f"share of the positive attention at the query, {name}",
                    want,
                    sd[where][key],
                    sd[f"{where}_se"][key],
                    sb[where][key],
                    sb[f"{where}_se"][key],
                )
            )
    return out


def _outlier_claims(d: dict, b: dict, results: dict) -> list[Claim]:
    """Activation outliers (paper Table 5): attention logits and hidden states."""
    od, ob = (d.get("outliers") or {}).get("spread"), (b.get("outliers") or {}).get("spread")
    if not (od and ob):
        return []
    return [
        Claim(
            what,
            paper,
            f"largest |value| per batch, mean over {od[key]['n']} batches",
            "lower",
            od[key]["mean"],
            od[key]["se"],
            ob[key]["mean"],
            ob[key]["se"],
            nd=2,
        )
        for key, what, paper in (
            ("attn_logits_top1", "smaller attention-logit outliers", "Table 5: top-1 38.8 vs 318.0"),
            ("hidden_top1", "smaller hidden-state outliers", "Table 5: top-1 1688 vs 3609"),
        )
    ]


def _quantization_claims(d: dict, b: dict, results: dict) -> list[Claim]:
    """Robustness to low-bit attention logits (paper Fig. 8): the accuracy drop, and the answer-loss rise."""
    qd, qb = _quant_rows(d), _quant_rows(b)
    if not (qd and qb):
        return []
    out = []
    bits = qd[1]["bits"]
    sets = (("multi_acc", "multi_queries", "multi-needle"), ("needle_acc", "needle_queries", "grid"))
    for key, n_key, what in sets:
        if not all(key in r and n_key in r for r in (*qd, *qb)):
            continue
        (dd, dse), (bd, bse) = _acc_drop(qd, key, n_key), _acc_drop(qb, key, n_key)
        out.append(
            Claim(
                f"loses less accuracy with {bits}-bit attention logits",
                "Fig. 8: 4-bit DIFF ≈ 6-bit Transformer, ~25 points above 4-bit Transformer",
                f"accuracy drop fp32 → {bits}-bit ({what} set)",
                "lower",
                dd,
                dse,
                bd,
                bse,
                nd=2,
            )
        )
        break  # one accuracy set: the multi-needle one when there is one (the grid may saturate)
    if all("ppl_loss_se" in r for r in (*qd, *qb)):
        (dr, dse), (br, bse) = _loss_rise(qd), _loss_rise(qb)
        out.append(
            Claim(
                f"answer loss rises less with {bits}-bit attention logits",
                "Fig. 8: DIFF more robust to low-bit logits",
                f"answer loss at {bits}-bit minus fp32 (nats)",
                "lower",
                dr,
                dse,
                br,
                bse,
            )
        )
    return out


# The claim families, in the order the summary lists them: each takes (DIFF's model, the baseline's, results).
CLAIM_FAMILIES = (_loss_claims, _retrieval_claims, _noise_claims, _outlier_claims, _quantization_claims)


def check_claims(results: dict) -> list[Claim]:
    """Every paper claim the results hold the numbers for (claims whose numbers are missing are skipped)."""
    p = pair(results)
    if p is None:
        return []
    d, b = p
    return [c for family in CLAIM_FAMILIES for c in family(d, b, results)]


def _sentence(c: Claim, d_label: str, b_label: str) -> str:
    return (
        f"{c.claim} ({c.measure}): {d_label} {c.fmt(c.diff, c.diff_se)} vs {b_label} "
        f"{c.fmt(c.base, c.base_se)}, difference {c.delta:+.{c.nd}f} ± {c.delta_se:.{c.nd}f}"
    )


def summary_blocks(claims: Sequence[Claim], d_label: str = "DIFF", b_label: str = "Transformer") -> list[tuple]:
    """The summary as report blocks (see :mod:`diffattn.experiments.document`): the count, then what reproduced and
    what did not, one claim per line with its numbers."""
    if not claims:
        return [("p", "No paper claim could be checked: the run has no DIFF / Transformer pair with the numbers.")]
    yes = [c for c in claims if c.reproduced]
    opp = [c for c in claims if c.verdict.endswith("(opposite)")]
    flat = [c for c in claims if c.verdict.endswith("(within noise)")]
    out: list[tuple] = [
        (
            "p",
            f"**{len(yes)} of the {len(claims)} paper claims checked here reproduced at this scale.** A claim "
            f"counts as reproduced when {d_label} beats {b_label} in the paper's direction by more than {Z:g} "
            "standard errors of the difference; numbers are mean ± one standard error.",
        )
    ]
    for title, group in (
        ("Reproduced", yes),
        ("Not reproduced, the opposite holds", opp),
        ("Not reproduced, the difference is within the noise", flat),
    ):
        if group:
            out.append(("p", f"**{title}:**"))
            out.append(("list", [_sentence(c, d_label, b_label) for c in group]))
    return out


def verdict_lines(claims: Sequence[Claim], d_label: str = "DIFF", b_label: str = "Transformer") -> list[str]:
    """The summary as terminal lines (what ``diffattn compare`` prints at its end): the count, then each claim's
    verdict with its numbers, reproduced first."""
    if not claims:
        return ["verdict: no paper claim could be checked (the run has no DIFF / Transformer pair with the numbers)"]
    yes = [c for c in claims if c.reproduced]
    order = yes + [c for c in claims if c.verdict.endswith("(opposite)")] + [
        c for c in claims if not c.reproduced and not c.verdict.endswith("(opposite)")]
    head = (f"verdict: {len(yes)} of the {len(claims)} paper claims checked here reproduced at this scale (a claim "
            f"reproduces when {d_label} beats {b_label} in the paper's direction by more than {Z:g} standard errors "
            "of the difference)")
    return [head] + [f"  {c.verdict}: {_sentence(c, d_label, b_label)}" for c in order]


def summary_table(claims: Sequence[Claim], d_label: str = "DIFF", b_label: str = "Transformer") -> tuple:
    """A report table block: one row per claim."""
    return (
        "table",
        ["paper claim", "paper", "measured", d_label, b_label, "difference", "verdict"],
        [
            [
                c.claim,
                c.paper,
                c.measure,
                c.fmt(c.diff, c.diff_se),
                c.fmt(c.base, c.base_se),
                f"{c.delta:+.{c.nd}f} ± {c.delta_se:.{c.nd}f}",
                c.verdict,
            ]
            for c in claims
        ],
    )
