"""The attention registry: a new variant is one file. A throwaway variant, written as a single file into a
temporary package, registers itself on import, builds a TransformerLM and trains one step, reads its own typed
options, is exported by class name, shows up in the backend choice and in ``diffattn doctor``, and carries its
conversion recipe and its vLLM layer (``convert`` makes it exactly from a standard model, ``export --to vllm``
serves it); nothing else is touched. Also: the built-in variants' report labels and plot colours come from their
registry entries."""

from __future__ import annotations

import argparse
import sys
import textwrap

import pytest
import torch

import diffattn
import diffattn.attention as attention_pkg
from diffattn.attention.registry import (
    ATTENTION,
    attention_color,
    attention_label,
    build_attention,
    register,
    unregister,
)
from diffattn.cli import doctor
from diffattn.experiments.plots import color_for
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends

# A complete variant: its reference op, its fast op, its module and its registry entry, in one file. The math is
# standard attention with a learnable per-head temperature, so it differs from every built-in type.
VARIANT = '''
"""Throwaway test variant: softmax(QKᵀ·scale·exp(t_h))·V with a learnable temperature per head."""

from dataclasses import dataclass

import torch
import torch.nn as nn

from diffattn.attention.base import AttentionBase, merge_heads, split_heads
from diffattn.attention.conversion import Conversion
from diffattn.attention.registry import converts, register, serves
from diffattn.attention.standard import StandardServed
from diffattn.ops.core import build_mask, masked_softmax, repeat_kv, sdpa


def tempered_attention_ref(q, k, v, t, *, causal=True, attn_mask=None, offset=0):
    """Materialized: q (B, H, Tq, D), k, v (B, Hkv, Tk, D), t (H,) -> (B, H, Tq, D)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 * t.exp()[:, None, None]
    mask = build_mask(q.shape[-2], k.shape[-2], causal=causal, offset=offset, attn_mask=attn_mask, device=q.device)
    return masked_softmax(logits, mask) @ v


def tempered_attention(q, k, v, t, *, causal=True, attn_mask=None, offset=0):
    """Fast: the temperature folded into q, one SDPA call."""
    q = q * t.exp().to(q.dtype)[:, None, None]
    return sdpa(q, k, v, causal=causal, offset=offset, attn_mask=attn_mask, scale=None)


@dataclass(frozen=True)
class TemperedOptions:
    temperature_init: float = 0.0


@register("{name}", label="Tempered", color="#000000")
class TemperedAttention(AttentionBase):
    Options = TemperedOptions
    functional_ops = (tempered_attention, tempered_attention_ref)

    def __init__(self, embed_dim, num_heads, temperature_init=0.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.rope_dim = self.head_dim
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.temperature = nn.Parameter(torch.full((num_heads,), temperature_init))

    @classmethod
    def from_config(cls, cfg, layer_idx):
        return cls(cfg.d_model, cfg.n_heads, cfg.options.temperature_init)

    def cache_shapes(self, batch_size, max_seq_len):
        shape = (batch_size, self.num_heads, max_seq_len, self.head_dim)
        return shape, shape

    def forward(self, x, rope=None, input_pos=None, attn_mask=None, causal=True):
        q, k, v = (split_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        if rope is not None:
            q, k = rope(q), rope(k)
        k, v = self.kv(k, v, input_pos)
        margs = self.mask_args(causal, attn_mask, input_pos, k.shape[2])
        op = tempered_attention_ref if self.reference_path else tempered_attention
        return self.out_proj(merge_heads(op(q, k, v, self.temperature, **margs)))


@converts(TemperedAttention)
class TemperedConversion(Conversion):
    """Exact at t = 0 (exp(0) = 1), where ∂L/∂t is not 0."""

    @classmethod
    def weights(cls, src, new, *, init, gen, break_symmetry):
        qkv = torch.cat([src[n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
        return {"qkv.weight": qkv, "out_proj.weight": src["out_proj.weight"],
                "temperature": torch.zeros_like(new.temperature)}

    @classmethod
    def created(cls, attn, get):
        return {"temperature": get(attn.temperature)}


@serves(TemperedAttention)
class TemperedServed(StandardServed):
    """Served as standard attention: exp(t_h) folded into head h's query rows."""

    as_type = "standard"

    @classmethod
    def weights(cls, module):
        q, k, v = module.qkv.weight.detach().chunk(3)
        scale = module.temperature.detach().exp().repeat_interleave(module.head_dim)[:, None]
        return {"q_proj.weight": q * scale, "k_proj.weight": k, "v_proj.weight": v,
                "out_proj.weight": module.out_proj.weight}
'''


@pytest.fixture
def variant_package(tmp_path, monkeypatch):
    """A temporary package holding only the variant's file, on sys.path; the registry entry and the imported
    modules are removed afterwards."""
    name, pkg = "throwaway_tempered", "tmp_attention_variants"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "tempered.py").write_text(textwrap.dedent(VARIANT).replace("{name}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg, name
    unregister(name)
    for mod in [m for m in sys.modules if m == pkg or m.startswith(pkg + ".")]:
        del sys.modules[mod]


def test_a_variant_is_one_file_and_trains(variant_package):
    pkg, name = variant_package
    assert name not in ATTENTION
    (mod,) = attention_pkg.import_submodules(pkg)  # what diffattn.attention does for its own files
    assert ATTENTION[name] is mod.TemperedAttention
    assert attention_label(name) == "Tempered" and color_for(name) == "#000000"

    # reference and fast op agree, and the module runs both
    q, k, v, t = torch.randn(2, 2, 6, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8), torch.randn(2)
    torch.testing.assert_close(mod.tempered_attention(q, k, v, t), mod.tempered_attention_ref(q, k, v, t),
                               atol=1e-5, rtol=1e-5)

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=16,
                                      attention=name))
    assert all(type(b.attn) is mod.TemperedAttention for b in model.blocks)
    ids = torch.randint(0, 32, (2, 16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == set(before)  # every parameter moved, the temperatures included
    assert any(n.endswith("attn.temperature") for n in changed)

    # the reference path (evaluation probes) runs the same math
    model.eval()
    with torch.no_grad():
        fast = model(ids)
        for b in model.blocks:
            b.attn.use_reference = True
        torch.testing.assert_close(model(ids), fast, atol=1e-5, rtol=1e-5)


def test_a_variant_file_declares_its_options_export_and_backend_and_doctor_lists_it(variant_package, capsys,
                                                                                     monkeypatch):
    pkg, name = variant_package
    (mod,) = attention_pkg.import_submodules(pkg)
    # typed options, declared in the variant's file: read from the config, checked on construction
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, attention=name,
                      attn_options={"temperature_init": 0.5})
    assert cfg.options == mod.TemperedOptions(0.5)
    assert torch.equal(TransformerLM(cfg).blocks[0].attn.temperature.data, torch.full((2,), 0.5))
    with pytest.raises(ValueError, match=r"temperature_init must be float, got 'hot'"):
        cfg.replace(attn_options={"temperature_init": "hot"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['temprature_init'\]"):
        cfg.replace(attn_options={"temprature_init": 0.5})
    # exported by class name, from the attention package and the top-level package
    assert attention_pkg.attention_classes()["TemperedAttention"] is mod.TemperedAttention
    assert diffattn.TemperedAttention is mod.TemperedAttention
    # its ops in diffattn.functional, from the registry
    assert diffattn.functional.tempered_attention is mod.tempered_attention
    assert {"tempered_attention", "tempered_attention_ref"} <= set(diffattn.functional.__all__)
    # the backend choice lists it with the op it runs (no kernel family: sdpa)
    assert backends.describe("cpu")[name] == "sdpa"
    # doctor lists it and trains one step of it (the rest of the report is tests/cli/test_doctor.py's)
    monkeypatch.delenv("DIFFATTN_BACKEND", raising=False)
    monkeypatch.setattr(backends, "time_backend", lambda *a, **k: 0.001)  # not this test's subject
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == [name])
    assert "Tempered" in row and "sdpa" in row and row.endswith(" ms")
    assert f"{name} sdpa" in out.split("auto picks: ", 1)[1].splitlines()[0]
    unregister(name)
    assert name not in backends.describe("cpu")


def test_a_variant_file_carries_its_conversion_recipe_and_vllm_layer(variant_package, one_thread):
    """What convert and vLLM need is code in the variant's own file: the registry finds it by the type's name."""
    from diffattn.interop.convert import convert, created_tensors, targets
    from diffattn.interop.vllm.served import kv_bytes_per_token, served_model, served_type

    pkg, name = variant_package
    assert name not in targets() and served_type(name) is None
    attention_pkg.import_submodules(pkg)
    assert name in targets() and served_type(name) == "standard"
    torch.manual_seed(0)
    src = TransformerLM(ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=16,
                                    attention="standard", init_std=0.3)).eval()
    model = convert(src, name)
    ids = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), src(ids), rtol=0, atol=1e-6)  # exact at t = 0
    model.train()
    model(ids).square().mean().backward()
    assert all(float(g.abs().max()) > 0 for g in created_tensors(model, grads=True).values())
    with torch.no_grad():
        for b in model.blocks:
            b.attn.temperature.normal_()
        model.eval()
        served = served_model(model)  # its served config and weights: standard attention, same function
        assert served.config.attention == "standard"
        torch.testing.assert_close(served(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert kv_bytes_per_token(model.config) == kv_bytes_per_token(src.config)
    unregister(name)
    assert name not in targets() and served_type(name) is None


def test_functional_exports_every_registered_types_ops():
    """Each built-in variant names its fast and reference ops on its class; diffattn.functional exports them all
    (read from the registry, not a hand list), with the shared math."""
    for name, cls in ATTENTION.items():
        assert cls.functional_ops, f"{name} names no functional ops"
        for fn in cls.functional_ops:
            assert getattr(diffattn.functional, fn.__name__) is fn and fn.__name__ in diffattn.functional.__all__
    refs = {fn.__name__ for cls in ATTENTION.values() for fn in cls.functional_ops if fn.__name__.endswith("_ref")}
    assert {"attention_ref", "diff_attention_ref", "dint_attention_ref", "alibi_attention_ref"} <= refs
    assert {"build_mask", "ScoreMod", "distance_f"} <= set(diffattn.functional.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        diffattn.functional.nope  # noqa: B018


def test_builtin_variants_carry_their_labels_and_colours():
    """The strings and colours reports used before the registry carried them."""
    labels = {"diff": "DIFF", "standard": "Transformer", "diff_v2": "DIFF-V2", "distance": "DA",
              "diff_distance": "DIFF-DA"}
    colors = {"diff": "#1f77b4", "standard": "#ff7f0e", "diff_v2": "#2ca02c", "distance": "#9467bd",
              "diff_distance": "#d62728"}
    assert {n: attention_label(n) for n in labels} == labels
    assert {n: attention_color(n) for n in colors} == colors
    assert {n: color_for(n, 3) for n in colors} == colors
    assert attention_label("unknown") == "unknown" and attention_color("unknown") is None
    assert color_for("unknown", 1) == "#e377c2"  # a spare colour by position


def test_every_module_of_the_package_is_imported():
    """attention/__init__ imports each file, so each built-in variant is registered by importing the package."""
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(attention_pkg.__path__)}
    assert {"registry", "standard", "diff", "diff_v2", "distance", "diff_distance"} <= names
    assert all(f"diffattn.attention.{n}" in sys.modules for n in names)
    assert {"standard", "diff", "diff_v2", "distance", "diff_distance"} <= set(ATTENTION)


def test_recipes_are_registered_once_by_a_registered_class():
    from diffattn.attention.base import AttentionBase
    from diffattn.attention.conversion import Conversion
    from diffattn.attention.registry import converts, serves
    from diffattn.attention.serving import ServedLayer

    with pytest.raises(ValueError, match=r"converts\(Loose\): register the attention class \(@register\) first"):
        converts(type("Loose", (AttentionBase,), {}))(Conversion)
    with pytest.raises(ValueError, match="'gated' already has a serves recipe"):
        serves(ATTENTION["gated"])(ServedLayer)


def test_registry():
    assert {"standard", "diff", "diff_v2"} <= set(ATTENTION)
    assert ATTENTION["diff"].head_split == 2 and ATTENTION["diff"].baseline == "standard"
    assert ATTENTION["standard"].head_split == 1
    with pytest.raises(ValueError, match="already registered"):
        register("diff")(type("X", (), {}))
    cfg = ModelConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=2)
    object.__setattr__(cfg, "attention", "nope")  # bypass validation to reach build_attention's own check
    with pytest.raises(ValueError, match="unknown attention"):
        build_attention(cfg, 0)
