"""The retrofit verdict of ``diffattn study DATA --from SRC``: what the report adds when every arm started from a
pretrained model. **Step 0** (:func:`step0_check`): each arm's initial model scored against SRC on one validation
batch (the conversions are exact). **Held-out loss**: each retrofitted arm against ``standard`` (SRC continued on
the same tokens and seeds), read as better / equal / worse. **Where the papers say DIFF helps**
(:func:`arm_measures`): ``diffattn eval``'s activation outliers (paper Table 5) and perplexity with 8/6/4-bit
attention logits (Fig. 8) on SRC and each arm's final models; the needle measures need a model trained on the
needle task, and ``eval`` has no in-context-learning measure: the report says so. Measures are kept in
``OUT/measures/<cell>.json``, so a re-run reuses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from diffattn.checkpoint.run_folder import LATEST, load_run_checkpoint
from diffattn.eval.suite import evaluate_model
from diffattn.experiments.experiment_folder import cell_name
from diffattn.experiments.findings import stats
from diffattn.experiments.study.cell import read_json
from diffattn.experiments.study.source import arm_init, source_model
from diffattn.experiments.study.spec import StudySpec
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import atomic_write, refuse_links
from diffattn.train.loss import cross_entropy
from diffattn.train.retrofit import retrofit_model, set_retrofit

BITS = (8, 6, 4)  # the quantization sweep's widths (its first row is the unquantized reference)
PPL_BATCHES = 2  # batches of the quantization sweep's perplexity, each of the study's batch size and context
NOT_MEASURED = ("multi-needle retrieval and attention noise (`eval --what needle,noise`) need a model trained on the "
                "synthetic needle task, not a model of text; `eval` has no in-context-learning measure (shuffled "
                "or noisy demonstrations): neither is measured here")


@torch.no_grad()
def _loss(model: TransformerLM, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.eval()
    return float(cross_entropy(model(batch[0]), batch[1], reduction="none").double().mean())


def step0_check(spec: StudySpec, source: Any) -> dict[str, Any]:
    """Each arm's initial model (seed 0) and SRC on one validation batch drawn with seed 0: {"tokens", "source",
    "arms": [{"arm", "loss", "abs_diff"}]}."""
    batch = source.get_batch("val", spec.train.batch_size, torch.Generator().manual_seed(0))
    src = source_model(spec.source)
    ref = _loss(src, batch)
    rows = []
    for a in spec.arms():
        rcfg = spec.retrofit(a.attention)
        if rcfg.active:  # the retrofit's model at its schedule's start (s = 0), as the cell's run builds it
            model, _ = retrofit_model(src, rcfg, source=source, seed=0)
            set_retrofit(model, 0.0)
        else:
            model = TransformerLM(spec.arm_config(a))
            model.load_state_dict(arm_init(spec.source, a.attention, 0, src))
        loss = _loss(model, batch)
        rows.append({"arm": a.name, "loss": loss, "abs_diff": abs(loss - ref)})
        del model
    return {"tokens": batch[1].numel(), "source": ref, "arms": rows}


def _measure(model: TransformerLM, spec: StudySpec, source: Any) -> dict[str, Any]:
    res = evaluate_model(model.eval(), what=("outliers", "quant"), source=source, bits=BITS,
                         batch_size=spec.train.batch_size, quant_ppl_batches=PPL_BATCHES, seed=0)
    o, q = res["outliers"], res["quant"]
    ref = q[0]
    return {
        "sequences": o["sequences"], "seq_len": spec.train.seq_len,
        "attn_logits": {k: o["attn_logits"][k] for k in ("top1", "top10", "median") if k in o["attn_logits"]},
        "hidden": {k: o["hidden"][k] for k in ("top1", "top10", "median") if k in o["hidden"]},
        "ppl_tokens": ref.get("ppl_tokens"), "loss_fp32": ref.get("ppl_loss"),
        "quant": [{"bits": r["bits"], "loss": r.get("ppl_loss"), "rise": r.get("ppl_rise"),
                   "rise_se": r.get("ppl_rise_se")} for r in q[1:]],
    }


def _cached(out: Path, name: str, compute: Any) -> dict[str, Any]:
    folder = out / "measures"
    refuse_links(out, ["measures"])
    f = folder / f"{name}.json"
    if f.exists():
        return read_json(f)
    res = compute()
    folder.mkdir(exist_ok=True)
    atomic_write(f, json.dumps(res, indent=1, default=float) + "\n")
    return res


def arm_measures(out: Path, spec: StudySpec, results: dict[str, Any], source: Any) -> dict[str, Any]:
    """The measures of SRC before training and of each arm's final models at its best LR (one per seed)."""
    # each computed only when not kept from an earlier run (_cached)
    rows = [{"model": "SRC (before training)", "seed": None,
             **_cached(out, "source", lambda: _measure(source_model(spec.source), spec, source))}]
    for arm in results["arms"]:
        for s in spec.seeds:
            name = cell_name(arm["name"], arm["best_lr"], s)
            folder = out / "cells" / name
            if not (folder / LATEST).exists():
                continue
            rows.append({"model": arm["name"], "seed": s, "lr": arm["best_lr"], **_cached(
                out, name, lambda f=folder: _measure(load_run_checkpoint(f).build_model(), spec, source))})
    return {"rows": rows, "not_measured": NOT_MEASURED, "bits": list(BITS)}


def retrofit_results(out: Path, spec: StudySpec, results: dict[str, Any], source: Any) -> dict[str, Any]:
    """The report's retrofit section: step 0, the held-out verdicts against SRC continued, the measures."""
    verdicts = [{"arm": c["candidate"], "delta": c["diff_minus_baseline"], "ci95": c["ci95"],
                 "conclusion": c["conclusion"], "word": WORDS[c["conclusion"]]}
                for c in results.get("comparisons") or []]
    measures = arm_measures(out, spec, results, source) if results.get("arms") else None
    return {"source": spec.source, "retrofit_steps": spec.retrofit_steps, "step0": step0_check(spec, source),
            "verdicts": verdicts, "measures": measures}


# The paired comparison's conclusion (stats.verdict) in the words of a retrofit: against SRC continued
WORDS = {stats.BETTER: "better", stats.WORSE: "worse", stats.NO_DIFFERENCE: "equal (within the 95% CI)",
         stats.TOO_FEW: "undetermined (no interval: one seed, or a diverged cell)"}
