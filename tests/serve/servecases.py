"""The serving tests' cases: a tiny model of every served type (a head width vLLM's CPU attention takes), the
folder users point vLLM at, and an in-process engine with continuous batching, chunked prefill and prefix
caching on. The ``vllm`` fixture (conftest.py) imports vLLM once."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from hfsave import GEMMA3_ROPE, nudged, save_hf

from diffattn import ModelConfig, TransformerLM
from diffattn.attention.registry import ATTENTION
from diffattn.interop.vllm.served import served_type
from diffattn.model.tokenizer import build_tokenizer

TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
        "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n") * 3

#: Every served type and the settings each recipe must get right. d_model 128: Q/K widths 32 (standard, V2,
#: ALiBi: 4 heads) and 32 (V1 family: 2 diff-heads, served at 64), both widths the CPU backend takes.
CASES: dict[str, dict] = {
    "standard": dict(attention="standard", n_heads=4, n_kv_heads=2, rope="neox"),
    "diff": dict(attention="diff", n_heads=2, n_kv_heads=1, n_layers=3),  # paper: norm, λ_init per depth, GQA
    # every other V1 setting in one model: no per-head norm, constant λ_init, NeoX RoPE, explicit head width,
    # biases, timm's qk_norm and dual_lambda
    "diff_options": dict(attention="diff", n_heads=2, rope="neox", head_dim=32, bias=True,
                         attn_options={"subln": False, "lambda_init": 0.5, "qk_norm": True, "dual_lambda": True}),
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


#: Each family as transformers builds it (its own config class; no download), at a head width vLLM's CPU attention
#: takes (32), with what sets it apart on: q/k/v biases and a window on its last layer (qwen2), QK-norm (qwen3),
#: a window on every layer and MQA (mistral), Gemma 3's all (1 + w) norms before and after, GeGLU, √d
#: embeddings, query_pre_attn_scalar, QK-norm, a local layer with its own RoPE base and a global one with linear
#: RoPE scaling, a head width ≠ d_model / heads), Phi-3's fused projections. Windows of 12 are shorter than the
#: prompts, and than the 32-token chunks and cache blocks.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=12,
                                  max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=12, num_key_value_heads=1, tie_word_embeddings=False)),
    # untied: tied, its √d-scaled embeddings dwarf the blocks' normed outputs and each token's own logit wins by
    # ~25 (log-probabilities of exactly 0, nothing to compare)
    "gemma3_text": ("Gemma3TextConfig", dict(hidden_size=96, head_dim=32, num_key_value_heads=1,
                                             tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=12,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters=GEMMA3_ROPE)),
    "phi3": ("Phi3Config", dict(sliding_window=12, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
_FAMILY_BASE = dict(hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)


def tokenizer():
    return build_tokenizer("char", TEXT)


def family_folder(family: str, vocab_size: int, out: Path, seed: int = 0) -> Path:
    """A tiny random transformers model of ``family`` saved by transformers in ``out``: its weights at
    ``initializer_range`` 0.3 (peaked logits, so greedy choices have margins) and its norm gains and biases
    moved off their init, so a wrong mapping shows."""
    import transformers  # the test extra has it

    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_FAMILY_BASE, "vocab_size": vocab_size, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    return save_hf(nudged(model, 0.3, vectors_only=True), out)


def family_model(family: str, attention: str, vocab_size: int, tmp: Path, seed: int = 0) -> TransformerLM:
    """``family`` read into diffattn as ``convert --to standard`` reads it (``attention="standard"``), or its exact
    conversion to ``attention`` (``convert --to``) with the λ vectors and norm gains then moved off the recipe's
    values (as :func:`tiny_model`'s), so that a wrong mapping of them shows; :data:`FROM_SCRATCH` types: a model
    of the family's options at random."""
    from diffattn import load_pretrained
    from diffattn.interop.convert import convert

    std = load_pretrained(family_folder(family, vocab_size, tmp / family, seed)).float().eval()
    if attention == "standard":
        return std
    torch.manual_seed(seed)
    if attention in FROM_SCRATCH:
        cfg = std.config.replace(attention=attention, n_heads=4, n_kv_heads=1, head_dim=32, init_std=0.3)
        return _perturbed(TransformerLM(cfg).eval())
    return _perturbed(convert(std, attention, seed=seed).eval())


#: Types served here with a family's options from a model trained from scratch, not converted: GDA's exact
#: recipe needs source heads that form its groups (3 signal heads per noise head), which these tiny sources lack.
FROM_SCRATCH = ("grouped_diff",)


def tiny_model(case: str, vocab_size: int, seed: int = 0) -> TransformerLM:
    """CASES[case] at d_model 128, 2 layers, context 128. Larger init (0.3) peaks the logits, so greedy choices
    have margins; λ vectors, norm gains and a type's other per-head parameters (sinks) are pushed off their init,
    so a wrong mapping shows."""
    kw = dict(vocab_size=vocab_size, d_model=128, n_layers=2, max_seq_len=128, init_std=0.3)
    kw.update(CASES[case])
    torch.manual_seed(seed)
    return _perturbed(TransformerLM(ModelConfig(**kw)).eval())


def _perturbed(model: TransformerLM) -> TransformerLM:
    gain = 0.0 if model.config.norm_unit_offset else 1.0  # Gemma's norms hold w of the gain 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda_" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(("norm.weight", "subln.weight")):
                p.copy_(gain + 0.3 * torch.randn_like(p))
            elif p.dim() == 1 and name.rsplit(".", 1)[-1] not in ("weight", "bias"):
                p.add_(torch.randn_like(p))
    return model


#: Family cases, "family:type": every family read as it is (standard) and as V1 and V2 with its options in fp32;
#: gated attention and GDA with Gemma 3's (all of them). bf16 (:data:`FAMILY_BF16`): every family's standard
#: model, V1 and V2 with Qwen3's and Gemma 3's options.
FAMILY_CASES = ([f"{f}:{t}" for f in FAMILIES for t in ("standard", "diff", "diff_v2")]
                + ["gemma3_text:gated", "gemma3_text:grouped_diff"])
FAMILY_BF16 = [f"{f}:standard" for f in FAMILIES] + [f"{f}:{t}" for f in ("qwen3", "gemma3_text")
                                                     for t in ("diff", "diff_v2")]


#: Selective retrofits (issue 41), "mixed:type": a standard model (CASES["standard"], 3 layers, 4 heads) whose
#: heads 0 and 2 of layer 1 are retrofitted to the type (``--retrofit.heads 1.0,1.2``: heads 1 and 3 of that layer
#: are standard heads of the type's layer, ``diff_heads``) and the other layers stay standard, at the end of its
#: schedule; V1's layer caches [K1|K2] at 2d beside the standard layers' d, V2's 2h query heads read the standard
#: layers' cache shape.
MIXED_CASES = ["mixed:diff", "mixed:diff_v2"]


def mixed_model(to: str, vocab_size: int, seed: int = 0) -> TransformerLM:
    """CASES["standard"] at 3 layers with heads 0 and 2 of layer 1 retrofitted to ``to`` (``retrofit_model``, the
    plain type), its λ vectors and norm gains then moved off the recipe's values (as :func:`tiny_model`'s)."""
    from diffattn.configs.retrofit import RetrofitConfig
    from diffattn.train.retrofit import retrofit_model

    kw = dict(vocab_size=vocab_size, d_model=128, n_layers=3, max_seq_len=128, init_std=0.3, **CASES["standard"])
    torch.manual_seed(seed)
    source = TransformerLM(ModelConfig(**kw)).eval()
    model, _ = retrofit_model(source, RetrofitConfig(to=to, heads=["1.0", "1.2"]), seed=seed)
    return _perturbed(model.eval())


def case_model(case: str, vocab_size: int, tmp: Path) -> TransformerLM:
    """The model of ``case``: a selective retrofit ("mixed:type", :func:`mixed_model`), a family case
    ("family:type", :func:`family_model`) or a type's (:func:`tiny_model`)."""
    if case.startswith("mixed:"):
        return mixed_model(case.split(":")[1], vocab_size)
    if ":" in case:
        family, attention = case.split(":")
        return family_model(family, attention, vocab_size, tmp)
    return tiny_model(case, vocab_size)


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
