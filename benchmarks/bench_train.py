"""Training benchmark: DIFF vs its parameter-matched baseline through the real training loop (train).

(1) Throughput: training tokens/s of the packaged ``tiny`` DIFF config and ``tiny_baseline`` on random tokens,
    same shapes and step counts, run round-robin (DIFF, base, DIFF, base, ...) so a busy moment on a shared
    machine hits both; the ratio is the median of the per-round ratios. The first logged window of each run
    (warm-up) is dropped.
(2) Real text, when ../shared/data/tinyshakespeare.txt exists beside the checkout: char-level, first 90%
    train / last 10% validate; DIFF and baseline trained with the same data order, seed and steps; val loss
    of each at equal steps.

    python benchmarks/bench_train.py                 # ~8-10 min on 2 busy cores
    python benchmarks/bench_train.py --quick         # smoke run
    python benchmarks/bench_train.py --steps 600     # longer real-text comparison

Threads: 1 by default (``--threads``). On a shared 2-core machine with other jobs running, 2 OpenMP threads
were measured 5x SLOWER than 1 for this shape (threads spin waiting on each other); on a quiet machine use
``--threads 2``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from diffattn.configs.run_config import load_run_config, resolve_model_config
from diffattn.data.lm import make_source
from diffattn.model.config import matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.loop import train

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"


class RandomTokens:
    """Uniform random tokens (throughput only: the loss is irrelevant)."""

    def __init__(self, vocab_size: int, seq_len: int):
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator):
        x = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=generator)
        return x[:, :-1], x[:, 1:]


def _configs(steps: int, **train):
    overrides = [f"--train.steps={steps}", *[f"--train.{k}={v}" for k, v in train.items()]]
    return load_run_config("tiny", overrides), load_run_config("tiny_baseline", overrides)


def throughput(steps: int, rounds: int) -> None:
    diff_cfg, base_cfg = _configs(steps, eval_every=0, log_every=max(1, steps // 4))
    vocab = 65
    mdiff = resolve_model_config(diff_cfg, vocab)
    mbase = resolve_model_config(base_cfg, vocab)
    assert matched_baseline(mdiff) == mbase, "tiny_baseline is not the matched baseline of tiny"
    tcfg = diff_cfg.train
    src = RandomTokens(vocab, tcfg.seq_len)
    rates: dict[str, list[float]] = {"diff": [], "base": []}
    for r in range(rounds):
        order = (("diff", mdiff), ("base", mbase))
        for name, mcfg in order if r % 2 == 0 else order[::-1]:
            torch.manual_seed(0)
            res = train(TransformerLM(mcfg), src, tcfg, progress=False)
            windows = [h["tokens_per_s"] for h in res.history[1:]]  # drop the warm-up window
            rates[name].append(statistics.median(windows))
    ratios = [d / b for d, b in zip(rates["diff"], rates["base"])]
    n_diff = TransformerLM(mdiff).num_params()
    n_base = TransformerLM(mbase).num_params()
    print(f"\n(1) training throughput, tiny shape (d_model {mdiff.d_model}, {mdiff.n_layers} layers, "
          f"batch {tcfg.batch_size} x seq {tcfg.seq_len}), {steps} steps x {rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    print(f"{'model':<28}{'params':>10}{'tokens/s (median)':>20}")
    print(f"{'DIFF (4 diff heads)':<28}{n_diff:>10,}{statistics.median(rates['diff']):>20,.0f}")
    print(f"{'baseline (8 heads)':<28}{n_base:>10,}{statistics.median(rates['base']):>20,.0f}")
    print(f"DIFF/baseline tokens/s ratio: {statistics.median(ratios):.3f} "
          f"(per round: {', '.join(f'{x:.3f}' for x in ratios)})")


def real_text(steps: int, eval_every: int) -> None:
    if not DATA.is_file():
        print(f"\n(2) skipped: {DATA} not found")
        return
    diff_cfg, base_cfg = _configs(steps, eval_every=eval_every, log_every=eval_every)
    data_cfg = {"path": str(DATA), "tokenizer": "char", "val_fraction": 0.1}
    results = {}
    for name, cfg in (("DIFF", diff_cfg), ("baseline", base_cfg)):
        tcfg = cfg.train
        source, tok = make_source(data_cfg, tcfg.seq_len, seed=tcfg.seed)
        mcfg = resolve_model_config(cfg, tok.vocab_size)
        torch.manual_seed(tcfg.seed)
        model = TransformerLM(mcfg)
        t0 = time.perf_counter()
        res = train(model, source, tcfg, progress=False)
        results[name] = (res, model.num_params(), time.perf_counter() - t0)
    d, b = results["DIFF"][0], results["baseline"][0]
    dv = {h["step"]: h["val_loss"] for h in d.history if h["val_loss"] is not None}
    bv = {h["step"]: h["val_loss"] for h in b.history if h["val_loss"] is not None}
    print(f"\n(2) tinyshakespeare, char-level (vocab {tok.vocab_size}), first 90% train / last 10% val; "
          f"same data order, seed {diff_cfg.train.seed}, {steps} steps, batch "
          f"{diff_cfg.train.batch_size} x seq {diff_cfg.train.seq_len}; val loss = mean over "
          f"{diff_cfg.train.eval_batches} fixed val batches")
    print(f"{'step':>6}{'DIFF val':>12}{'base val':>12}{'DIFF-base':>12}")
    for s in sorted(dv):
        print(f"{s:>6}{dv[s]:>12.4f}{bv[s]:>12.4f}{dv[s] - bv[s]:>+12.4f}")
    for name, (res, n, wall) in results.items():
        print(f"{name:<9} params {n:,}  final train loss {res.final_train_loss:.4f}  best val "
              f"{res.best_val_loss:.4f}  wall {wall:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (few steps)")
    p.add_argument("--steps", type=int, default=200, help="real-text steps per model")
    p.add_argument("--tput-steps", type=int, default=12, help="steps per throughput run")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds (each runs DIFF and baseline)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (see the module docstring)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.tput_steps, args.rounds = 12, 6, 2
    t0 = time.perf_counter()
    throughput(args.tput_steps, args.rounds)
    real_text(args.steps, eval_every=max(1, args.steps // 6))
    print(f"\ntotal {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
