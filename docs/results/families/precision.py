"""How large fp32 rounding is on a real checkpoint, beside max |Δlogits| between diffattn and transformers.

    python docs/results/families/precision.py FOLDER

Prints, on 2 × 64 random ids: the two implementations' fp32 logits against each other, each one's fp32 logits
against its own fp64 logits (its rounding error), and the two in fp64 (transformers' fp64 mode still computes
some steps in fp32: Gemma's norms and RoPE, the eager softmax)."""

import sys

import torch
import transformers

from diffattn.checkpoint.hf_folder import read_hf_folder

folder = sys.argv[1]
ours = read_hf_folder(folder)
hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
ids = torch.randint(0, ours.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    a32, b32 = ours(ids), hf(ids).logits
    print(f"fp32: diffattn vs transformers {(a32 - b32).abs().max().item():.3g} (logits up to "
          f"{b32.abs().max().item():.3g})")
    ours.double()
    hf.double()
    a64, b64 = ours(ids), hf(ids).logits
    print(f"fp32 vs fp64: diffattn {(a32.double() - a64).abs().max().item():.3g}, transformers "
          f"{(b32.double() - b64).abs().max().item():.3g}")
    print(f"fp64: diffattn vs transformers {(a64 - b64).abs().max().item():.3g}")
