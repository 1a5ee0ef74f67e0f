"""Each family converted exactly to every type with a recipe (issue 40): a tiny random model of each family, built
with transformers' own config class (no download), read by ``read_hf_folder`` and converted by ``convert`` to
``standard``, ``diff``, ``diff_v2``, ``gated`` and ``grouped_diff`` computes transformers' logits in fp32 (max |Δ|
printed with ``-s``: the figures the families results page cites) and generates its greedy tokens. The converted
models train (a few steps move the recipes' new tensors and keep the options), and GDA's shape condition is
refused in one line.

    python -m pytest -q -n 0 -s tests/interop/test_families_convert.py -k logits
"""

from __future__ import annotations

import pytest
import torch
from hfsave import GEMMA3_ROPE

transformers = pytest.importorskip("transformers")

from diffattn.interop.convert import convert, converted_config  # noqa: E402
from diffattn.interop.hf import from_hf  # noqa: E402
from diffattn.model.generate import generate  # noqa: E402

TOL = 1e-4  # fp32, three layers of random weights: rounding is ~1e-6
TYPES = ("standard", "diff", "diff_v2", "gated", "grouped_diff")
# 6 query heads over 2 KV heads (or 1): GDA's 2 noise heads (one per 3 signal heads) sit on the source's KV heads
_BASE = dict(vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
#: One tiny config per family, what sets it apart turned on: biases (q/k/v only, and q/k/v/o), QK-norm, windows
#: shorter than the test's sequences on some layers or all, MQA, head widths that are not hidden / heads, Gemma 3's
#: scalar, norms and RoPE bases, Phi-3's fused projections.
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=7,
                                  max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=12, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=7, num_key_value_heads=1)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=12, num_key_value_heads=1, query_pre_attn_scalar=20,
                                             sliding_window=6, layer_types=["sliding_attention",
                                                                            "sliding_attention",
                                                                            "full_attention"],
                                             rope_parameters=GEMMA3_ROPE)),
    "phi3": ("Phi3Config", dict(sliding_window=7, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def hf_model(name: str, seed: int = 0, **override):
    """A tiny random transformers model of family ``name`` in fp32, eval mode, its norm gains and biases moved off
    their init (ones / zeros would hide a wrong mapping)."""
    cls_name, extra = FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra, **override})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def sources() -> dict:
    out = {}
    for name in FAMILIES:
        hf = hf_model(name)
        out[name] = hf, from_hf(hf)
    return out


@pytest.mark.parametrize("to", TYPES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_conversion_computes_the_source_logits(sources, name, to, one_thread) -> None:
    hf, ours = sources[name]
    model = convert(ours, to)
    assert model.config.attention == to and model.config.family_options() == ours.config.family_options()
    ids = torch.randint(0, _BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"\n{name} --to {to}: max |Δlogits| {err:.2g} vs {type(hf).__name__} (fp32, 2 × 24 tokens)")
    assert err < TOL
    prompt = [5, 17, 33, 2, 41, 8, 60, 12, 3]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[0, len(prompt):].tolist()
    assert generate(model, prompt, 12, temperature=0) == want


def test_the_family_options_matter_to_the_conversions(sources, one_thread) -> None:
    """The checks above can fail: a converted model without a bias, its QK-norm or its window computes other
    logits."""
    ids = torch.randint(0, _BASE["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    for name, part in [("qwen2", "q_proj.bias"), ("llama", "out_proj.bias"), ("qwen3", "k_norm.weight")]:
        hf, ours = sources[name]
        for to in ("diff", "diff_v2", "gated", "grouped_diff"):
            model = convert(ours, to)
            with torch.no_grad():
                want = model(ids)
                getattr(model.blocks[0].attn, part.split(".")[0]).get_parameter(part.split(".")[1]).mul_(1.5)
                assert (model(ids) - want).abs().max() > 1e-3, (name, to, part)
    model = convert(sources["mistral"][1], "diff")
    with torch.no_grad():
        want = model(ids)
        for block in model.blocks:
            block.attn.window = None
        assert (model(ids) - want).abs().max() > 1e-3


@pytest.mark.parametrize("to", TYPES[1:])
def test_a_converted_family_model_trains(sources, to, one_thread) -> None:
    """A few AdamW steps on a converted Gemma 3 (QK-norm, windows, scalar, post norms) and Qwen2 (biases): the loss
    falls and the options stay what they were."""
    ids = torch.randint(0, _BASE["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(3))
    for name in ("gemma3_text", "qwen2"):
        model = convert(sources[name][1], to).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(4):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (name, to, losses)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert model.config.family_options() == sources[name][1].config.family_options()


def test_gda_needs_the_kv_heads_to_divide_the_noise_heads(one_thread) -> None:
    """4 query heads over 2 KV heads: 3 does not divide 4 (and a 6-head MHA's 2 noise heads cannot sit on 6 KV
    heads): one line naming the condition."""
    for override in (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12),
                     dict(num_key_value_heads=6)):
        cfg = from_hf(hf_model("qwen2", **override)).config
        with pytest.raises(ValueError, match="--to grouped_diff turns the .* source heads into signal heads") as e:
            converted_config(cfg, "grouped_diff")
        assert "\n" not in str(e.value)


def test_share_keeps_one_copy_of_what_conversion_does_not_change(sources, one_thread) -> None:
    """``share=True`` (what the command line does): the embeddings, norms and MLP are the source's tensors; by
    default they are copies, and training the conversion leaves the source alone."""
    _, ours = sources["gemma3_text"]
    shared, copied = convert(ours, "diff", share=True), convert(ours, "diff")
    emb = ours.body.tok_emb.weight
    assert shared.body.tok_emb.weight.data_ptr() == emb.data_ptr()
    assert copied.body.tok_emb.weight.data_ptr() != emb.data_ptr()
    assert shared.lm_head.weight is shared.body.tok_emb.weight  # still tied: one parameter
    assert copied.blocks[0].ffn.state_dict().keys() == ours.blocks[0].ffn.state_dict().keys()
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(copied.blocks[0].ffn.parameters(),
                                                            ours.blocks[0].ffn.parameters()))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dint_converts_a_family_without_windows_and_refuses_one_with(sources, name, one_thread) -> None:
    """DINT takes V1's recipe; its integral reaches past a window, so a windowed family is refused in one line."""
    hf, ours = sources[name]
    if ours.config.sliding_window is not None:
        with pytest.raises(ValueError, match="sliding_window is not defined for attention 'dint'") as e:
            convert(ours, "dint")
        assert "\n" not in str(e.value)
        return
    ids = torch.randint(0, _BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (convert(ours, "dint")(ids) - hf(ids).logits).abs().max().item()
    print(f"\n{name} --to dint: max |Δlogits| {err:.2g} vs {type(hf).__name__} (fp32, 2 × 24 tokens)")
    assert err < TOL
