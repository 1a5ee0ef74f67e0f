"""Evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization; classifiers: accuracy, macro-F1.

``diffattn eval CKPT --what ppl,needle,noise,outliers,quant [--data FILE] [--out FILE]``

CKPT is a run folder or its ``ckpt/``, a converted model (which records no data: give ``--data FILE``), a
classifier run (``diffattn train --task classify``: accuracy and macro-F1 on the run's own validation split and
test file, or on ``--data FILE``), or a comparison folder (``diffattn compare --out DIR``: each model in it, or
the one named by ``--model NAME``; their results nest under ``"models"`` in the JSON).

* **ppl**: :mod:`diffattn.eval.perplexity`; **needle**: :mod:`diffattn.eval.needles`; **noise** (paper Table 3):
  :mod:`diffattn.eval.noise`; **outliers** (paper Table 5): :mod:`diffattn.eval.outliers`; **quant** (paper
  Fig. 8): :mod:`diffattn.eval.quantization`. Each module's docstring defines what it measures.

The probes (:mod:`diffattn.eval.probes`) switch attention to the materialized reference path while they are set
and are always removed afterwards, so the fast path of the model is untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from diffattn.data.synthetic import NeedleCell, NeedleData
from diffattn.eval.measures import DEFAULT_BITS, WHATS
from diffattn.eval.needles import default_cells, needle_results
from diffattn.eval.noise import noise_analysis
from diffattn.eval.outliers import outlier_results
from diffattn.eval.perplexity import perplexity
from diffattn.eval.quantization import quant_results


def evaluate_model(
    model: nn.Module,
    *,
    what: Sequence[str] = WHATS,
    task: NeedleData | None = None,
    source: Any = None,
    cells: Sequence[NeedleCell] | None = None,
    bits: Sequence[int] = DEFAULT_BITS,
    ppl_batches: int = 8,
    batch_size: int = 16,
    n_samples: int = 32,
    seed: int = 0,
    quant_ppl_batches: int | None = None,
    ppl_seed: int | None = None,
) -> dict:
    """Run the chosen evaluations. ``task`` (a NeedleData) is needed for needle/noise; ``source`` (any
    BatchSource) for ppl; outliers use the needle cells if there are any, else a batch of ``source``. ``ppl_seed``:
    the seed of ppl's batches (default: perplexity's own fixed one)."""
    bad = sorted(set(what) - set(WHATS))
    if bad:
        raise ValueError(f"unknown evaluation(s) {bad}; choose from {list(WHATS)}")
    if task is not None and cells is None:
        cells = default_cells(task, n_samples=n_samples, seed=seed)
    res: dict = {}
    if "ppl" in what:
        if source is None:
            raise ValueError("ppl needs a data source (--data FILE, or a checkpoint trained on a dataset)")
        seeded = {} if ppl_seed is None else {"seed": ppl_seed}
        res["ppl"] = perplexity(model, source, n_batches=ppl_batches, batch_size=batch_size, **seeded)
    if "needle" in what or "noise" in what:
        if task is None:
            raise ValueError("needle/noise need a model trained on the synthetic 'needle' task")
    if "needle" in what:
        res["needle"] = needle_results(model, task, cells, n_samples=n_samples, seed=seed)
    if "noise" in what:
        res["noise"] = noise_analysis(model, cells)
        res["noise"]["sequences"] = sum(len(c.inputs) for c in cells)
    if "outliers" in what:
        res["outliers"] = outlier_results(model, cells, source, batch_size=batch_size, seed=seed)
    if "quant" in what:
        res.update(quant_results(model, task, cells, source, bits=bits, batch_size=batch_size,
                                 ppl_batches=quant_ppl_batches or max(1, ppl_batches // 2),
                                 n_samples=n_samples, seed=seed))
    return res
