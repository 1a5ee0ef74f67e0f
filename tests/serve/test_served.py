"""What vLLM is given, checked without vLLM (issue 33): every registered attention type is either served (its
served model computes its function; the KV cache of V1 is the floor's bytes) or refused naming why; `diffattn
export --to vllm` writes one folder diffattn and vLLM read, and refuses in one line, writing nothing; DiffLlama
weights translate to ours exactly; the plugin's version gate and entry point."""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path

import pytest
import torch
from clirun import run_main
from servecases import CASES, tiny_model, tokenizer

import diffattn.interop.vllm as plugin
from diffattn import ModelConfig, TransformerClassifier, TransformerLM, load_pretrained
from diffattn.attention.registry import ATTENTION, serving_of
from diffattn.checkpoint.format import save_checkpoint
from diffattn.interop.vllm.served import (
    CPU_HEAD_SIZES,
    config_problems,
    folder_problems,
    hf_fields,
    kv_bytes_per_token,
    served_config,
    served_model,
    served_type,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(attention: str, **kw) -> ModelConfig:
    base = dict(vocab_size=40, d_model=128, n_layers=2, n_heads=2, max_seq_len=64, attention=attention)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("shared_qk", [False, True])
def test_every_type_is_served_exactly_or_refused_naming_why(attention, shared_qk):
    cls = ATTENTION[attention]
    if shared_qk and not cls.supports_shared_qk:
        pytest.skip(f"{attention} has no shared_qk")
    cfg = _cfg(attention, shared_qk=shared_qk)
    if serving_of(attention) is None:
        (problem,) = config_problems(cfg)
        assert problem.startswith(f"attention {attention!r} has no vLLM recipe") and "\n" not in problem
        note = cls.unsupported.get("serve")
        assert note and note in problem, f"{attention}: a type vLLM cannot serve says why (unsupported['serve'])"
        return
    model = TransformerLM(cfg).eval()
    served = served_model(model)
    assert served.config.attention == served_type(attention) and not served.config.shared_qk
    ids = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        assert (served(ids) - model(ids)).abs().max() <= 1e-5


def test_recipes_are_the_class_s_own_not_inherited():
    assert served_type("diff") == "diff" and served_type("shared_diff") == "diff"
    assert served_type("distance") is None and served_type("diff_distance") is None  # subclasses of served types


@pytest.mark.parametrize("attention,kw,served,floor", [
    ("standard", dict(n_heads=4, n_kv_heads=2), 2 * 2 * 2 * 32, 2 * 2 * 2 * 32),  # layers·(K+V)·hkv·d
    ("diff", dict(n_kv_heads=1), 2 * 1 * (64 + 64), 2 * 4 * 1 * 32),  # [K1|K2] 2d + V 2d = the floor
    ("diff", dict(head_dim=64), 2 * 2 * (128 + 128), 2 * 4 * 2 * 64),  # a converted model's width
    ("diff_v2", dict(n_kv_heads=1), 2 * 2 * 1 * 64, 2 * 2 * 1 * 64),
    ("dint", {}, 2 * (2 * (64 + 64) + 2 * (64 + 64)), 2 * 4 * 2 * 32),  # + A1·V rows (and zero keys)
    ("gated", dict(n_heads=4, n_kv_heads=2), 2 * 2 * 2 * 32, 2 * 2 * 2 * 32),  # standard's: the gate is not cached
    ("grouped_diff", dict(n_heads=4), 2 * 2 * (32 + 32), 2 * 4 * 2 * 16),  # 3:1, n_n = 2 KV heads of [K1|K2] + V
    ("grouped_diff", dict(n_heads=4, n_kv_heads=1, attn_options={"gda_ratio": 1}), 2 * 1 * (32 + 32), 2 * 4 * 16),
])
def test_kv_bytes_per_token(attention, kw, served, floor):
    kv = kv_bytes_per_token(_cfg(attention, **kw), dtype_bytes=2)
    assert (kv["served"], kv["floor"]) == (2 * served, 2 * floor)
    assert kv["ratio"] == pytest.approx(served / floor)


def test_v1_reaches_its_matched_baseline_s_kv_bytes():
    from diffattn import matched_baseline

    cfg = _cfg("diff", n_heads=4, n_kv_heads=2, d_model=256)
    assert kv_bytes_per_token(cfg)["served"] == kv_bytes_per_token(matched_baseline(cfg))["served"]


def test_cpu_head_widths_are_refused_in_one_line():
    assert config_problems(_cfg("diff", d_model=64)) == []  # d = 16, served at 32: taken
    problems = config_problems(_cfg("standard", d_model=64, n_heads=4))  # d = 16: refused
    assert len(problems) == 1 and "takes head widths 32, 64, 80" in problems[0] and "needs head width 16" in problems[0]
    assert config_problems(_cfg("standard", d_model=64, n_heads=4), cpu=False) == []


def test_hf_fields_count_what_tensor_parallelism_splits():
    f = hf_fields(served_config(_cfg("diff", n_kv_heads=1)))
    assert (f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]) == (2, 1, 64)
    f = hf_fields(_cfg("diff_v2", n_heads=4, n_kv_heads=2))
    assert (f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]) == (4, 2, 32)
    f = hf_fields(served_config(_cfg("grouped_diff", n_heads=4)))  # 6 signal + 2 noise sub-heads of 16
    assert (f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]) == (4, 2, 32)


@pytest.mark.parametrize("attention,kw", [
    ("gated", dict(n_heads=4, attn_options={"gate_headwise": True}, bias=True)),
    ("grouped_diff", dict(n_heads=4, attn_options={"gda_ratio": 1})),  # r = 1: V1
    ("grouped_diff", dict(n_heads=6, n_kv_heads=1, head_dim=16, attn_options={"gda_ratio": 2, "qk_norm": True})),
])
def test_rival_options_are_served_exactly(attention, kw):
    model = TransformerLM(_cfg(attention, **kw)).eval()
    served = served_model(model)
    assert served.config.attention == attention and served.config.kv_heads == model.blocks[0].attn.num_kv_heads
    ids = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        assert (served(ids) - model(ids)).abs().max() <= 1e-5


#: Every family option at once (Gemma 3's, plus Qwen2's q/k/v biases), on layer 1 of 2 a window with its RoPE base.
FAMILY_OPTIONS = dict(qkv_bias=True, out_bias=False, qk_norm=True, sliding_window=8, window_layers=[1],
                      rope_local_theta=1e4, rope_factor=2.0, post_attn_norm=True, post_ffn_norm=True,
                      norm_unit_offset=True, mlp_activation="gelu_tanh", scale_embeddings=True,
                      query_pre_attn_scalar=20.0, rope="neox", family="gemma3_text")


@pytest.mark.parametrize("attention", sorted(a for a in ATTENTION if serving_of(a) is not None
                                             and ATTENTION[a].window_note is None))
def test_every_served_type_takes_the_family_options(attention):
    """Nothing a family sets is refused any more (the recipes carry it; tests/serve/test_vllm_exact.py serves it)."""
    cfg = _cfg(attention, n_heads=2 if ATTENTION[attention].head_split == 2 else 4, **FAMILY_OPTIONS)
    assert config_problems(cfg) == [] and served_config(cfg).family_options() == cfg.family_options()
    f = hf_fields(served_config(cfg))
    assert f["hidden_act"] == "gelu_pytorch_tanh"


# ----------------------------------------------------------------------------------------- export --to vllm
def _run(tmp_path: Path, model, tok, name: str = "run") -> Path:
    run = tmp_path / name
    lm = isinstance(model, TransformerLM)
    extra = {} if lm else {"classify": model.pretrained_kwargs()}
    save_checkpoint(run / "ckpt", model, tokenizer=tok, train_state={"step": 5},
                    run_config={"task": "lm" if lm else "classify", "model": model.config.to_dict(), **extra})
    return run


@pytest.mark.parametrize("case", [c for c in CASES if c != "diffllama"])
def test_export_writes_one_folder_diffattn_and_vllm_read(tmp_path, case):
    tok = tokenizer()
    model = tiny_model(case, tok.vocab_size)
    res = run_main("export", _run(tmp_path, model, tok), "--to", "vllm", "--out", tmp_path / "out", "--check")
    assert res.returncode == 0, res.stderr
    assert "max |Δlogits| vs the run" in res.stdout and "KV cache" in res.stderr
    out = tmp_path / "out"
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "diffattn" and raw["architectures"] == ["DiffattnForCausalLM"]
    assert raw["config"]["attention"] == served_type(model.config.attention)
    assert folder_problems(out) == []
    ids = torch.randint(0, tok.vocab_size, (1, 30))
    with torch.no_grad():
        assert (load_pretrained(out)(ids) - model(ids)).abs().max() <= 1e-5
    from tokenizers import Tokenizer  # what vLLM's tokenizer reads

    text = "ROMEO: But soft"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == tok.encode(text)


def test_export_refuses_what_vllm_cannot_serve_in_one_line(tmp_path):
    tok = tokenizer()
    cfg = dict(vocab_size=tok.vocab_size, d_model=64, n_layers=1, n_heads=2, max_seq_len=32)
    runs = {"distance": TransformerLM(ModelConfig(attention="distance", **cfg)),
            "classifier": TransformerClassifier(ModelConfig(attention="diff", **cfg), num_classes=2)}
    for name, model in runs.items():
        res = run_main("export", _run(tmp_path, model, tok, name), "--to", "vllm", "--out", tmp_path / f"o-{name}")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert ("no vLLM recipe" if name == "distance" else "it is a classifier") in res.stderr
        assert not (tmp_path / f"o-{name}").exists()


def test_export_notes_a_head_width_the_cpu_build_refuses(tmp_path):
    tok = tokenizer()
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=1, n_heads=4,
                                      attention="standard", max_seq_len=32))
    res = run_main("export", _run(tmp_path, model, tok), "--to", "vllm", "--out", tmp_path / "out")
    assert res.returncode == 0 and "note: vLLM's CPU build cannot serve it" in res.stderr
    assert folder_problems(tmp_path / "out") and folder_problems(tmp_path / "out", cpu=False) == []


def test_folder_problems_name_what_is_not_a_vllm_folder(tmp_path):
    tok = tokenizer()
    model = tiny_model("diff", tok.vocab_size)
    model.save_pretrained(tmp_path / "sp", tokenizer=tok)
    assert "export it with diffattn export" in folder_problems(tmp_path / "sp")[0]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text('{"model_type": "bert"}')
    assert "model_type 'bert'" in folder_problems(tmp_path / "x")[0]
    assert "cannot be read" in folder_problems(tmp_path / "missing")[0]


def test_diffllama_weights_translate_to_ours(tmp_path):
    pytest.importorskip("transformers")
    from safetensors import safe_open

    from diffattn.interop.hf_export import export_hf
    from diffattn.interop.vllm.weights import diffllama_weights

    tok = tokenizer()
    model = tiny_model("diffllama", tok.vocab_size)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.subln.weight.fill_(1.0)  # DiffLlama's norm has no gain (export folds it into o_proj)
    export_hf(model, tok, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        pairs = [(k, f.get_tensor(k)) for k in f.keys()]
    ours = model.state_dict()
    got = dict(diffllama_weights(pairs, model.config))
    assert set(got) - {"lm_head.weight"} <= set(ours)
    for name, tensor in got.items():
        assert torch.equal(tensor, ours[name]), name
    with pytest.raises(ValueError, match="unexpected DiffLlama weight 'model.extra'"):
        list(diffllama_weights([("model.extra", torch.zeros(1))], model.config))


# ------------------------------------------------------------------------------------------------ the plugin
@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.4+cpu", True), ("0.31.2", False),
                                        ("0.33.0", False), ("1.0", False), ("nightly", False)])
def test_version_range(version, ok):
    problem = plugin.version_problem(version)
    assert (problem is None) == ok
    if not ok:
        assert f"vLLM {version} is outside the range" in problem and "\n" not in problem


def test_missing_vllm_is_one_line(monkeypatch):
    monkeypatch.setattr(plugin, "installed_version", lambda: None)
    assert plugin.version_problem().startswith("vLLM is not installed; pip install -e \".[serve]\"")


def test_unsupported_vllm_registers_nothing_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "installed_version", lambda: "0.20.0")
    with caplog.at_level(logging.WARNING, logger="diffattn.vllm"):
        plugin.register()  # returns before importing vLLM or transformers
    assert [r.getMessage() for r in caplog.records] == [
        "diffattn plugin not loaded: " + plugin.version_problem("0.20.0")]


def test_the_entry_point_vllm_loads():
    points = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == "diffattn"]
    assert [e.value for e in points] == ["diffattn.interop.vllm:register"]
    assert all(target.startswith("diffattn.interop.vllm.model:") for target in plugin.ARCHITECTURES.values())


def test_cpu_head_sizes_are_the_documented_ones():
    assert CPU_HEAD_SIZES == (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


# -------------------------------------------------------------------------------- diffattn serve, before vLLM
@pytest.mark.parametrize("case", ["gated", "grouped_diff"])
def test_serve_prepares_a_run_of_the_rivals_vllm_serves(tmp_path, case):
    from diffattn.interop.vllm.serving import served_folder

    tok = tokenizer()
    model = tiny_model(case, tok.vocab_size)
    folder = served_folder(str(_run(tmp_path, model, tok)), cpu=True, cache=tmp_path / "cache")
    assert folder.is_relative_to(tmp_path / "cache") and folder_problems(folder) == []
    ids = torch.randint(0, tok.vocab_size, (1, 20))
    with torch.no_grad():
        assert (load_pretrained(folder)(ids) - model(ids)).abs().max() <= 1e-5


def test_serve_refuses_fox_in_one_line_naming_why(tmp_path):
    from diffattn.interop.vllm.serving import served_folder

    tok = tokenizer()
    model = TransformerLM(ModelConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=1, n_heads=4,
                                      attention="fox", max_seq_len=32))
    with pytest.raises(ValueError, match=r"attention 'fox' has no vLLM recipe: .* takes no logit bias") as e:
        served_folder(str(_run(tmp_path, model, tok)), cpu=True, cache=tmp_path / "cache")
    assert "\n" not in str(e.value)
    assert list((tmp_path / "cache" / "vllm").iterdir()) == []  # nothing left in the cache
