"""continuation_logprobs (issue 23, item 2): batched, padded, sorted and truncated scoring equals the plain
definition, one request at a time, for every attention type."""

from __future__ import annotations

import math

import pytest
import torch

from diffattn.attention.registry import ATTENTION
from diffattn.eval.loglik import continuation_logprobs
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(attention: str) -> TransformerLM:
    torch.manual_seed(0)
    n_heads = 2 if ATTENTION[attention].head_split == 2 else 4
    cfg = ModelConfig(vocab_size=23, d_model=32, n_layers=2, n_heads=n_heads, attention=attention, max_seq_len=16,
                      init_std=0.3)
    return TransformerLM(cfg).eval()


@torch.no_grad()
def _plain(model: TransformerLM, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """The definition: the last 17 tokens of ctx + cont, one forward, log p of each continuation token given
    everything before it."""
    seq = (ctx + cont)[-17:]
    logp = torch.log_softmax(model(torch.tensor([seq[:-1]]))[0].double(), -1)
    total, greedy = 0.0, True
    for j in range(len(seq) - len(cont), len(seq)):
        total += logp[j - 1, seq[j]].item()
        greedy &= int(logp[j - 1].argmax()) == seq[j]
    return total, greedy


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_batched_scores_equal_the_definition(attention):
    model = _model(attention)
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 23, (n,), generator=g).tolist()

    # short and long pairs (a 30-token pair is left-truncated to the context), one-token continuations
    requests = [(ids(3), ids(2)), (ids(1), ids(1)), (ids(12), ids(4)), (ids(25), ids(5)), (ids(7), ids(1)),
                (ids(2), ids(14))]
    got = continuation_logprobs(model, requests, batch_size=4)
    for (ctx, cont), (score, greedy) in zip(requests, got):
        want, want_greedy = _plain(model, ctx, cont)
        assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-5) and greedy == want_greedy
    one_by_one = continuation_logprobs(model, requests, batch_size=1)  # no padding at all
    assert all(math.isclose(a[0], b[0], rel_tol=1e-6, abs_tol=1e-5) and a[1] == b[1] for a, b in zip(got, one_by_one))


def test_greedy_flag_is_true_for_the_argmax_continuation():
    model = _model("diff")
    ctx = [1, 2, 3]
    with torch.no_grad():
        best = int(model(torch.tensor([ctx]))[0, -1].argmax())
    (_, greedy), (_, other) = continuation_logprobs(model, [(ctx, [best]), (ctx, [(best + 1) % 23])])
    assert greedy and not other


def test_bad_requests_are_refused():
    model = _model("standard")
    with pytest.raises(ValueError, match="non-empty"):
        continuation_logprobs(model, [([], [1])])
    with pytest.raises(ValueError, match="does not fit"):
        continuation_logprobs(model, [([1], list(range(17)))])
