"""Conversion error of `diffattn convert` (--init exact) per case: max |Δlogits| in fp32 between a random
transformers Llama and its differential conversion (V1 and V2), on random ids.

    python benchmarks/bench_convert.py            # needs `transformers` (only to build the source models)

Cases: MHA / GQA / MQA / a head width not tied to hidden_size, tied and untied embeddings, both RoPE layouts.
Weights are drawn with std --std (default 0.1; norm gains 1 ± 0.1) so attention maps are far from uniform.
Columns: the import alone (our standard model vs transformers: float rounding of two implementations), then
each conversion against transformers and against our own source model (the conversion's own error).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from diffattn.interop.convert import convert
from diffattn.interop.hf import read_hf_folder

CASES = {"MHA": dict(kv=8), "GQA": dict(kv=2), "MQA": dict(kv=1), "GQA, head_dim 32": dict(kv=2, head_dim=32)}


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--std", type=float, default=0.1, help="std of the random weights")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"weights std {args.std}, 4 layers, d_model 128, 8 query heads, T={args.seq_len}, fp32; max |Δlogits|:")
    print("| case | embeddings | RoPE | max abs logit | import vs HF | V1 vs HF | V2 vs HF | V1 vs ours | V2 vs ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kw in CASES.items():
        for tied in (True, False):
            cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=kw["kv"],
                                           head_dim=kw.get("head_dim"), max_position_embeddings=args.seq_len,
                                           tie_word_embeddings=tied)
            hf = transformers.LlamaForCausalLM(cfg).eval()
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else args.std * torch.randn_like(p))
            ids = torch.randint(0, 256, (4, args.seq_len))
            with tempfile.TemporaryDirectory() as folder, torch.no_grad():
                hf.save_pretrained(folder)
                ref = hf(ids).logits
                for rope in ("neox", "interleaved"):
                    src = read_hf_folder(folder, rope=rope)
                    ours = src(ids)
                    outs = [convert(src, to)(ids) for to in ("diff", "diff_v2")]
                    errs = [(ours - ref).abs().max().item()] + [(o - ref).abs().max().item() for o in outs]
                    errs += [(o - ours).abs().max().item() for o in outs]
                    print(f"| {name} | {'tied' if tied else 'untied'} | {rope} | {ref.abs().max().item():.1f} | "
                          + " | ".join(f"{e:.1e}" for e in errs) + " |")


if __name__ == "__main__":
    main()
