"""vLLM serving throughput of DIFF V1, V2 and their matched standard model (issue 33), through diffattn's plugin.

    python benchmarks/bench_serve.py --out docs/results/serve/          # vLLM's CPU build here; CUDA where it is

Per model, in one process with one engine at a time (in-process, prefix caching off, random prompts): prefill
tokens/s (8 prompts of --prompt-len tokens, one new token each), time to first token (one such prompt), and
decode tokens/s at batch 1 and batch 32 (prompts of 32 tokens, --new tokens each; decode time = the whole call
minus the same batch's prefill, measured alone). Each figure is a ratio against the standard model measured in
the same round; rounds alternate the models (standard, V1, V2, ...) and the medians are reported, with the KV-cache
bytes per token. Targets (CPU): V2 >= 0.95x the standard model's decode throughput, V1 >= 0.80x.

Shapes (random weights; the default is the 830M paper shape's attention cut to 8 layers and d_model 512):
standard: 8 heads of 64; V1: 4 diff-heads (Q/K 64, served as 8 query heads of 128 over 4 KV heads of 128, the
[K1 | K2] layout); V2: 8 pairs of query heads of 64 over 8 KV heads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffattn import ModelConfig, TransformerLM
from diffattn.interop.vllm.export import export_vllm
from diffattn.interop.vllm.served import kv_bytes_per_token

MODELS = ("standard", "diff", "diff_v2")


def configs(d_model: int, layers: int, vocab: int, ctx: int) -> dict[str, ModelConfig]:
    base = dict(vocab_size=vocab, d_model=d_model, n_layers=layers, max_seq_len=ctx, rope="neox")
    heads = d_model // 64
    return {"standard": ModelConfig(attention="standard", n_heads=heads, **base),
            "diff": ModelConfig(attention="diff", n_heads=heads // 2, **base),
            "diff_v2": ModelConfig(attention="diff_v2", n_heads=heads, **base)}


def timed(llm, vllm, prompts: list[list[int]], new: int) -> float:
    params = vllm.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def measure(llm, vllm, args, g: torch.Generator) -> dict[str, float]:
    def rand(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, args.vocab, (n, length), generator=g).tolist()

    timed(llm, vllm, rand(2, 16), 4)  # warm-up
    long = rand(8, args.prompt_len)
    out = {"prefill_tok_s": 8 * args.prompt_len / timed(llm, vllm, long, 1),
           "ttft_s": timed(llm, vllm, long[:1], 1)}
    for batch in (1, 32):
        prompts = rand(batch, 32)
        prefill = timed(llm, vllm, prompts, 1)
        whole = timed(llm, vllm, prompts, args.new)
        out[f"decode_tok_s_b{batch}"] = batch * (args.new - 1) / max(whole - prefill, 1e-9)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for serve.json and serve.md (else: print only)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: eager)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # the serve extra; slow to import

    cfgs = configs(args.d_model, args.layers, args.vocab, args.prompt_len + args.new + 64)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        export_vllm(TransformerLM(cfg).eval(), None, tmp / name)
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in MODELS}
    for r in range(args.rounds):
        for name in MODELS:
            llm = vllm.LLM(model=str(tmp / name), dtype=args.dtype, max_model_len=cfgs[name].max_seq_len,
                           enforce_eager=not args.compile, enable_prefix_caching=False, max_num_seqs=32,
                           kv_cache_memory_bytes=512 << 20, skip_tokenizer_init=True, seed=0,
                           tensor_parallel_size=args.tensor_parallel_size)
            rows[name].append(measure(llm, vllm, args, torch.Generator().manual_seed(r)))
            del llm
            gc.collect()
            print(f"round {r + 1}: {name} {rows[name][-1]}", file=sys.stderr, flush=True)
    result = summarize(rows, cfgs, args)
    print(to_markdown(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "serve.md").write_text(to_markdown(result) + "\n")
    return 0


def summarize(rows: dict, cfgs: dict, args) -> dict:
    keys = list(rows["standard"][0])
    result = {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "vllm": __import__("vllm").__version__, "dtype": args.dtype, "rounds": args.rounds,
              "shape": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab,
                        "prompt_len": args.prompt_len, "new": args.new}, "models": {}}
    for name in MODELS:
        ratios = {}
        for k in keys:
            per_round = [a[k] / b[k] for a, b in zip(rows[name], rows["standard"])]
            # time to first token: lower is better, so its ratio is standard / model (higher = faster) as well
            ratios[k] = statistics.median(1 / x for x in per_round) if k == "ttft_s" else statistics.median(per_round)
        kv = kv_bytes_per_token(cfgs[name], 2 if args.dtype in ("bfloat16", "float16") else 4)
        result["models"][name] = {"median": {k: statistics.median(r[k] for r in rows[name]) for k in keys},
                                  "ratio_vs_standard": ratios, "kv_bytes_per_token": kv["served"],
                                  "kv_floor_bytes": kv["floor"]}
    return result


def to_markdown(result: dict) -> str:
    lines = [f"vLLM {result['vllm']} on {result['device']} ({result['dtype']}), {result['rounds']} rounds, "
             f"shape {result['shape']}; ratios: the model over the standard model of the same round (median; "
             "time to first token as standard / model, so > 1 is faster)", "",
             "| model | prefill tok/s | TTFT s | decode tok/s b1 | decode tok/s b32 | KV bytes/token (floor) |",
             "|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        med, rat = m["median"], m["ratio_vs_standard"]
        lines.append(f"| {name} | {med['prefill_tok_s']:.0f} ({rat['prefill_tok_s']:.2f}x) | {med['ttft_s']:.3f} "
                     f"({rat['ttft_s']:.2f}x) | {med['decode_tok_s_b1']:.1f} ({rat['decode_tok_s_b1']:.2f}x) | "
                     f"{med['decode_tok_s_b32']:.0f} ({rat['decode_tok_s_b32']:.2f}x) | {m['kv_bytes_per_token']:,}"
                     f" ({m['kv_floor_bytes']:,}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
