"""How far a study's models got: the unigram floor of its data and each arm's distance from it.

A model that ignores context can do no better than the unigram distribution of the training text: its loss on the
validation split is the *unigram floor* (:func:`unigram_floor`). Arms whose validation loss is still close to it
have learned little beyond token frequencies, so whichever is ahead says little about the architectures, however
narrow the interval (a 5-minute budget gave 33 steps per cell, losses near the floor, and a bold "worse").
:func:`training_depth` says so, with the numbers: the floor, each arm's gain below it, tokens per parameter; the
report opens with it (as a --quick report opens with "smoke run")."""

from __future__ import annotations

from typing import Any

import numpy as np

# An arm that has gained less than this fraction of the floor is "barely trained" (char text: the floor is
# ~3 nats/token and a trained small model reaches ~1.5, a gain of ~50%; 33 steps gain a few %).
BARELY_GAIN = 0.10
MAX_TRAIN_TOKENS = 20_000_000  # the unigram counts read at most this much of the training split


def unigram_floor(source: Any, max_val_tokens: int) -> float:
    """Cross-entropy (nats/token) of the validation split (its first ``max_val_tokens``, as the cells' final
    validation reads it) under the training split's unigram distribution, add-one smoothed."""
    a, b = source.splits["train"]
    counts = np.bincount(np.asarray(source.tokens[a:min(b, a + MAX_TRAIN_TOKENS)], dtype=np.int64),
                         minlength=source.vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    va, vb = source.splits["val"]
    val = np.asarray(source.tokens[va:min(vb, va + max_val_tokens)], dtype=np.int64)
    return float(-logp[val].mean())


def training_depth(floor: float, arms: list[dict], tokens_per_cell: int) -> dict[str, Any]:
    """{"unigram_nats", "arms": {name: {"gain_nats", "gain_fraction", "tokens_per_param"}}, "barely"}: ``barely``
    when even the best arm has gained less than :data:`BARELY_GAIN` of the floor."""
    out = {}
    for a in arms:
        loss = a.get("val_loss_mean")
        if loss is None or not np.isfinite(loss):
            continue
        out[a["name"]] = {"gain_nats": floor - loss, "gain_fraction": (floor - loss) / floor,
                          "tokens_per_param": tokens_per_cell / max(1, a["params"])}
    best = max((v["gain_fraction"] for v in out.values()), default=None)
    return {"unigram_nats": floor, "arms": out, "barely": best is not None and best < BARELY_GAIN,
            "threshold": BARELY_GAIN}


def _against_floor(gain: float, fraction: float | None = None, unit: str = "") -> str:
    """"0.060 below" or "0.060 above" (a loss above the floor is a negative gain), with the fraction of the floor."""
    side = "below" if gain >= 0 else "above"
    return f"{abs(gain):.3f}{unit} {side}" + (f" ({abs(fraction):.0%})" if fraction is not None else "")


def depth_sentence(depth: dict[str, Any] | None, tokens_per_cell: int) -> str:
    """One sentence with the numbers: the floor, how far below (or above) it each arm got, tokens per parameter."""
    if not depth or not depth.get("arms"):
        return ""
    arms = depth["arms"]
    gains = ", ".join(f"{name} {_against_floor(v['gain_nats'], v['gain_fraction'])}" for name, v in arms.items())
    tpp = min(v["tokens_per_param"] for v in arms.values())
    return (f"Training depth: the unigram floor (a model that ignores context) is {depth['unigram_nats']:.3f} "
            f"nats/token; each arm's best validation loss against it: {gains}, after {tokens_per_cell:,} tokens "
            f"per cell, {tpp:.2g} tokens per parameter.")


def barely_note(depth: dict[str, Any]) -> str:
    """The command's closing note on a barely trained study: where the best arm stands against the floor."""
    best = max(v["gain_nats"] for v in depth["arms"].values())
    at = _against_floor(best, unit=" nats/token")
    where = f"only {at}" if best > 0 else f"{at}, not below,"
    return (f"note: barely trained: the best arm is {where} the unigram floor ({depth['unigram_nats']:.3f} "
            "nats/token); this budget says little about DIFF (more steps: --budget-minutes or --steps)")
