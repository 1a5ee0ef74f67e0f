"""Log-likelihood of continuations, batched: what lm-evaluation-harness asks a language model for.

``continuation_logprobs(model, [(context ids, continuation ids), ...])`` returns, for each pair, the sum of
``log p(continuation token | everything before it)`` and whether greedy decoding would have produced the
continuation (every continuation token is the argmax). The conventions are the harness's for causal models
(``lm_eval.models.huggingface``), so the numbers match ``--model hf`` on an exported folder:

* the model sees ``(context + continuation)[-(L + 1):][:-1]`` (L = ``max_length``): a pair longer than the
  context is left-truncated, and the last continuation token is predicted, never fed;
* log-probabilities are a float32 ``log_softmax`` over the model's whole vocabulary;
* requests run longest first, ``batch_size`` at a time, right-padded: in a causal model the padding after a
  row's last token cannot change that row's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


@torch.no_grad()
def continuation_logprobs(model: nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                          max_length: int | None = None, batch_size: int = 1,
                          pad_id: int = 0) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), is greedy) per (context ids, continuation ids) pair, in the order
    given. ``model(ids (B, T)) -> logits (B, T, V)``, a causal LM; ``max_length`` defaults to its
    ``config.max_seq_len``. Both parts of a pair must be non-empty (an empty context needs a prefix token:
    the caller's choice)."""
    length = int(max_length or model.config.max_seq_len)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for ctx, cont in requests:
        if not ctx or not cont:
            raise ValueError("every request needs a non-empty context and a non-empty continuation")
        if len(cont) > length:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit in the context ({length})")
    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            inputs = [(list(requests[i][0]) + list(requests[i][1]))[-(length + 1):][:-1] for i in rows]
            width = max(len(x) for x in inputs)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
            for r, x in enumerate(inputs):
                ids[r, :len(x)] = torch.tensor(x, dtype=torch.long)
            logp = torch.log_softmax(model(ids).float(), dim=-1)  # (B, T, V)
            for r, (i, x) in enumerate(zip(rows, inputs)):
                cont = torch.tensor(list(requests[i][1]), dtype=torch.long, device=device)
                span = logp[r, len(x) - len(cont):len(x)]  # (C, V): the predictions of the continuation
                greedy = bool((span.argmax(-1) == cont).all())
                out[i] = (float(span.gather(-1, cont[:, None]).sum()), greedy)
    finally:
        model.train(was_training)
    return out
