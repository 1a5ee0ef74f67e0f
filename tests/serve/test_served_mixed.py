"""A model whose layers mix attention types (a selective retrofit, issue 41), as vLLM is given it, checked without
vLLM: served layer by layer (each layer's type's config, weights, KV-cache shape), refused only for what a
model of one type is refused for too (a layer type without a vLLM layer, a head width the CPU build refuses, a
checkpoint from the middle of its schedule); `export --to vllm` writes a folder diffattn reads back and vLLM
takes; `export --to hf` writes a custom-code transformers folder that reads back the same.
tests/serve/test_vllm_exact.py (the ``mixed:`` cases) serves them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from clirun import run_main
from servecases import tokenizer

from diffattn import ModelConfig, TransformerLM, load_pretrained
from diffattn.checkpoint.format import save_checkpoint
from diffattn.configs.retrofit import RetrofitConfig
from diffattn.configs.run_config import RunConfig
from diffattn.interop.vllm.served import (
    MID_RETROFIT,
    config_problems,
    folder_problems,
    hf_fields,
    kv_bytes_per_token,
    layer_shapes,
    model_problems,
    served_config,
    served_model,
    stored_types,
)
from diffattn.train.retrofit import retrofit_model, set_retrofit

pytestmark = pytest.mark.usefixtures("one_thread")


def _standard(vocab_size: int = 40, **kw) -> TransformerLM:
    """4 layers of 4 query heads over 2 KV heads of width 32 (a width vLLM's CPU build takes)."""
    cfg = dict(attention="standard", vocab_size=vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
               max_seq_len=64, rope="neox")
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**cfg, **kw})).eval()


def _mixed(to: str, **kw) -> TransformerLM:
    model, _ = retrofit_model(_standard(**kw), RetrofitConfig(to=to, layers=[1, 3]))
    with torch.no_grad():  # λ vectors and norm gains off the recipe's values, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "lambda_" in name or name.endswith("subln.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


#: (type, (query heads, KV heads, head size) of a standard layer and of a retrofitted one, KV values per token of
#: the whole model, its floor): V1 caches [K1|K2] and V at 2d on its layers, d on the standard ones.
CASES = [
    ("diff", (4, 2, 32), (8, 2, 64), 2 * (2 * 2 * 32) + 2 * (2 * 2 * 64), 2 * (2 * 2 * 32) + 2 * (4 * 2 * 32)),
    ("diff_v2", (4, 2, 32), (8, 2, 32), 4 * (2 * 2 * 32), 4 * (2 * 2 * 32)),
    ("gated", (4, 2, 32), (4, 2, 32), 4 * (2 * 2 * 32), 4 * (2 * 2 * 32)),
]


@pytest.mark.parametrize("to,std_shape,new_shape,values,floor", CASES)
def test_mixed_layers_are_served_layer_by_layer(to, std_shape, new_shape, values, floor):
    model = _mixed(to)
    assert model.config.layer_attention == ["standard", to, "standard", to] and config_problems(model.config) == []
    served = served_config(model.config)
    assert served.layer_attention == model.config.layer_attention
    assert [s.layers for s in layer_shapes(served)] == [(std_shape,), (new_shape,)] * 2
    kv = kv_bytes_per_token(model.config, dtype_bytes=2)
    assert (kv["served"], kv["floor"]) == (2 * values, 2 * floor)
    fields = hf_fields(served)  # the widest layer's KV shape: vLLM's model-wide estimates err on the large side
    assert (fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]) == (4, 2, new_shape[2])
    ids = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        assert (served_model(model)(ids) - model(ids)).abs().max() <= 1e-5


def test_a_mixed_checkpoint_from_the_middle_of_its_schedule_is_refused(tmp_path):
    model = _mixed("diff")
    assert model_problems(model, cpu=False) == []
    set_retrofit(model, 0.5)
    assert model_problems(model, cpu=False) == [MID_RETROFIT]
    # a checkpoint at step 2 of a 4-step schedule loads as it trained there; export refuses it, writing nothing
    rc = RunConfig.of_model(model.config)
    rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, steps=4),
                             retrofit=RetrofitConfig(to="diff", layers=[1, 3], steps=4))
    save_checkpoint(tmp_path / "run" / "ckpt", model, run_config=rc, train_state={"step": 2})
    res = run_main("export", tmp_path / "run", "--to", "vllm", "--out", tmp_path / "out")
    assert res.returncode == 2 and "middle of its retrofit schedule" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=40, d_model=128, n_layers=2, n_heads=4, head_dim=32, max_seq_len=64,
                                 attention="standard"), **kw})


def test_each_layer_type_is_refused_or_re_expressed_as_for_a_model_of_one_type():
    (problem,) = config_problems(_cfg(layer_attention=["standard", "distance"]))
    assert problem.startswith("attention 'distance' has no vLLM recipe")
    (problem,) = config_problems(_cfg(d_model=64, head_dim=16, layer_attention=["standard", "diff"]))
    assert "needs head width 16 (standard: Q/K width 16)" in problem  # V1's layer is served at 32: taken
    cfg = _cfg(layer_attention=["standard", "shared_diff"])  # Shared DIFF's layer is served as V1's
    assert stored_types(cfg) == ["shared_diff"] and config_problems(cfg) == []
    assert served_config(cfg).layer_attention == ["standard", "diff"]
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        assert (served_model(model)(ids) - model(ids)).abs().max() <= 1e-5
    # GDA's served layer writes out its KV heads (n_n), which the standard layer, one config with it, would take
    (problem,) = config_problems(_cfg(layer_attention=["standard", "grouped_diff"]))
    assert "'grouped_diff' layers are served with n_kv_heads 2, not None" in problem


def _run(tmp_path, model, tok):
    save_checkpoint(tmp_path / "run" / "ckpt", model, tokenizer=tok, train_state={"step": 5},
                    run_config={"task": "lm", "model": model.config.to_dict()})
    return tmp_path / "run"


def test_export_writes_a_mixed_model_for_vllm_and_for_transformers_as_custom_code(tmp_path):
    tok = tokenizer()
    model = _mixed("diff", vocab_size=tok.vocab_size)
    run = _run(tmp_path, model, tok)
    res = run_main("export", run, "--to", "vllm", "--out", tmp_path / "out", "--check")
    assert res.returncode == 0, res.stderr
    assert "layers standard, diff, standard, diff for vLLM" in res.stderr and "max |Δlogits|" in res.stdout
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["config"]["layer_attention"] == ["standard", "diff", "standard", "diff"] and raw["head_dim"] == 64
    assert folder_problems(tmp_path / "out") == []
    back = load_pretrained(tmp_path / "out")  # save_pretrained's folder, read back as it was written
    assert back.config == model.config
    ids = torch.randint(0, tok.vocab_size, (1, 30))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    res = run_main("export", run, "--to", "hf", "--out", tmp_path / "hf", "--check")
    assert res.returncode == 0, res.stderr
    assert "layers standard, diff, standard, diff -> DiffattnForCausalLM (custom code" in res.stderr
