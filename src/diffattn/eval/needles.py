"""Needles: exact match of the argmax at each query position (answers are single tokens), per (depth, length),
on the evaluation grid; and the multi-needle table (paper Table 2: N needles, R of them queried)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from diffattn.configs.run_config import RunConfig
from diffattn.data.lm import make_source
from diffattn.data.synthetic import NeedleCell, NeedleData, needle_accuracy, needle_eval_set


def default_cells(
    task: NeedleData,
    *,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_needles: int = 1,
    n_queries: int = 1,
    n_samples: int = 32,
    seed: int = 0,
) -> list[NeedleCell]:
    """The evaluation grid: depths × lengths (default lengths: seq_len/4, seq_len/2, seq_len, each raised to
    the shortest length where ``n_needles`` fit around the queried one at every depth). ``n_needles`` > 1
    puts ``n_needles − 1`` distractor needles (other keys) in every context, which makes the grid harder."""
    if lengths is None:
        t = task.seq_len
        lengths = sorted({task.shortest_fit(n_needles, n_queries, depths, at_least=n) for n in (t // 4, t // 2, t)})
    return needle_eval_set(
        task, depths, lengths, n_needles=n_needles, n_queries=n_queries, n_samples=n_samples, seed=seed
    )


MULTI_FACTOR = 4  # the multi-needle table draws this many times the grid's samples (spread over 5 depths)


def multi_needle_cells(task: NeedleData, length: int, n: int, r: int, n_samples: int, seed: int) -> list:
    """The examples behind one (N needles, R queried) entry: ``n_samples`` spread over depths 0, ¼, ½, ¾, 1."""
    depths = [i / 4 for i in range(5)]
    return needle_eval_set(task, depths, [length], n_needles=n, n_queries=r,
                           n_samples=max(1, n_samples // len(depths)), seed=seed + 7919 * n + r)


def multi_needle_counts(
    model: nn.Module,
    task: NeedleData,
    length: int,
    *,
    settings=((1, 1), (2, 2), (4, 2), (6, 2)),
    n_samples: int = 32,
    seed: int = 0,
) -> tuple[dict[str, float], dict[str, int]]:
    """Paper Table 2 style: accuracy over random depths for each (N needles, R queried) at one length, and per
    entry the number of queried answers it counts: ({"N,R": accuracy}, {"N,R": answers})."""
    out, counts = {}, {}
    for n, r in settings:
        if n > task.vocab.n_keys or length < task.min_length(n, r):
            continue
        cells = multi_needle_cells(task, length, n, r, n_samples, seed)
        acc = needle_accuracy(model, cells)
        out[f"{n},{r}"] = sum(acc.values()) / len(acc)
        counts[f"{n},{r}"] = sum(c.answers.numel() for c in cells)
    return out, counts



def needle_data_of_run(run: RunConfig, seq_len: int) -> NeedleData | None:
    """The needle task a checkpoint was trained on (its run config's ``[data]``, built by data.make_source),
    or None when it was trained on something else."""
    if run.data.synthetic != "needle":
        return None
    task, _ = make_source(run.data.to_dict(), seq_len)
    return task if isinstance(task, NeedleData) else None


def needle_results(model: nn.Module, task: NeedleData, cells: Sequence[NeedleCell], *, n_samples: int,
                   seed: int) -> dict:
    """``evaluate_model``'s ``needle`` entry: accuracy per grid cell and overall, with the number of queried
    answers behind each, and the multi-needle table at the task's length (``MULTI_FACTOR`` × the samples)."""
    acc = needle_accuracy(model, cells)
    queries = {(c.depth, c.length): c.answers.numel() for c in cells}
    multi, multi_queries = multi_needle_counts(model, task, task.seq_len, n_samples=MULTI_FACTOR * n_samples,
                                               seed=seed)
    return {
        "grid": [{"depth": d, "length": n, "acc": a, "queries": queries[d, n]} for (d, n), a in acc.items()],
        "mean": sum(acc.values()) / len(acc),
        "queries": sum(queries.values()),
        "multi": multi,
        "multi_queries": multi_queries,
        "n_needles": cells[0].n_needles,
    }
