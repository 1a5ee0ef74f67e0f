"""diffattn.interop.hf: exact conversion to/from transformers' LlamaForCausalLM / DiffLlamaForCausalLM."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from diffattn import ModelConfig, TransformerClassifier, TransformerLM

transformers = pytest.importorskip("transformers")
from diffattn.interop.hf import from_hf, from_hf_config, to_hf, to_hf_config  # noqa: E402

TOL = 1e-4
VOCAB = 61
IMPLS = ("eager", "sdpa")


def make_model(attention: str, rope: str = "interleaved", n_kv_heads: int | None = None, tie: bool = True,
               seed: int = 0, n_heads: int = 4, **kw) -> TransformerLM:
    """A tiny fp32 model whose norm gains, subln gains and λ vectors are pushed well away from their init, so
    any wrong mapping of them shows in the logits. Three layers, so λ_init differs per layer."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      attention=attention, rope=rope, max_seq_len=32, tie_embeddings=tie, init_std=0.1, **kw)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("subln.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif "lambda_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def ids(seed: int = 1, b: int = 2, t: int = 19) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_diff(ours: torch.nn.Module, hf: torch.nn.Module, x: torch.Tensor) -> float:
    a, b = ours(x), hf(x).logits
    assert a.shape == b.shape
    return (a - b).abs().max().item()


CASES = [(att, rope, kv, tie) for att in ("standard", "diff") for rope in ("interleaved", "neox")
         for kv, tie in ((None, True), (2, False), (2, True), (None, False))]


@pytest.mark.parametrize("attention,rope,kv,tie", CASES)
def test_export_matches_hf_logits(attention, rope, kv, tie):
    model = make_model(attention, rope, kv, tie)
    x = ids()
    for impl in IMPLS:
        hf = to_hf(model, attn_implementation=impl)
        assert hf.config._attn_implementation == impl
        expected = "DiffLlamaForCausalLM" if attention == "diff" else "LlamaForCausalLM"
        assert type(hf) is getattr(transformers, expected)
        tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        assert tied == tie
        assert max_diff(model, hf, x) < TOL, (attention, rope, kv, tie, impl)


@pytest.mark.parametrize("attention,rope,kv,tie", CASES[::2])
def test_round_trip_ours_hf_ours(attention, rope, kv, tie):
    model = make_model(attention, rope, kv, tie, seed=3)
    x = ids(2)
    with torch.no_grad():
        want = model(x)
    hf = to_hf(model)
    for back_rope in ("neox", "interleaved"):
        back = from_hf(hf, rope=back_rope)
        assert back.config == model.config.replace(rope=back_rope)
        with torch.no_grad():
            assert (back(x) - want).abs().max().item() < TOL
    # Importing with the original RoPE style inverts every re-layout exactly: the q/k/v weights come back
    # bit for bit (DIFF's subln gain stays folded into out_proj, so those two differ).
    back = from_hf(hf, rope=rope)
    sd0, sd1 = model.state_dict(), back.state_dict()
    assert sd0.keys() == sd1.keys()
    for name in sd0:
        if attention == "diff" and name.endswith(("out_proj.weight", "subln.weight")):
            continue
        assert torch.equal(sd0[name], sd1[name]), name
    if attention == "diff":
        for b in back.blocks:
            assert torch.equal(b.attn.subln.weight, torch.ones_like(b.attn.subln.weight))


@pytest.mark.parametrize("attention,n_sub,n_kv_sub", [("standard", 4, 4), ("standard", 8, 2), ("diff", 8, 8),
                                                       ("diff", 8, 4), ("diff", 8, 2)])
def test_import_native_hf_model(attention, n_sub, n_kv_sub):
    """A model built by transformers itself (its own init), imported, reproduces HF's logits; and exporting
    the import gives back HF's state dict exactly."""
    torch.manual_seed(5)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=n_sub, num_key_value_heads=n_kv_sub, max_position_embeddings=32,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-6,
                  initializer_range=0.1, tie_word_embeddings=False)
    if attention == "diff":
        hf_cfg = transformers.DiffLlamaConfig(**common, lambda_std_dev=0.3)
        cls = transformers.DiffLlamaForCausalLM
    else:
        hf_cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    hf = cls._from_config(hf_cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layernorm" in name or name == "model.norm.weight":
                p.copy_(1 + 0.5 * torch.randn_like(p))
    x = ids(4)
    for rope in ("neox", "interleaved"):
        ours = from_hf(hf, rope=rope)
        assert ours.config.attention == attention and ours.config.rope == rope
        assert ours.config.rope_theta == 5000.0 and ours.config.norm_eps == 1e-6 and ours.config.ffn_dim == 96
        assert ours.config.n_heads * (2 if attention == "diff" else 1) == n_sub
        assert max_diff(ours, hf, x) < TOL
        again = to_hf(ours).state_dict()
        ref = hf.state_dict()
        assert again.keys() == ref.keys()
        for name in ref:
            assert torch.equal(again[name], ref[name]), (rope, name)


def test_config_round_trip_and_fields():
    cfgs = [
        ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, attention="diff", max_seq_len=77,
                    rope_theta=500000.0, norm_eps=1e-6, attn_options={"lambda_std": 0.05}, init_std=0.03),
        ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="diff",
                    ffn_hidden=100, tie_embeddings=False),
        ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, attention="standard",
                    rope="neox"),
    ]
    for cfg in cfgs:
        hf_cfg = to_hf_config(cfg)
        split = 2 if cfg.attention == "diff" else 1
        assert hf_cfg.num_attention_heads == split * cfg.n_heads
        assert hf_cfg.num_key_value_heads == split * cfg.kv_heads
        assert hf_cfg.head_dim * hf_cfg.num_attention_heads == cfg.d_model
        assert hf_cfg.intermediate_size == cfg.ffn_dim
        assert hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
        assert hf_cfg.rms_norm_eps == cfg.norm_eps
        assert hf_cfg.max_position_embeddings == cfg.max_seq_len
        assert hf_cfg.tie_word_embeddings == cfg.tie_embeddings
        if cfg.attention == "diff":
            assert hf_cfg.lambda_std_dev == cfg.options.lambda_std
        assert from_hf_config(hf_cfg, rope=cfg.rope) == cfg


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """Swap the first and second half of the sub-heads of a (n_sub·d, E) weight (Q1 <-> Q2 in DiffLlama)."""
    return torch.cat(w.chunk(2, dim=0)[::-1])


@torch.no_grad()
def test_wrong_layouts_break_parity():
    """The parity tests can fail: each plausible wrong mapping moves the logits far beyond the tolerance."""
    model = make_model("diff", "interleaved", n_kv_heads=2, seed=7)
    x = ids(8)
    hf = to_hf(model)
    assert max_diff(model, hf, x) < TOL
    attn0 = hf.model.layers[0].self_attn
    d = hf.config.head_dim

    # (a) Q1 and Q2 swapped in one layer (λ then subtracts the wrong map).
    w = attn0.q_proj.weight.clone()
    attn0.q_proj.weight.copy_(_swap_halves(w))
    assert max_diff(model, hf, x) > 100 * TOL
    attn0.q_proj.weight.copy_(w)

    # (b) V halves swapped: [v_g ; v_{g+hkv}] becomes [v_{g+hkv} ; v_g].
    w = attn0.v_proj.weight.clone()
    attn0.v_proj.weight.copy_(_swap_halves(w))
    assert max_diff(model, hf, x) > 100 * TOL
    attn0.v_proj.weight.copy_(w)
    assert max_diff(model, hf, x) < TOL

    # (c) Our official (pairs-adjacent) q/k/v copied without re-layout.
    naive = to_hf(model)
    for blk, hblk in zip(model.blocks, naive.model.layers):
        perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
        for name in ("q_proj", "k_proj"):
            w = getattr(blk.attn, name).weight
            getattr(hblk.self_attn, name).weight.copy_(w.view(-1, d, w.shape[1])[:, perm].reshape(w.shape))
        hblk.self_attn.v_proj.weight.copy_(blk.attn.v_proj.weight)
    assert max_diff(model, naive, x) > 100 * TOL

    # (d) RoPE reordering forgotten: interleaved-RoPE weights run under HF's NeoX RoPE.
    for m in (make_model("diff", "interleaved", seed=9), make_model("standard", "interleaved", seed=9)):
        hf = to_hf(m)
        dd = hf.config.head_dim
        inv = torch.argsort(torch.cat((torch.arange(0, dd, 2), torch.arange(1, dd, 2))))
        for layer in hf.model.layers:
            for name in ("q_proj", "k_proj"):
                lin = getattr(layer.self_attn, name)
                w = lin.weight
                lin.weight.copy_(w.view(-1, dd, w.shape[1])[:, inv].reshape(w.shape))
        assert max_diff(m, hf, x) > 100 * TOL

    # (e) subln gain dropped instead of folded into o_proj.
    hf = to_hf(model)
    for blk, layer in zip(model.blocks, hf.model.layers):
        layer.self_attn.o_proj.weight.copy_(blk.attn.out_proj.weight)
    assert max_diff(model, hf, x) > 100 * TOL


@torch.no_grad()
def test_cached_generation_matches():
    """HF's cached greedy decoding (DynamicCache, V split per step) agrees with our static-cache decoding."""
    for attention in ("diff", "standard"):
        model = make_model(attention, "interleaved", n_kv_heads=2, seed=11)
        hf = to_hf(model, attn_implementation="sdpa")
        prompt, steps = ids(12, b=1, t=6), 5
        out = hf.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        model.setup_cache(1, 16)
        logits = model(prompt, input_pos=torch.arange(6))[:, -1]
        for i in range(steps):
            assert (logits - out.logits[i]).abs().max().item() < TOL
            nxt = logits.argmax(-1, keepdim=True)
            assert nxt.item() == out.sequences[0, 6 + i].item()
            logits = model(nxt, input_pos=torch.tensor([6 + i]))[:, -1]
        model.clear_cache()


def test_unsupported_settings_are_refused():
    base = dict(vocab_size=50, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match="lambda_init"):
        to_hf(TransformerLM(ModelConfig(**base, attention="diff", attn_options={"lambda_init": 0.8})))
    with pytest.raises(ValueError, match="rope='none'"):
        to_hf(TransformerLM(ModelConfig(**base, attention="diff", rope="none")))
    with pytest.raises(ValueError, match="bias"):  # DiffLlama has no biases (Llama has: issue 40)
        to_hf(TransformerLM(ModelConfig(**base, attention="diff", bias=True)))
    with pytest.raises(ValueError, match=r"qk_norm=True \(DiffLlamaForCausalLM has False\)"):
        to_hf_config(ModelConfig(**base, attention="diff", qk_norm=True))
    with pytest.raises(ValueError, match=r"post_attn_norm=True \(Qwen2ForCausalLM has False\)"):
        to_hf_config(ModelConfig(**base, attention="standard", family="qwen2", qkv_bias=True, post_attn_norm=True))
    with pytest.raises(ValueError, match="dropout"):
        to_hf_config(ModelConfig(**base, attention="standard", dropout=0.1))
    with pytest.raises(ValueError, match="diff_v2"):
        to_hf_config(ModelConfig(**base, attention="diff_v2"))
    with pytest.raises(TypeError, match="TransformerLM"):
        to_hf(TransformerClassifier(ModelConfig(**base, attention="standard"), num_classes=3))
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        from_hf(torch.nn.Linear(2, 2))

    hf_base = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64, "rope_theta": 1e4}
        from_hf_config(transformers.LlamaConfig(**hf_base, rope_parameters=scaled))
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}  # linear scaling is read (issue 40)
    assert from_hf_config(transformers.LlamaConfig(**hf_base, rope_parameters=linear)).rope_factor == 2.0
    biased = from_hf_config(transformers.LlamaConfig(**hf_base, attention_bias=True))
    assert (biased.attn_qkv_bias, biased.attn_out_bias, biased.bias) == (True, True, False)
    with pytest.raises(ValueError, match="hidden activation 'gelu'"):
        from_hf_config(transformers.LlamaConfig(**hf_base, hidden_act="gelu"))
    # a head width not tied to hidden_size is kept (ModelConfig.head_dim), not refused
    assert from_hf_config(transformers.LlamaConfig(**hf_base, head_dim=16)).head_dim == 16
    with pytest.raises(ValueError, match="rope must be"):
        from_hf_config(transformers.LlamaConfig(**hf_base), rope="none")


def test_import_diffattn_does_not_import_transformers():
    code = "import diffattn, sys; assert 'transformers' not in sys.modules, 'transformers imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("attention", ["standard", "diff"])
def test_shared_qk_exports_with_k_equal_to_q(attention: str) -> None:
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, attention=attention,
                      rope="neox", shared_qk=True)
    model = TransformerLM(cfg).eval()
    hf = to_hf(model).eval()
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4


def test_a_missing_transformers_names_the_version_and_the_extra(monkeypatch):
    """The error said `transformers (>= 5)` while the test extra asked for >=4.48, and no extra installed it for a
    user who ran only the first set-up command (issue 25, item 10)."""
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from diffattn.interop import hf

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ImportError) as e:
        to_hf(TransformerLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2)))
    assert str(e.value) == ('diffattn.interop.hf needs the `transformers` package (>=5); install it with `pip install '
                            '-e ".[hf]"` in the diffattn checkout, or `pip install "transformers>=5"`')
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert f"transformers{hf.TRANSFORMERS}" in extras["hf"] and f"transformers{hf.TRANSFORMERS}" in extras["test"]
