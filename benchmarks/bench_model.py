"""Full training-step throughput on CPU: DIFF TransformerLM vs its parameter-matched baseline, and the same
networks run through Hugging Face ``transformers`` (DiffLlama / Llama, eager and sdpa attention).

    python benchmarks/bench_model.py             # T=1024, d_model=512, 4 layers
    python benchmarks/bench_model.py --quick     # T=256, 2 layers (a smoke run)
    python benchmarks/bench_model.py --compile --no-hf   # + both models under torch.compile (train.compile)

One train step = forward + cross-entropy + backward + AdamW step, batch 1. All models are stepped
round-robin (order rotated every repeat); a ratio is the median over repeats of (baseline step time / model
step time), i.e. tokens/s relative to our parameter-matched baseline. Target: DIFF / baseline >= 0.88x.
``--compile`` adds DIFF and baseline with the forward under ``torch.compile`` (as ``train.compile = true``
does: the backward is compiled with it, AdamW stays eager), stepped in the same round-robin, and a second
table with the compiled baseline as the reference, so eager and compiled ratios come from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import THREADS, interleaved_times, print_table  # noqa: E402

from diffattn.model.config import ModelConfig, matched_baseline  # noqa: E402
from diffattn.model.transformer import TransformerLM  # noqa: E402

LogitsFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def train_step(model: nn.Module, ids: torch.Tensor, logits_of: LogitsFn,
               compile_model: bool = False) -> Callable[[], None]:
    """A closure doing one optimisation step of ``model`` on next-token prediction over ``ids`` (1, T+1);
    ``compile_model`` runs the forward (and so the backward) through torch.compile, as train.compile does.
    On CUDA the forward runs under bf16 autocast and the step ends with a synchronize (so it can be timed)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    model.train()
    fwd = torch.compile(model) if compile_model else model
    inp, tgt = ids[:, :-1], ids[:, 1:]
    cuda = ids.is_cuda

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = logits_of(fwd, inp)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    return step


def ours(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    return model(inp)


def hf_logits(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inp, use_cache=False).logits


def build_hf(model: TransformerLM, impl: str) -> tuple[nn.Module | None, str]:
    """(hf model, note) via diffattn.interop.hf.to_hf, or (None, reason) if unavailable."""
    try:
        from diffattn.interop.hf import to_hf
    except Exception as e:  # the interop module is optional (needs transformers)
        return None, f"unavailable ({type(e).__name__}: {e})"
    try:
        try:
            hf = to_hf(model, attn_implementation=impl)
        except TypeError:  # an older to_hf without the keyword
            hf = to_hf(model)
            if hasattr(hf, "set_attn_implementation"):
                hf.set_attn_implementation(impl)
            else:
                hf.config._attn_implementation = impl
        actual = getattr(hf.config, "_attn_implementation", impl)
        if actual != impl:
            return None, f"unavailable (asked for {impl!r}, transformers chose {actual!r})"
        # same weights, same function: a wrong conversion would make the timing meaningless
        with torch.no_grad():
            probe = torch.randint(0, model.config.vocab_size, (1, 64), device=next(model.parameters()).device)
            err = (hf_logits(hf.eval(), probe) - model.eval()(probe)).abs().max().item()
        return hf, f"max |logit diff| vs ours {err:.1e}"
    except Exception as e:
        return None, f"unavailable ({type(e).__name__}: {e})"


def step_tables(*, device: str = "cpu", t: int, d_model: int, n_layers: int, n_heads: int, vocab: int,
                repeats: int, hf: bool = True, compile_models: bool = False) -> list[dict]:
    """Time one train step of DIFF and its matched baseline (and the HF / compiled variants asked for) on
    ``device``, B=1, sequence ``t``; print the tables and return them ({"title", "header", "rows"})."""
    diff_cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers,
                           n_heads=n_heads, attention="diff", max_seq_len=t, rope="interleaved")
    base_cfg = matched_baseline(diff_cfg)
    dev = torch.device(device)
    models = {"ours diff": TransformerLM(diff_cfg).to(dev), "ours baseline": TransformerLM(base_cfg).to(dev)}
    notes = {name: f"{m.num_params() / 1e6:.3f}M params, {m.config.n_heads} heads"
             for name, m in models.items()}
    ids = torch.randint(0, vocab, (1, t + 1), device=dev)
    fns = {name: train_step(m, ids, ours) for name, m in models.items()}
    if compile_models:  # separate copies: a compiled module shares parameters with the eager one
        for name in ("ours diff", "ours baseline"):
            cm = TransformerLM(models[name].config).to(dev)
            cm.load_state_dict(models[name].state_dict())
            notes[f"{name} compiled"] = "torch.compile(model), AdamW eager"
            fns[f"{name} compiled"] = train_step(cm, ids, ours, compile_model=True)
    if hf:
        for src, label in (("ours diff", "HF DiffLlama"), ("ours baseline", "HF Llama")):
            for impl in ("eager", "sdpa"):
                name = f"{label} {impl}"
                hf_model, note = build_hf(models[src], impl)
                notes[name] = note
                if hf_model is not None:
                    fns[name] = train_step(hf_model.to(dev), ids, hf_logits)
    print(f"torch {torch.__version__}, {dev.type}, {torch.get_num_threads()} threads; train step (fwd+bwd+AdamW), B=1, "
          f"T={t}, d_model={d_model}, {n_layers} layers, vocab {vocab}, repeats {repeats}")
    times = interleaved_times(fns, repeats, warmup=1, min_time=0.0)
    base = times["ours baseline"]
    rows = []
    for name in notes:
        if name not in times:
            rows.append([name, "-", "-", "-", notes[name]])
            continue
        ratio = statistics.median(b / a for a, b in zip(times[name], base))
        s = statistics.median(times[name])
        rows.append([name, f"{1e3 * s:.0f}", f"{t / s:.0f}", f"{ratio:.3f}x", notes[name]])
    tables = [print_table("tokens/s relative to our parameter-matched baseline "
                          "(paired median; target ours diff >= 0.88x)",
                          ["model", "step ms", "tokens/s", "vs ours baseline", "note"], rows)]
    if compile_models:
        rows = []
        for mode in ("", " compiled"):
            ratio = statistics.median(b / a for a, b in zip(times[f"ours diff{mode}"], times[f"ours baseline{mode}"]))
            speed = [statistics.median(e / c for c, e in zip(times[f"{n} compiled"], times[n]))
                     for n in ("ours diff", "ours baseline")] if mode else ["-", "-"]
            rows.append([mode.strip() or "eager", f"{ratio:.3f}x",
                         *(x if isinstance(x, str) else f"{x:.2f}x" for x in speed)])
        tables.append(print_table(
            "DIFF vs matched baseline, eager and compiled, same run (paired medians; target >= 0.88x)",
            ["mode", "diff / baseline tokens/s", "diff compile speed-up", "baseline compile speed-up"], rows))
    return tables


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seq-len", type=int, default=None, help="default 1024 (quick: 256)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=4, help="DIFF heads (the baseline gets twice as many)")
    p.add_argument("--n-layers", type=int, default=None, help="default 4 (quick: 2)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeats", type=int, default=None, help="round-robin repeats (default 5, quick 3)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--compile", action="store_true", help="add both models under torch.compile")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast; GPU target >= 0.90x)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t = args.seq_len or (256 if args.quick else 1024)
    n_layers = args.n_layers or (2 if args.quick else 4)
    repeats = args.repeats or (3 if args.quick else 5)

    step_tables(device=args.device, t=t, d_model=args.d_model, n_layers=n_layers, n_heads=args.n_heads,
                vocab=args.vocab, repeats=repeats, hf=not args.no_hf, compile_models=args.compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
