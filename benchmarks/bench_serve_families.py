"""A family served by vLLM three ways, on the same weights (issue 40): vLLM's own model class on the transformers
folder ("native"), diffattn's reading of it (``convert --to standard``) through diffattn's plugin ("standard"),
and its differential conversions ("diff", "diff_v2").

    python benchmarks/bench_serve_families.py --family qwen2 --out docs/results/families/serve-qwen2.json
    python benchmarks/bench_serve_families.py --family gemma3_text
    python benchmarks/bench_serve_families.py --source /work/weights/qwen2-qwen2.5-coder-0.5b-instruct-hf
    python benchmarks/bench_serve_families.py --family llama --models standard,mixed_diff,diff --rounds 2

Without ``--source`` the model is a random one of ``--family`` built with transformers' own config class at a
tiny-but-not-trivial size (d_model 512, 8 layers, 8 query heads of 64 over 2 KV heads, vocabulary 8192; Gemma 3:
4 heads of 128 over 1 KV head, a 5:1 local:global window pattern). Decode tokens/s at batch 1 and 32 (prompts of
32 random tokens, ``--new`` tokens each; decode time = the whole call minus the same batch's one-token call), one
engine at a time in this process (prefix caching off), rounds alternating the models; the figures are medians of
the per-round ratios over the native model. Target: standard >= 0.95x native.

The differential models are ``convert``'s exact conversions of the standard model when its recipes take the
family; otherwise (a family option the recipe does not carry yet) a randomly initialised model of the shape the
recipe would make, with the same family options: the served cost does not depend on the weights' values (the
output names which).
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

from diffattn import TransformerLM, load_pretrained
from diffattn.attention.registry import conversion_of
from diffattn.interop.convert import convert
from diffattn.interop.vllm.export import export_vllm

MODELS = ("native", "standard", "diff", "diff_v2")
#: Selective retrofits (issue 41), asked for by name in ``--models``: every other layer (1, 3, ...) retrofitted to
#: the type (``retrofit_model``, the plain type), the others standard.
MIXED = {"mixed_diff": "diff", "mixed_diff_v2": "diff_v2"}
SIZES = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1024)
FAMILY = {"qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
          "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
          "qwen3": ("Qwen3Config", dict(head_dim=64, tie_word_embeddings=True)),
          "gemma3_text": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                                   query_pre_attn_scalar=128, sliding_window=128,
                                                   intermediate_size=2048))}


def random_source(family: str, out: Path) -> Path:
    import transformers

    cls_name, extra = FAMILY[family]
    cfg = getattr(transformers, cls_name)(**{**SIZES, **extra})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(out)
    return out


def differential(std: TransformerLM, to: str) -> tuple[TransformerLM, str]:
    """(the conversion of ``std`` to ``to``, how it was made)."""
    try:
        return convert(std, to), "convert (exact)"
    except ValueError as e:  # the recipe does not take this family yet: the shape it would make, at random
        cfg = conversion_of(to).config(std.config, to, "exact")
        torch.manual_seed(0)
        return TransformerLM(cfg).eval(), f"random weights of the conversion's shape ({str(e)[:120]})"


def mixed(std: TransformerLM, to: str) -> tuple[TransformerLM, str]:
    """``std`` with every other layer retrofitted to ``to``, and how it was made."""
    from diffattn.configs.retrofit import RetrofitConfig
    from diffattn.train.retrofit import retrofit_model

    layers = list(range(1, std.config.n_layers, 2))
    model, _ = retrofit_model(std, RetrofitConfig(to=to, layers=layers))
    return model.eval(), f"retrofit_model --retrofit.to {to} --retrofit.layers {layers}"


def timed(llm, vllm, prompts: list[list[int]], new: int) -> float:
    params = vllm.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def measure(llm, vllm, vocab: int, new: int, g: torch.Generator) -> dict[str, float]:
    timed(llm, vllm, torch.randint(0, vocab, (2, 16), generator=g).tolist(), 4)  # warm-up
    out = {}
    for batch in (1, 32):
        prompts = torch.randint(0, vocab, (batch, 32), generator=g).tolist()
        prefill = timed(llm, vllm, prompts, 1)
        whole = timed(llm, vllm, prompts, new)
        out[f"decode_tok_s_b{batch}"] = batch * (new - 1) / max(whole - prefill, 1e-9)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILY), default="qwen2")
    p.add_argument("--source", default=None, help="a transformers folder (else: a random --family model)")
    p.add_argument("--out", default=None, help="a JSON file for the figures (else: print only)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--models", default=",".join(MODELS), help=f"a subset of {','.join(MODELS + tuple(MIXED))}")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-families-"))
    source = Path(args.source) if args.source else random_source(args.family, tmp / "native")
    std = load_pretrained(source).float().eval()
    folders, how = {"native": source, "standard": tmp / "standard"}, {"standard": "convert --to standard"}
    export_vllm(std, None, folders["standard"])
    for to in ("diff", "diff_v2"):
        if to in models:
            model, how[to] = differential(std, to)
            export_vllm(model, None, tmp / to)
            folders[to] = tmp / to
            del model
    for name, to in MIXED.items():
        if name in models:
            model, how[name] = mixed(std, to)
            export_vllm(model, None, tmp / name)
            folders[name] = tmp / name
            del model
    vocab, ctx = std.config.vocab_size, min(std.config.max_seq_len, 32 + args.new + 32)
    del std
    gc.collect()
    import vllm  # the serve extra; slow to import

    rows: dict[str, list[dict[str, float]]] = {m: [] for m in models}
    for r in range(args.rounds):
        for name in models:
            llm = vllm.LLM(model=str(folders[name]), dtype=args.dtype, max_model_len=ctx, enforce_eager=True,
                           enable_prefix_caching=False, max_num_seqs=32, kv_cache_memory_bytes=512 << 20,
                           skip_tokenizer_init=True, seed=0)
            rows[name].append(measure(llm, vllm, vocab, args.new, torch.Generator().manual_seed(r)))
            del llm
            gc.collect()
            print(f"round {r + 1}: {name} {rows[name][-1]}", file=sys.stderr, flush=True)
        result = summarize(rows, args, how, vllm.__version__)
        if args.out:  # after every round: a run stopped early keeps the rounds it finished
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def summarize(rows: dict[str, list[dict[str, float]]], args, how: dict[str, str], version: str) -> dict:
    """Per model: the median figures over the rounds done, and the median of the per-round ratios to native (to
    the standard model when native is not run)."""
    done = min(len(v) for v in rows.values())
    result = {"source": str(args.source or f"random {args.family}"), "vllm": version, "dtype": args.dtype,
              "rounds": done, "new": args.new, "how": how, "models": {}}
    for name, runs in rows.items():
        runs = runs[:done]
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        base = "native" if "native" in rows else "standard" if "standard" in rows else None
        ratio = ({k: statistics.median(a[k] / b[k] for a, b in zip(runs, rows[base])) for k in med}
                 if base else {})
        result["models"][name] = {"median": med, f"ratio_vs_{base}": ratio, "per_round": runs}
    return result


if __name__ == "__main__":
    raise SystemExit(main())
