"""Serve a vLLM folder with vLLM and compare with diffattn on the same weights: greedy tokens and logprobs.

    python benchmarks/serve_check.py FOLDER --prompt "ROMEO:" --prompt "First Citizen:" --new 32 --dtype float32

FOLDER: a `diffattn export --to vllm` folder (diffattn reads the same folder). Prints, per prompt, vLLM's text,
whether its greedy tokens equal `diffattn generate`'s, the largest |Δ logprob| of vLLM's tokens against
diffattn's log-softmax, and vLLM's start-up and generation time; the KV-cache bytes per token.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import diffattn
from diffattn.interop.vllm.served import kv_bytes_per_token
from diffattn.model.generate import generate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # the serve extra

    model = diffattn.load_pretrained(args.folder).to(getattr(torch, args.dtype))
    tok = diffattn.load_pretrained_tokenizer(args.folder)
    t = time.time()
    llm = vllm.LLM(model=args.folder, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
                   kv_cache_memory_bytes=256 << 20, seed=0)
    start = time.time() - t
    prompts = [tok.encode(text) for text in args.prompt]
    t = time.time()
    outs = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                        vllm.SamplingParams(temperature=0, max_tokens=args.new, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    gen = time.time() - t
    kv = kv_bytes_per_token(model.config, 2 if args.dtype != "float32" else 4)
    print(f"vLLM {vllm.__version__}, {args.dtype}: start-up {start:.1f} s, {len(prompts)} prompts x {args.new} "
          f"tokens in {gen:.1f} s; KV cache {kv['served']:,} bytes per token ({kv['ratio']:.2f}x the floor)")
    for text, ids, out in zip(args.prompt, prompts, outs):
        got = list(out.outputs[0].token_ids)
        want = generate(model, ids, args.new, temperature=0)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids + got])).float()[0], -1)[len(ids) - 1:]
        err = max(abs(out.outputs[0].logprobs[j][t].logprob - lp[j, t].item()) for j, t in enumerate(got))
        same = next((j for j in range(len(got)) if got[j] != want[j]), None)
        print(f"{text!r} -> {out.outputs[0].text!r}: tokens {'equal' if same is None else f'part at {same}'}, "
              f"max |Δ logprob| {err:.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
