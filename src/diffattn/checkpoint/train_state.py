"""What a checkpoint's ``train_state`` may hold, checked when the checkpoint is read, so that no reader (``info``,
``eval``, ``export``, a resume) meets a field of the wrong type or an absurd size and ends in a traceback.

The train state is JSON that a run writes (:mod:`diffattn.train.run_state`); a folder from elsewhere may hold
anything there. :func:`check_train_state` checks every field a reader uses (the counters, the best evaluation, the
history, the RNG scalars, the recorded train section) and leaves the others (a convert's provenance, a task's
metrics) as they are; :func:`check_tokenizer_fits` checks a checkpoint's tokenizer against its model's
vocabulary. Each raises ValueError with one phrase; the checkpoint reader names the folder."""

from __future__ import annotations

import math
from typing import Any

from diffattn.system.atomic_files import printable

MAX_COUNT = 2**53  # steps, tokens: a float64 holds every count up to here exactly (a step of 10³⁰ is refused)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_COUNT


def _number_or_none(v: Any) -> bool:
    return v is None or _is_number(v)


def _best(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and isinstance(v.get("metric"), str) and _is_number(v.get("value"))
                         and _count(v.get("step")))


def _history(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(r, dict) and all(isinstance(k, str) for k in r) for r in v)


def _rng_meta(v: Any) -> bool:
    """The scalars of Python's and numpy's RNG states (:func:`diffattn.train.run_state.rng_state`)."""
    if not isinstance(v, dict):
        return False
    py, np_ = v.get("python"), v.get("numpy")
    if py is not None and not (isinstance(py, list) and len(py) == 2 and _is_int(py[0])
                               and _number_or_none(py[1])):
        return False
    return np_ is None or (isinstance(np_, list) and len(np_) == 4 and isinstance(np_[0], str)
                           and _is_int(np_[1]) and 0 <= np_[1] <= 624 and _is_int(np_[2]) and np_[2] in (0, 1)
                           and _is_number(np_[3]))


def _train_config(v: Any) -> bool:
    return isinstance(v, dict) and all(_count(v[k]) for k in ("batch_size", "grad_accum", "seq_len", "seed")
                                       if k in v)


# field -> (what it must be, the check); a field that is absent or None is left alone unless its check says
_FIELDS = {
    "step": ("a whole number from 0 to 2**53", _count),
    "tokens_seen": ("a whole number from 0 to 2**53", _count),
    "best_val_loss": ("a number", _number_or_none),
    "best": ('an object {"metric", "value", "step"}', _best),
    "history": ("a list of objects", _history),
    "elapsed_s": ("a finite number >= 0", lambda v: _is_number(v) and math.isfinite(v) and v >= 0),
    "rng_meta": ("the RNG scalars diffattn writes", _rng_meta),
    "world_size": ("a whole number >= 1", lambda v: _count(v) and v >= 1),
    "train_config": ("an object of the run's train settings", _train_config),
    "scaler": ("an object", lambda v: isinstance(v, dict)),
    "converted_from": ("an object", lambda v: isinstance(v, dict)),
}


def check_train_state(state: Any) -> dict[str, Any]:
    """``state`` (a checkpoint's ``train_state``) when every field a reader uses has its type and a sane size;
    ValueError naming the first field that does not."""
    if not isinstance(state, dict):
        raise ValueError(f"train_state must be an object, got {type(state).__name__}")
    for name, (what, ok) in _FIELDS.items():
        v = state.get(name)
        if v is not None and not ok(v):
            raise ValueError(f"train_state.{name} must be {what}, got {printable(repr(v))[:80]}")
    return state


def check_tokenizer_fits(tokenizer: Any, vocab_size: int) -> None:
    """ValueError when ``tokenizer`` (a checkpoint's) gives ids the model's embedding has no row for."""
    n = getattr(tokenizer, "vocab_size", None)
    if _is_int(n) and n > vocab_size:
        raise ValueError(f"its tokenizer has {n:,} tokens but the model's vocabulary only {vocab_size:,}: the "
                         "tokenizer is not this model's")
