"""torch.compile over the static KV cache: one graph for every decode step, same logits as eager."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo

from diffattn import ModelConfig, TransformerLM

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="inductor needs a C compiler on CPU")


def test_compiled_decode_does_not_recompile_and_matches_full_forward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=2, attention="diff", max_seq_len=64)
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 24))
    with torch.no_grad():
        full = model(ids)
        model.setup_cache(1, 64)
        model(ids[:, :8], input_pos=torch.arange(8))
        step = torch.compile(model, dynamic=False)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        outs = [step(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(8, 24)]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    assert graphs == 1, f"decode compiled {graphs} graphs over 16 steps; the static cache should need one"
    torch.testing.assert_close(torch.cat(outs, 1), full[:, 8:], rtol=1e-4, atol=1e-5)
