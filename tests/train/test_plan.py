"""The memory and FLOP planner (diffattn.train.plan, `diffattn plan`): parameters equal the built model's, the
activations counted on fake tensors equal what autograd saves in a real forward, the attention FLOPs of DIFF are
1.5x its baseline's, and the plan's arithmetic (sharding, checkpointing modes, the largest micro-batch) holds.
Its agreement with measured peaks is a benchmark: benchmarks/bench_memory.py."""

from __future__ import annotations

import json

import pytest
import torch

from diffattn.attention.registry import ATTENTION
from diffattn.cli.main import main
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.loss import cross_entropy
from diffattn.train.plan import GIB, count_activations, count_params, flops_per_token, plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=96, d_model=64, n_layers=3, n_heads=2, max_seq_len=64, attention="diff")
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_parameter_counts_are_the_built_models(attention):
    cfg = _cfg(attention=attention)
    counts = count_params(cfg)
    model = TransformerLM(cfg)
    assert counts["total"] == model.num_params()
    assert counts["embeddings"] == 96 * 64 and counts["lm_head"] == 0  # tied: counted once, as the embedding
    assert counts["block"] == sum(p.numel() for p in model.blocks[0].parameters())
    assert counts["root"] == counts["total"] - 3 * counts["block"]


def _real_saved_bytes(cfg: ModelConfig, b: int, t: int) -> int:
    """What autograd keeps for the backward of a real forward + loss on CPU: unique storages, parameters aside."""
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return x

    ids = torch.randint(0, cfg.vocab_size, (b, t))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = cross_entropy(model(ids), ids)
    return sum(seen.values()), loss


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_activations_counted_on_fake_tensors_equal_a_real_forward(attention):
    cfg = _cfg(attention=attention)
    acts = count_activations(cfg, batch_size=2, seq_len=48)
    real, _ = _real_saved_bytes(cfg, 2, 48)
    assert sum(acts.saved) + acts.head == real
    assert len(acts.saved) == 3 and min(acts.saved) > 0
    assert acts.inputs == [2 * 48 * 64 * 4] * 3  # the fp32 residual stream entering each block
    assert all(0 < k < s for k, s in zip(acts.kept, acts.saved))  # selective keeps part of a block's tensors
    assert acts.logits == 2 * 48 * 96 * 4


def test_attention_flops_of_diff_are_one_and_a_half_times_its_baselines():
    diff = _cfg(d_model=256, n_heads=2)
    base = matched_baseline(diff)
    fd, fb = flops_per_token(diff, 1024), flops_per_token(base, 1024)
    assert fd["attention"] == pytest.approx(1.5 * fb["attention"])
    # QKᵀ and PV of a standard core, 2 FLOPs per multiply-add at width d_model each, over the (T + 1)/2 keys a
    # causal query sees on average; 3 layers; times 3 for training (forward + backward)
    assert fb["attention"] == pytest.approx(3 * 2 * (256 + 256) * (1024 + 1) / 2 * 3)
    linear = sum(m.weight.numel() for m in TransformerLM(diff).modules() if isinstance(m, torch.nn.Linear))
    assert fd["matmul"] == 6 * linear  # the tied head's matmul included
    assert fd["model"] == fd["matmul"] + fd["attention"]


def test_attention_flops_follow_each_variants_head_layout():
    flops = {t: flops_per_token(_cfg(attention=t), 256)["attention"] for t in ATTENTION}
    for t in ("diff_distance", "dint", "shared_diff"):  # V1's layout: DINT's G·V is a running mean, left out
        assert flops[t] == flops["diff"], t
    for t in ("distance", "alibi"):  # one map per head, as standard attention (the bias is adds)
        assert flops[t] == flops["standard"], t
    assert flops["diff"] == pytest.approx(1.5 * flops["standard"])  # QKᵀ as wide as standard's, V twice as wide


def test_a_variant_declares_its_own_attention_flops_in_its_file():
    """The planner asks the type (AttentionBase.core_flops_per_token) and names none: a new variant's own count
    is the one used, not standard attention's."""
    from diffattn.attention.registry import register, unregister
    from diffattn.attention.standard import StandardAttention

    @register("flops_probe")
    class Probe(StandardAttention):
        @classmethod
        def core_flops_per_token(cls, cfg, context: float) -> float:
            return 7.0 * context

    try:
        cfg = _cfg(attention="flops_probe")
        assert flops_per_token(cfg, 255)["attention"] == pytest.approx(3 * 7.0 * 128 * cfg.n_layers)
    finally:
        unregister("flops_probe")


def test_plan_arithmetic_sharding_modes_and_largest_micro_batch():
    cfg = _cfg(vocab_size=512, d_model=128, n_layers=4, n_heads=2, max_seq_len=256)
    modes = {m: plan(cfg, batch_size=2, seq_len=256, world=4, activation_checkpointing=m, dtype="float32")
             for m in ("none", "selective", "full")}
    ddp, fsdp = modes["none"].layouts["ddp"], modes["none"].layouts["fsdp"]
    p = modes["none"].counts["total"]
    assert (ddp.weights, ddp.grads, ddp.optimizer, ddp.buffers) == (4 * p, 4 * p, 8 * p, 4 * p)
    assert (fsdp.weights, fsdp.optimizer) == (p, 2 * p)
    acts = [modes[m].layouts["ddp"].activations for m in ("full", "selective", "none")]
    assert acts[0] < acts[1] < acts[2]
    peaks = [modes[m].layouts["ddp"].peak for m in ("full", "selective", "none")]
    assert peaks[0] <= peaks[1] <= peaks[2]
    budget = 0.25
    fit = plan(cfg, batch_size=1, seq_len=256, world=4, gpu_memory_gb=budget, dtype="float32")
    best = fit.max_batch["fsdp"]
    assert best >= 1
    at = plan(cfg, batch_size=best, seq_len=256, world=4, gpu_memory_gb=budget, dtype="float32")
    over = plan(cfg, batch_size=best + 1, seq_len=256, world=4, gpu_memory_gb=budget, dtype="float32")
    assert at.fits("fsdp") and not over.fits("fsdp")
    assert at.layouts["fsdp"].peak <= budget * GIB < over.layouts["fsdp"].peak


def test_plan_command_prints_the_tables_and_json(capsys):
    assert main(["plan", "--config", "tiny", "--vocab-size", "65", "--gpus", "2", "--gpu-memory-gb", "1",
                 "--activation-checkpointing", "full"]) == 0
    out = capsys.readouterr().out
    for part in ("parameters:", "FLOPs per token", "attention", "memory per device (GiB):", "ddp", "fsdp",
                 "max micro-batch", "activation checkpointing full"):
        assert part in out, part
    assert main(["plan", "--config", "tiny", "--vocab-size", "65", "--seq-len", "64", "--json"]) == 0
    plan_json = json.loads(capsys.readouterr().out)
    assert plan_json["seq_len"] == 64 and plan_json["counts"]["total"] > 0
    assert set(plan_json["layouts"]) == {"ddp", "fsdp"}


def test_plan_command_rejects_bad_input(capsys):
    assert main(["plan", "--config", "tiny", "--gpus", "0"]) == 2
    assert "error: --gpus must be positive" in capsys.readouterr().err
    assert main(["plan", "--config", "nope"]) == 2
    assert "config 'nope' not found" in capsys.readouterr().err


def test_plan_command_lists_the_checkpointing_modes_and_refuses_another(capsys):
    """`diffattn plan --help` names the modes without importing the model (issue 34): the list it shows is
    CHECKPOINTING's, and a mode outside it is one line, exit 2."""
    import argparse

    from diffattn.cli import plan as plan_cli
    from diffattn.model.blocks import CHECKPOINTING

    p = argparse.ArgumentParser()
    plan_cli.add_arguments(p)
    action = next(a for a in p._actions if a.dest == "activation_checkpointing")
    assert action.metavar == "{" + ",".join(CHECKPOINTING) + "}"
    assert plan_cli.run(p.parse_args(["--config", "tiny", "--activation-checkpointing", "partial"])) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_autocasts_parameter_copies_are_counted_at_the_end_of_a_checkpointed_forward():
    """Under checkpointing autograd saves no half-precision weight copy, yet autocast's cache holds one of every
    block parameter a matmul casts until the forward and loss leave autocast: the trace counts those casts
    (2 bytes per matmul weight in bf16, none in fp32), and the end of the forward is a candidate peak."""
    cfg = _cfg(vocab_size=64, d_model=64, n_layers=3, n_heads=2, max_seq_len=32)
    with torch.device("meta"):
        block = TransformerLM(cfg.first_layers(1)).blocks[0]
    matmul = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    acts = count_activations(cfg, 1, 32, "bfloat16")
    assert acts.casts == [2 * matmul] * 3
    assert count_activations(cfg, 1, 32, "float32").casts == [0, 0, 0]
    # a short sequence, so that the copies outweigh a block's recompute: the cache sets the full peak
    full = plan(cfg, batch_size=1, seq_len=4, activation_checkpointing="full", dtype="bfloat16").layouts["ddp"]
    fixed = full.weights + full.optimizer
    one = count_activations(cfg, 1, 4, "bfloat16")
    assert full.peak >= fixed + sum(one.inputs) + one.head + one.forward_logits + 3 * 2 * matmul
