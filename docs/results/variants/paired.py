"""Paired differences between two arms of a `diffattn study` folder (or one `compare --data` wrote before it became `study`), each
at its own best LR.

    python docs/results/variants/paired.py FOLDER ARM_A:ARM_B [ARM_A:ARM_B ...]

Reads each cell's result.json (final validation loss), picks each arm's best LR by the mean over seeds, and
prints A − B paired over seeds with a Student-t 95% interval (the report's own method for its pairs).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from scipy import stats


def cells(folder: Path) -> dict[str, dict[float, dict[int, float]]]:
    out: dict[str, dict[float, dict[int, float]]] = {}
    for f in sorted(folder.glob("cells/*/result.json")):
        r = json.loads(f.read_text())
        out.setdefault(r["arm"], {}).setdefault(float(r["lr"]), {})[int(r["seed"])] = r["val_loss"]
    return out


def paired(grid: dict, a: str, b: str) -> tuple[float, float, float]:
    best = {arm: min(grid[arm], key=lambda lr: statistics.mean(grid[arm][lr].values())) for arm in (a, b)}
    x, y = grid[a][best[a]], grid[b][best[b]]
    d = [x[s] - y[s] for s in sorted(x) if s in y]
    m, se = statistics.mean(d), statistics.stdev(d) / len(d) ** 0.5
    t = stats.t.ppf(0.975, len(d) - 1)
    return m, m - t * se, m + t * se


if __name__ == "__main__":
    grid = cells(Path(sys.argv[1]))
    print("| pair | Δ nats/token | 95% CI |\n|---|---|---|")
    for pair in sys.argv[2:]:
        a, b = pair.split(":")
        m, lo, hi = paired(grid, a, b)
        print(f"| {a} − {b} | {m:+.4f} | [{lo:+.4f}, {hi:+.4f}] |")
