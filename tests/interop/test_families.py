"""The transformers families read exactly (issue 40): a tiny random model of each family, built with transformers'
own config class (no download) and saved by it, read by ``read_hf_folder`` (what every command reads) computes the
source's logits in fp32 (max |Δ| printed with ``-s``: the figures the families page cites), generates the same
greedy tokens as ``AutoModelForCausalLM.generate``, and exports back to its own class with the same logits.

    python -m pytest -q -n 0 -s tests/interop/test_families.py -k logits
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hfsave import GEMMA3_ROPE

transformers = pytest.importorskip("transformers")

from diffattn.checkpoint.hf_families import family_config  # noqa: E402
from diffattn.checkpoint.hf_family_table import FAMILIES as RECORDS  # noqa: E402
from diffattn.interop.hf import (  # noqa: E402
    from_hf,
    read_hf_folder,  # noqa: E402
    to_hf,
    to_hf_config,
)
from diffattn.model.generate import generate, generate_batch  # noqa: E402

TOL = 1e-4  # fp32, a few layers of random weights: rounding is ~1e-6
_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
#: One tiny config per family, each with what sets it apart turned on (a window shorter than the test's 24
#: tokens, head widths that are not hidden_size / heads, MQA, tied and untied embeddings).
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=7, num_key_value_heads=1)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=24, num_key_value_heads=1, query_pre_attn_scalar=20,
                                             sliding_window=6, layer_types=["sliding_attention",
                                                                            "sliding_attention",
                                                                            "full_attention"],
                                             rope_parameters=GEMMA3_ROPE)),
    "phi3": ("Phi3Config", dict(sliding_window=7, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def hf_model(name: str, seed: int = 0):
    """A tiny random transformers model of family ``name`` in fp32, eval mode, its norm gains and biases moved off
    their init (ones / zeros would hide a wrong mapping)."""
    cls_name, extra = FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    transformers.utils.logging.disable_progress_bar()
    try:
        for name in FAMILIES:
            model = hf_model(name)
            model.save_pretrained(root / name)
            out[name] = root / name, model
    finally:
        transformers.utils.logging.enable_progress_bar()
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_read_model_computes_the_source_logits(folders, name, one_thread) -> None:
    folder, hf = folders[name]
    ours = read_hf_folder(folder)
    ids = torch.randint(0, _BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"\n{name}: max |Δlogits| {err:.2g} ({type(hf).__name__}, fp32, 2 × 24 tokens)")
    assert err < TOL
    if ours.config.sliding_window is not None:  # the window bites here: without it the logits are others
        unwindowed = read_hf_folder(folder)
        for block in unwindowed.blocks:
            block.attn.window = None
        with torch.no_grad():
            assert (unwindowed(ids) - hf(ids).logits).abs().max() > 1e-3
    family = hf.config.model_type
    assert ours.config.family == (None if family == "llama" else family)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_text_equals_transformers_generate(folders, name, one_thread) -> None:
    folder, hf = folders[name]
    ours = read_hf_folder(folder)
    prompt = torch.tensor([[5, 17, 33, 2, 41, 8, 60, 12, 3]])
    new = 14  # past the windows (6, 7): the cached keys behind them are masked
    want = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[0, prompt.shape[1]:].tolist()
    assert generate(ours, prompt[0].tolist(), new, temperature=0) == want


def test_batched_generation_with_windows_equals_one_prompt_at_a_time(folders, one_thread) -> None:
    """Left-padded rows on the KV cache, a window on each layer (Mistral) and on the local layers (Gemma 3)."""
    for name in ("mistral", "gemma3_text"):
        model = read_hf_folder(folders[name][0])
        prompts = [[5, 17, 33, 2, 41, 8, 60, 12, 3, 9, 11], [7, 1, 4]]
        rows = generate_batch(model, prompts, 12)
        assert rows == [generate(model, p, 12, temperature=0) for p in prompts], name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_export_writes_the_family_back(folders, name, one_thread) -> None:
    folder, hf = folders[name]
    ours = read_hf_folder(folder, rope="interleaved")  # the q/k rows reordered and back: exact both ways
    back = to_hf(ours)
    assert type(back) is type(hf)
    ids = torch.randint(0, _BASE["vocab_size"], (2, 24))
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() < TOL
    again = from_hf(back)
    assert again.config == read_hf_folder(folder).config
    sd = hf.state_dict()
    for k, v in back.state_dict().items():
        if k in sd:
            torch.testing.assert_close(v, sd[k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_our_defaults_are_transformers_defaults(name) -> None:
    """A key a config.json leaves out is read as transformers' config class reads it."""
    cls = RECORDS[name].config_class
    minimal = dict(model_type=name, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
    theirs = getattr(transformers, cls)(**{k: v for k, v in minimal.items() if k != "model_type"})
    assert family_config(minimal) == family_config(theirs.to_dict())


def test_config_checks_name_the_field() -> None:
    from diffattn.model.config import ModelConfig

    base = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, attention="standard")
    for field, value, said in [("sliding_window", 0, "sliding_window must be"),
                               ("sliding_window", 10**12, "sliding_window must be"),
                               ("rope_local_theta", -1.0, "rope_local_theta must be a finite number > 0"),
                               ("query_pre_attn_scalar", float("nan"), "query_pre_attn_scalar must be"),
                               ("rope_factor", float("inf"), "rope_factor must be"),
                               ("norm_eps", float("nan"), "norm_eps must be"),
                               ("mlp_activation", "relu", "mlp_activation must be one of"),
                               ("window_layers", [5], "window_layers names the sliding-window layers")]:
        with pytest.raises(ValueError, match=said) as e:
            ModelConfig(**base, **{field: value})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="window_layers must list distinct layer indices from 0 to 1"):
        ModelConfig(**base, sliding_window=4, window_layers=[0, 2])
    old = ModelConfig.from_dict({k: v for k, v in ModelConfig(**base).to_dict().items()
                                 if k in ("vocab_size", "d_model", "n_layers", "n_heads", "attention")})
    assert old == ModelConfig(**base) and old.family is None and old.sliding_window is None


def test_to_hf_config_is_the_family_class() -> None:
    for name, (cls_name, extra) in FAMILIES.items():
        src = getattr(transformers, cls_name)(**{**_BASE, **extra})
        assert type(to_hf_config(family_config(src))) is type(src), name


def test_a_few_layers_of_a_windowed_config_keep_their_windows() -> None:
    """shapes (one block) and plan (three) build the first layers of a config whose window names later layers."""
    from diffattn.model.config import ModelConfig
    from diffattn.model.shapes import weights_mismatch
    from diffattn.model.transformer import TransformerLM

    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=5, n_heads=2, attention="standard", sliding_window=4,
                      window_layers=[0, 3, 4], rope_local_theta=100.0, qk_norm=True, qkv_bias=True)
    assert cfg.first_layers(3).window_layers == [0] and cfg.first_layers(1).layer_window(0) == 4
    shapes = {k: tuple(v.shape) for k, v in TransformerLM(cfg).state_dict().items()}
    assert weights_mismatch(cfg, shapes) is None
    shapes.pop("body.blocks.3.attn.q_norm.weight")
    assert weights_mismatch(cfg, shapes) == "the weights lack body.blocks.3.attn.q_norm.weight"
