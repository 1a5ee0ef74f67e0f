"""The serving tests' cases: a tiny model of every served type (a head width vLLM's CPU attention takes), the
folder users point vLLM at, and an in-process engine with continuous batching, chunked prefill and prefix
caching on. The ``vllm`` fixture (conftest.py) imports vLLM once."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from diffattn import ModelConfig, TransformerLM
from diffattn.attention.registry import ATTENTION
from diffattn.interop.vllm.served import served_type
from diffattn.tokenizer import build_tokenizer

TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n") * 3

#: Every served type and the settings each recipe must get right. d_model 128: Q/K widths 32 (standard, V2,
#: ALiBi: 4 heads) and 32 (V1 family: 2 diff-heads, served at 64), both widths the CPU backend takes.
CASES: dict[str, dict] = {
    "standard": dict(attention="standard", n_heads=4, n_kv_heads=2, rope="neox"),
    "diff": dict(attention="diff", n_heads=2, n_kv_heads=1, n_layers=3),  # paper: norm, λ_init per depth, GQA
    # every other V1 setting in one model: no per-head norm, constant λ_init, NeoX RoPE, explicit head width,
    # biases, timm's qk_norm and dual_lambda
    "diff_options": dict(attention="diff", n_heads=2, subln=False, lambda_init=0.5, rope="neox", head_dim=32,
                         bias=True, attn_options={"qk_norm": True, "dual_lambda": True}),
    "diff_v2": dict(attention="diff_v2", n_heads=4, n_kv_heads=2),
    "dint": dict(attention="dint", n_heads=2),
    "alibi": dict(attention="alibi", n_heads=4),
    "shared_diff": dict(attention="shared_diff", n_heads=2, shared_qk=True),  # served as V1
    "gated": dict(attention="gated", n_heads=4, n_kv_heads=2),  # elementwise gate, GQA
    # GDA 3:1: 8 sub-heads = 2 groups of 3 signal heads and their noise head, both groups on one KV head
    "grouped_diff": dict(attention="grouped_diff", n_heads=4, n_kv_heads=1, head_dim=32),
    "diffllama": dict(attention="diff", n_heads=2, n_kv_heads=1, rope="neox"),  # an `export --to hf` folder
}
# Every other type whose file registers a vLLM layer gets a default case (4 query heads of width 32, or 2 diff-heads),
# so a new variant is served by these tests with no edit here.
for _name in sorted(ATTENTION):
    if served_type(_name) == _name and all(c["attention"] != _name for c in CASES.values()):
        CASES[_name] = dict(attention=_name, n_heads=4 // ATTENTION[_name].head_split)


def tokenizer():
    return build_tokenizer("char", TEXT)


def tiny_model(case: str, vocab_size: int, seed: int = 0) -> TransformerLM:
    """CASES[case] at d_model 128, 2 layers, context 128. Larger init (0.3) peaks the logits, so greedy choices
    have margins; λ vectors, norm gains and a type's other per-head parameters (sinks) are pushed off their init,
    so a wrong mapping shows."""
    kw = dict(vocab_size=vocab_size, d_model=128, n_layers=2, max_seq_len=128, init_std=0.3)
    kw.update(CASES[case])
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda_" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(("norm.weight", "subln.weight")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 1 and name.rsplit(".", 1)[-1] not in ("weight", "bias"):
                p.add_(torch.randn_like(p))
    return model


def export_case(case: str, model: TransformerLM, tok, out: Path) -> Path:
    """The folder users point vLLM at: ``export --to vllm``, or ``export --to hf`` for the DiffLlama case."""
    if case == "diffllama":
        from diffattn.interop.hf_export import export_hf  # transformers: the test extra has it

        export_hf(model, tok, out)
    else:
        from diffattn.interop.vllm.export import export_vllm

        export_vllm(model, tok, out)
    return out


def engine(vllm, folder: Path, dtype: str, **kw):
    """An in-process vLLM engine on ``folder`` with continuous batching (2 sequences at a time), chunked
    prefill (32 tokens per step), prefix caching (32-token blocks) and a small KV cache."""
    args = dict(model=str(folder), dtype=dtype, max_model_len=128, enforce_eager=True, max_num_seqs=2,
                max_num_batched_tokens=32, enable_chunked_prefill=True, enable_prefix_caching=True, block_size=32,
                kv_cache_memory_bytes=32 << 20, seed=0)
    args.update(kw)
    return vllm.LLM(**args)


def close(llm) -> None:
    del llm
    gc.collect()
