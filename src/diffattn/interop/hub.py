"""``diffattn.load_pretrained(dir)`` and ``diffattn.load_pretrained_tokenizer(dir)``: read a ``save_pretrained``
folder (:mod:`diffattn.model.hub`, which writes it) back as its own model class, and its tokenizer;
:func:`training_info` says what a training checkpoint records about its run, for the model card.

The training checkpoint folder (:mod:`diffattn.train.checkpoint`: optimizer, RNG and train state, sha256) is separate.
"""

from __future__ import annotations

import json
import os
from typing import Any

from diffattn.model.hub import TOKENIZER_FILE, PretrainedError, check_folder, read_config
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM


def load_pretrained(path: str | os.PathLike, *, map_location: str = "cpu"):
    """The model saved in ``path`` by ``save_pretrained``, as its own class (TransformerLM, TransformerEncoder or
    TransformerClassifier), in eval mode. Local folders only; weights must match exactly."""
    classes = {c.__name__: c for c in (TransformerLM, TransformerEncoder, TransformerClassifier)}
    name = read_config(path)["diffattn_class"]
    if name not in classes:
        raise PretrainedError(f"{path}: unknown diffattn_class {name!r}; known: {sorted(classes)}")
    return classes[name].from_pretrained(path, map_location=map_location)


def load_pretrained_tokenizer(path: str | os.PathLike):
    """The tokenizer saved with the model in ``path``, or None when none was saved."""
    from diffattn.data.lm import tokenizer_from_dict

    f = check_folder(path) / TOKENIZER_FILE
    if not f.is_file():
        return None
    try:
        return tokenizer_from_dict(json.loads(f.read_text()))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise PretrainedError(f"{f}: not a valid tokenizer: {e}") from None


def training_info(checkpoint: Any) -> dict[str, Any]:
    """What a training checkpoint (:class:`diffattn.train.checkpoint.Checkpoint`) records about its run, as the
    ``training`` argument of ``save_pretrained``: the data (path and each file's sha256, or the synthetic
    task), steps, tokens seen, the last training and validation loss, the best validation loss and, for a
    classifier, the validation accuracy. Absent values are left out."""
    data = checkpoint.run_config.get("data") or {}
    fingerprint = data.get("fingerprint") or {}
    state = checkpoint.train_state or {}
    history = state.get("history") or []
    last_val = next((r["val_loss"] for r in reversed(history) if r.get("val_loss") is not None), None)
    info = {
        "checkpoint": str(checkpoint.path),
        "data": fingerprint.get("path") or data.get("path"),
        "data_sha256": {name: meta["sha256"] for name, meta in (fingerprint.get("files") or {}).items()} or None,
        "synthetic": data.get("synthetic"),
        "steps": state.get("step"),
        "tokens_seen": state.get("tokens_seen") or None,
        "final_train_loss": history[-1].get("train_loss") if history else None,
        "final_val_loss": last_val,
        "best_val_loss": state.get("best_val_loss"),
        "val_accuracy": state.get("val_accuracy"),
    }
    return {k: v for k, v in info.items() if v is not None}
