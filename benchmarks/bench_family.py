"""The differential family's cores on CPU against their reference points, forward + backward, in one run.

    python benchmarks/bench_family.py            # T in {1024, 2048}
    python benchmarks/bench_family.py --quick    # T in {128, 256} (smoke run)

Timing as bench_attention.py (round-robin, median of per-repeat ratios, 2 threads, fp32, batch 1, causal).
d_model 512 (V1 layout: h = 4 diff-heads, sub-heads d = 64, V 2d; standard: 8 heads of 64):

* ``DINT/V1``: ``dint_attention`` vs ``diff_attention`` (the same SDPA call, plus the running mean of A1·V and
  the separate A1·V/A2·V outputs). Target <= 1.3x.
* ``SharedDIFF/V1``: one ``SharedDiffAttention`` module vs one ``MultiheadDiffAttention`` (projections
  included: the shared base plus two rank-r paths against two full maps). Target <= 1.2x.
* ``ALiBi/std``: ``alibi_attention`` vs a causal standard SDPA core of the same shape. The bias goes in as a
  float mask, so the call cannot skip the tiles above the diagonal as ``is_causal`` does (~2x work on CPU's
  flash kernel), plus building the (H, T, T) bias. Target <= 3x.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_attention import THREADS, fwd_bwd, interleaved_times, med_ms, paired_ratio, print_table, sdpa

from diffattn import functional as AF
from diffattn.attention.alibi import alibi_attention, alibi_slopes
from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.dint import dint_attention
from diffattn.attention.shared_diff import SharedDiffAttention

E, H, D = 512, 4, 64


def rows_for(t: int, repeats: int) -> list[list[str]]:
    torch.manual_seed(0)
    r = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    q, k, v, lam = r(1, 2 * H, t, D), r(1, 2 * H, t, D), r(1, H, t, 2 * D), torch.tensor(0.5, requires_grad=True)
    qs, ks, vs = r(1, 2 * H, t, D), r(1, 2 * H, t, D), r(1, 2 * H, t, D)
    slopes = alibi_slopes(2 * H).float()
    x = r(1, t, E)
    shared, v1 = SharedDiffAttention(E, H, depth=1), MultiheadDiffAttention(E, H, depth=1)
    times = interleaved_times({
        "dint": fwd_bwd(lambda *a: dint_attention(*a), [q, k, v, lam]),
        "v1": fwd_bwd(lambda *a: AF.diff_attention(*a), [q, k, v, lam]),
        "shared_module": fwd_bwd(shared, [x]),
        "v1_module": fwd_bwd(v1, [x]),
        "alibi": fwd_bwd(lambda *a: alibi_attention(*a, slopes), [qs, ks, vs]),
        "std": fwd_bwd(sdpa, [qs, ks, vs]),
    }, repeats)
    return [
        [str(t), "DINT/V1", f"{med_ms(times['dint']):.1f}", f"{med_ms(times['v1']):.1f}",
         f"{paired_ratio(times, 'dint', 'v1'):.2f}x", "<= 1.3x"],
        [str(t), "SharedDIFF/V1", f"{med_ms(times['shared_module']):.1f}", f"{med_ms(times['v1_module']):.1f}",
         f"{paired_ratio(times, 'shared_module', 'v1_module'):.2f}x", "<= 1.2x"],
        [str(t), "ALiBi/std", f"{med_ms(times['alibi']):.1f}", f"{med_ms(times['std']):.1f}",
         f"{paired_ratio(times, 'alibi', 'std'):.2f}x", "<= 3x"],
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="round-robin repeats (default 7, quick 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    ts = [128, 256] if args.quick else [1024, 2048]
    repeats = args.repeats or (3 if args.quick else 7)
    rows = [row for t in ts for row in rows_for(t, repeats)]
    print_table("the family's cores, fwd+bwd, fp32 CPU (ms: medians)",
                ["T", "ratio", "candidate ms", "reference ms", "ratio", "target"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
