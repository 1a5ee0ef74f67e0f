"""Attention sinks (gpt-oss): the op against a per-head hand computation (GQA, causal, bidirectional with key
padding, cached decoding's explicit positions), fast == reference with the sinks' gradient, gradcheck, sink = −∞
is standard attention exactly (and the saddle that makes convert refuse it), the module and its matched baseline,
and the variant end to end through the CLI: train, a study and compare arm, convert refused naming why, and
export for vLLM (``tests/serve`` serves it; ``test_variants.py`` checks causality and the KV cache)."""

from __future__ import annotations

import math

import pytest
import torch
from clirun import run_main

from diffattn.attention.sink import SinkAttention, sink_attention, sink_attention_ref
from diffattn.attention.standard import attention_ref
from diffattn.experiments.study.spec import StudySpec
from diffattn.interop.convert import check_request
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.init import materialize
from diffattn.model.transformer import TransformerLM


def _inputs(b=2, h=4, hkv=2, tq=7, tk=7, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(b, h, tq, d), r(b, hkv, tk, d), r(b, hkv, tk, d), r(h)


def _oracle(q, k, v, sinks, keep):
    """Each head, each query: Σ_j exp(l_j) v_j / (exp(s_h) + Σ_j exp(l_j)) over the keys ``keep`` allows."""
    b, h, tq, d = q.shape
    out = torch.zeros_like(q[..., :v.shape[-1]])
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // k.shape[1])
            for i in range(tq):
                j = keep(bi, i)
                e = torch.exp(q[bi, hi, i] @ k[bi, g, j].T / math.sqrt(d))
                out[bi, hi, i] = (e @ v[bi, g, j]) / (torch.exp(sinks[hi]) + e.sum())
    return out


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_the_op_is_softmax_with_one_more_logit_per_head(hkv):
    q, k, v, sinks = _inputs(hkv=hkv)
    causal = _oracle(q, k, v, sinks, lambda b, i: slice(0, i + 1))
    full = _oracle(q, k, v, sinks, lambda b, i: slice(0, 7))
    for op in (sink_attention, sink_attention_ref):
        torch.testing.assert_close(op(q, k, v, sinks), causal)
        torch.testing.assert_close(op(q, k, v, sinks, causal=False), full)


def test_padding_and_cached_positions():
    q, k, v, sinks = _inputs(tq=3, tk=9)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False  # sequence 1 has 6 keys
    want = _oracle(q, k, v, sinks, lambda b, i: slice(0, 9 if b == 0 else 6))
    pos = torch.tensor([4, 5, 8])  # decoding: queries at these positions over a cache of 9 slots, as the
    keep = (torch.arange(9)[None, :] <= pos[:, None])[None, None]  # module's mask_args give them
    cached = _oracle(q, k, v, sinks, lambda b, i: slice(0, int(pos[i]) + 1))
    after_six = _oracle(q, k, v, sinks, lambda b, i: slice(0, 6 + i + 1))  # queries at 6, 7, 8 (an int offset)
    for op in (sink_attention, sink_attention_ref):
        torch.testing.assert_close(op(q, k, v, sinks, causal=False, attn_mask=pad), want)
        torch.testing.assert_close(op(q, k, v, sinks, causal=False, attn_mask=keep, offset=pos), cached)
        torch.testing.assert_close(op(q, k, v, sinks, causal=True, offset=6), after_six)
    everything_masked = torch.zeros(2, 9, dtype=torch.bool)  # all weight on the sink: zeros, as SDPA gives
    for op in (sink_attention, sink_attention_ref):
        assert op(q, k, v, sinks, causal=False, attn_mask=everything_masked).abs().max() == 0


def test_fast_equals_reference_with_gradients_and_gradcheck():
    q, k, v, sinks = (x.requires_grad_() for x in _inputs(d=8, dtype=torch.float32))
    grads = []
    for op in (sink_attention, sink_attention_ref):
        out = op(q, k, v, sinks)
        out.square().sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v, sinks)])
        for x in (q, k, v, sinks):
            x.grad = None
    for fast, ref in zip(*grads):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    assert grads[0][3].abs().min() > 0  # every head's sink gets a gradient
    small = [x.detach()[:1, :, :4, :3].clone().double().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *a: sink_attention(*a, causal=True),
                                    (*small, sinks.detach().double().requires_grad_()))


def test_sink_minus_infinity_is_standard_attention_and_a_saddle():
    """Why ``convert --to sink`` is refused: the exact point s = −∞ is standard attention, but the sinks' gradient
    is exactly 0 there; any finite sink changes the function."""
    q, k, v, _ = _inputs()
    gone = torch.full((4,), -math.inf, dtype=torch.float64, requires_grad=True)
    std = attention_ref(q, k, v)
    for op in (sink_attention, sink_attention_ref):
        out = op(q, k, v, gone)
        torch.testing.assert_close(out, std, rtol=0, atol=1e-15)
        out.sum().backward()
        assert torch.equal(gone.grad, torch.zeros(4, dtype=torch.float64))
        gone.grad = None
    assert (sink_attention(q, k, v, torch.full((4,), -30.0, dtype=torch.float64)) - std).abs().max() > 0
    with pytest.raises(ValueError, match="no conversion to 'sink': .*gradient are both 0"):
        check_request("sink", "exact")


def test_module_init_parameters_maps_and_baseline():
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="sink",
                      attn_options={"sink_init": -1.5})
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    attn = model.blocks[0].attn
    assert isinstance(attn, SinkAttention) and torch.equal(attn.sinks.data, torch.full((4,), -1.5))
    base = matched_baseline(cfg)
    assert base.attention == "standard" and base.n_heads == 4
    assert model.num_params() == TransformerLM(base).num_params() + cfg.n_layers * cfg.n_heads
    with torch.device("meta"):
        meta = TransformerLM(cfg)
    torch.manual_seed(0)
    materialize(meta, "cpu")  # built without memory, initialised in place: the same sinks
    assert torch.equal(meta.blocks[1].attn.sinks, model.blocks[1].attn.sinks)
    caught = []
    attn.capture = caught
    model.eval()(torch.randint(0, 50, (1, 9)))
    m = caught[0]
    torch.testing.assert_close(m["probs"].sum(-1) + m["sink"], torch.ones_like(m["sink"]))
    assert m["sink"].min() > 0


def test_study_and_compare_arms():
    spec = StudySpec.from_dict({"data": "x", "variants": ["sink"], "head_dims": [32], "steps": 10})
    arms = {a.name: spec.arm_config(a, 65) for a in spec.arms()}
    assert arms["sink"].attention == "sink" and arms["sink"].n_heads == arms["standard"].n_heads
    import argparse

    from diffattn.cli import compare
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    cfgs = compare.resolve(p.parse_args(["--quick", "--variants", "sink"])).model_configs()
    assert [c.attention for c in cfgs] == ["diff", "standard", "sink"] and cfgs[2].n_heads == cfgs[1].n_heads


def test_train_then_export_for_vllm_and_convert_refused_through_the_cli(tmp_path, one_thread):
    (tmp_path / "in.txt").write_text("the sink takes what no key wants. " * 40)
    r = run_main("train", "--config", "tiny", "--model.attention", "sink", "--model.n_layers", "2",
                 "--data.path", "in.txt", "--out", "run", "--no-progress", "--train.steps", "3",
                 "--train.batch_size", "2", "--train.seq_len", "32", "--train.eval_every", "3",
                 "--train.eval_batches", "1", "--train.warmup_steps", "0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    from diffattn.checkpoint.format import load_checkpoint

    model = load_checkpoint(tmp_path / "run" / "ckpt").build_model()
    assert model.config.attention == "sink"
    assert not torch.equal(model.blocks[0].attn.sinks.detach(), torch.zeros(4))  # trained: the sinks moved
    r = run_main("export", "run", "--to", "vllm", "--out", "served", "--check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    from diffattn.interop.vllm.served import folder_problems

    assert folder_problems(tmp_path / "served") == []
    r = run_main("convert", "run", "--to", "sink", "--out", "conv", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no exact, trainable conversion" in r.stderr
