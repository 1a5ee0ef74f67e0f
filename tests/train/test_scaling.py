"""What a large run needs, on tiny shapes: activation checkpointing (none / full / selective) changes no loss
in fp32 (with dropout, gradient accumulation, bf16 autocast, classification and a resume), the meta-device
build trains like the eager one, and regional compilation traces a block with no graph break and follows
eager's losses. DDP and FSDP2 with checkpointing: tests/train/test_distributed.py."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
import torch._dynamo

from diffattn.attention.registry import ATTENTION
from diffattn.checkpoint.format import load_checkpoint
from diffattn.configs.run_config import RunConfig, TrainConfig, load_run_config
from diffattn.configs.toml_writer import to_toml
from diffattn.model.blocks import set_activation_checkpointing
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.classify import build_classifier
from diffattn.train.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")


class Progressions:
    """Rows are arithmetic progressions mod V with a random start and stride (learnable from context)."""

    vocab_size, seq_len = 24, 16

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator):
        start = torch.randint(0, self.vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].clone(), seq[:, 1:].clone()


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=24, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="diff", dropout=0.1)
    return ModelConfig(**{**base, **kw})


def _tcfg(**kw) -> TrainConfig:
    base = dict(steps=4, batch_size=4, grad_accum=2, seq_len=16, lr=3e-3, warmup_steps=0, eval_every=2,
                eval_batches=1, log_every=1, seed=3)
    return TrainConfig(**{**base, **kw})


def _train(ac: str, model_kw: dict | None = None, **kw):
    torch.manual_seed(0)
    model = TransformerLM(_cfg(**(model_kw or {})))
    res = train(model, Progressions(), _tcfg(activation_checkpointing=ac, **kw), progress=False)
    return res.history, model


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_activation_checkpointing_changes_no_loss_in_fp32(ac, attention):
    """With dropout (the recompute must draw the same masks) and 2 micro-batches per step: the same losses,
    gradient norms and final weights, bit for bit."""
    ref, ref_model = _train("none", {"attention": attention})
    got, model = _train(ac, {"attention": attention})
    for a, b in zip(ref, got):
        assert (a["train_loss"], a["grad_norm"], a["val_loss"]) == (b["train_loss"], b["grad_norm"], b["val_loss"])
    for (n, p), q in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_every_attention_type_gets_the_same_gradients_under_each_checkpointing_mode(attention):
    """One training forward + backward (dropout on: the recompute must draw the same masks) per mode."""
    ids = torch.randint(0, 24, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for ac in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = TransformerLM(_cfg(attention=attention)).train()
        set_activation_checkpointing(model, ac)
        torch.manual_seed(5)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads[ac] = [loss.detach()] + [p.grad for p in model.parameters()]
    for ac in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[ac], strict=True)), ac


def test_activation_checkpointing_under_bf16_autocast():
    ref, _ = _train("none", dtype="bfloat16")
    got, _ = _train("full", dtype="bfloat16")
    assert [r["train_loss"] for r in got] == [r["train_loss"] for r in ref]


def test_what_each_mode_recomputes_in_the_backward():
    """Counted by a dispatch mode over the backward pass: full recomputes the matmuls and the element-wise ops,
    selective only the element-wise ones (SiLU here), none nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def backward_ops(ac: str) -> dict[str, int]:
        torch.manual_seed(0)
        model = TransformerLM(_cfg(dropout=0.0, n_layers=3))
        set_activation_checkpointing(model, ac)
        loss = model(torch.randint(0, 24, (2, 16))).sum()
        with Count() as c:
            loss.backward()
        return c.ops

    none, full, selective = backward_ops("none"), backward_ops("full"), backward_ops("selective")
    mm = [d.get("mm", 0) + d.get("addmm", 0) for d in (none, full, selective)]
    assert mm[0] == mm[2] < mm[1], mm  # selective keeps every matmul output; full runs them again
    assert none.get("silu", 0) == 0 and selective.get("silu", 0) == full.get("silu", 0) == 3  # one per block


def test_activation_checkpointing_resumes_exactly(tmp_path: Path):
    ref, _ = _train("full", steps=6, eval_every=3)
    torch.manual_seed(0)
    train(TransformerLM(_cfg()), Progressions(), _tcfg(activation_checkpointing="full", steps=6, eval_every=3,
                                                         ckpt_every=3), out_dir=tmp_path, progress=False)
    shutil.rmtree(tmp_path / "ckpt")  # resume from step 3's checkpoint, the one kept before the last
    (tmp_path / "ckpt-step-3").rename(tmp_path / "ckpt")
    resumed = train(TransformerLM(_cfg()), Progressions(), _tcfg(activation_checkpointing="full", steps=6,
                                                                    eval_every=3), out_dir=tmp_path,
                       progress=False, resume=True)
    assert [r["train_loss"] for r in resumed.history[3:]] == [r["train_loss"] for r in ref[3:]]


def test_classifier_trains_the_same_with_activation_checkpointing(tmp_path: Path):
    path = tmp_path / "data.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        w.writerows((("near", f"ab {i}") if i % 2 else ("far", f"axxxb {i}")) for i in range(40))

    def run(ac: str) -> list[float]:
        cfg = {"task": "classify",
               "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "attention": "diff", "max_seq_len": 16},
               "train": {"steps": 3, "batch_size": 4, "warmup_steps": 0, "eval_every": 0,
                         "activation_checkpointing": ac},
               "data": {"path": str(path), "tokenizer": "char"}, "classify": {}}
        run, model, task, _ = build_classifier(RunConfig.from_dict(cfg))
        return [r["train_loss"] for r in train(model, task, run, progress=False).history]

    assert run("selective") == run("none")


def test_config_field_round_trips_and_old_runs_default_to_none(tmp_path: Path):
    cfg = load_run_config("tiny", ["--train.activation_checkpointing", "selective"])
    assert cfg.train.activation_checkpointing == "selective"
    (tmp_path / "r.toml").write_text(to_toml(cfg.to_dict()))
    assert load_run_config(str(tmp_path / "r.toml")).train.activation_checkpointing == "selective"
    old = {k: v for k, v in cfg.to_dict()["train"].items() if k not in ("activation_checkpointing", "compile")}
    assert load_run_config(None, [], base={**cfg.to_dict(), "train": old}).train.activation_checkpointing == "none"
    with pytest.raises(ValueError, match="activation_checkpointing must be none|full|selective"):
        TrainConfig(activation_checkpointing="partial")


def test_meta_built_model_trains_like_the_eager_one(tmp_path: Path):
    """What `diffattn train` does: build on the meta device; the loop allocates it and initialises it from
    torch.manual_seed(train.seed), which is the eager model built after that seed."""
    tcfg = _tcfg(seed=11, ckpt_every=0)
    torch.manual_seed(11)
    eager = train(TransformerLM(_cfg()), Progressions(), tcfg, progress=False).history
    with torch.device("meta"):
        meta_model = TransformerLM(_cfg())
    meta = train(meta_model, Progressions(), tcfg, out_dir=tmp_path, progress=False).history
    assert [r["train_loss"] for r in meta] == [r["train_loss"] for r in eager]
    assert load_checkpoint(tmp_path / "ckpt").train_state["step"] == 4


# ------------------------------------------------------------------------------------------------ compile

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="inductor needs a C compiler on CPU")


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_a_block_traces_in_one_graph(attention, ac):
    torch._dynamo.reset()
    model = TransformerLM(_cfg(attention=attention, dropout=0.0))
    set_activation_checkpointing(model, ac)
    x = torch.randn(2, 16, 32, requires_grad=True)
    pos = torch.arange(16)
    ex = torch._dynamo.explain(model.blocks[0])(x, model.body.rope(pos), pos, None, True)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason) for r in ex.break_reasons]


@pytest.mark.slow
@needs_cc
def test_regional_compile_follows_eager_losses():
    torch._dynamo.reset()
    kw = dict(steps=3, grad_accum=1, eval_every=0)
    one = {"dropout": 0.0, "n_layers": 1}
    ref, ref_model = _train("none", one, **kw)
    got, model = _train("full", one, compile=True, **kw)
    assert [r["train_loss"] for r in got] == pytest.approx([r["train_loss"] for r in ref], rel=1e-5, abs=1e-6)
    assert "body.blocks.0.attn.q_proj.weight" in dict(model.named_parameters())  # no wrapper module in names
    for p, q in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
