"""The planner against the peaks that were measured: the 20 rows of the H200's 830M rehearsal
(docs/results/gpu/nvidia-h200.json: ``torch.cuda.max_memory_allocated`` of a step, diff_830m and base_830m at
T = 2048 and 4096, batch 1, bf16, each checkpointing mode eager and compiled) and the CPU's peaks
(docs/results/scale/memory.json, benchmarks/bench_memory.py). A model check against committed measurements:
the planner of this tree predicts each row again here.

What the H200 rows say (docs/results/gpu/README.md has the argument): the rows measured before any earlier case
of that process could leave memory behind agree within 2%; later rows carry a common excess that does not
depend on the step (equal in "none" and "full", whose planned activations differ 6×, and in DIFF and its
baseline), i.e. memory held before the step began. Those rows are checked for the signature, not the figure:
the planner's differences between them match the measured differences. The rehearsal now reports the peak
above what a case found allocated (benchmarks/scale_rehearsal.py); the next device run re-measures."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from diffattn.configs.run_config import load_run_config, resolve_model_config
from diffattn.train.plan import GIB, plan

ROOT = Path(__file__).resolve().parents[2]
ROWS = json.loads((ROOT / "docs/results/gpu/nvidia-h200.json").read_text())["tables"]["rehearsal"]["rows"]
# The rows in the order the one process ran them. The first five ran before any case of that process had
# ended with a compiled model (the fifth is the first compiled case): nothing of an earlier case was held.
FRESH = 5

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _planned(config: str, t: int, mode: str) -> float:
    cfg = load_run_config(config, [f"--model.max_seq_len={t}", f"--train.seq_len={t}"])
    m = plan(resolve_model_config(cfg, 32000), batch_size=1, seq_len=t, activation_checkpointing=mode,
             dtype="bfloat16", fused_optimizer=True)
    return m.layouts["ddp"].peak / GIB


def _row(i: int) -> tuple[str, int, str, bool, float, float]:
    name, t, mode, compiled, _losses, _tps, peak, _old = ROWS[i]
    return name, int(t), mode, compiled == "on", float(peak), _planned(name, int(t), mode)


def test_the_committed_file_has_the_twenty_rows():
    assert len(ROWS) == 20
    assert {(r[0], r[1], r[2], r[3]) for r in ROWS} == {
        (c, t, m, k) for c in ("diff_830m", "base_830m") for t in ("2048", "4096")
        for m in ("none", "full", "selective") for k in ("off", "on") if (m, k) != ("none", "on")}


def test_rows_measured_before_anything_was_left_behind_agree_within_ten_percent():
    errors = []
    for i in range(FRESH):
        name, t, mode, compiled, peak, planned = _row(i)
        errors.append((name, t, mode, compiled, planned / peak - 1))
    print("\n".join(f"{e[0]} T={e[1]} {e[2]} compiled={e[3]}: {100 * e[4]:+.1f}%" for e in errors))
    assert all(abs(e[4]) <= 0.10 for e in errors), errors


def test_no_row_is_over_predicted_by_more_than_ten_percent():
    # memory held before a step only adds to its peak: an over-prediction is the planner's own error
    over = [(i, _row(i)) for i in range(len(ROWS)) if _row(i)[5] > 1.10 * _row(i)[4]]
    assert not over, over


def test_the_later_eager_rows_at_4096_differ_by_one_offset_that_no_activation_term_explains():
    """Rows 11-14 (none and full, DIFF and baseline, T = 4096, eager): the planned peaks span 11.5-21.3 GiB,
    the part of them that is activations 1.8-13 GiB, yet measured - planned is the same in all four within
    0.3 GiB: an activation term short by a fraction would differ 6× between "none" and "full". The planner's
    differences between the rows, where a common offset cancels, match the measured ones within 10%."""
    rows = [_row(i) for i in range(10, 14)]
    assert all(r[1] == 4096 and not r[3] and r[2] in ("none", "full") for r in rows)
    gaps = [peak - planned for *_, peak, planned in rows]
    assert max(gaps) - min(gaps) <= 0.3, gaps
    assert min(gaps) > 4.0  # the excess is real (about 4.9 GiB), not noise
    by = {(r[0], r[2]): r for r in rows}
    for a, b in ((("diff_830m", "none"), ("diff_830m", "full")), (("base_830m", "none"), ("base_830m", "full")),
                 (("diff_830m", "none"), ("base_830m", "none"))):
        measured, planned = by[a][4] - by[b][4], by[a][5] - by[b][5]
        assert planned == pytest.approx(measured, rel=0.10), (a, b, measured, planned)


def test_the_cpu_measured_peaks_still_agree():
    """benchmarks/bench_memory.py's committed CPU peaks (fp32, a non-fused AdamW), planned again by this tree:
    each whole peak within the benchmark's 25% (the worst, 8L-512 T4096 full, was +22% when measured; the terms
    this change added are autocast's and change nothing in fp32)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_memory import PLAN_SHAPES, predict
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shapes = dict(PLAN_SHAPES)
    rows = json.loads((ROOT / "docs/results/scale/memory.json").read_text())["plan"]
    assert len(rows) >= 9
    for r in rows:
        want = predict(shapes[r["shape"]], r["mode"])["total_mb"]
        assert want == pytest.approx(r["measured"]["total_mb"], rel=0.25), r
