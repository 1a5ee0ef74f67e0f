"""Tiny random transformers models saved as users' folders: the save and the perturbation every family test
shares (transformers is imported by the caller's ``importorskip``, here only when called)."""

from __future__ import annotations

from pathlib import Path

import torch

#: Gemma 3's two RoPE settings as transformers 5 writes them: the sliding layers' local base, the global layers'
#: base with linear scaling (every family test's Gemma 3 config uses both, so a swap shows).
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}


def nudged(model, scale: float, *, vectors_only: bool = False):
    """``model`` with ``scale``·N(0, 1) added to its parameters (``vectors_only``: its norm gains and biases only),
    in place: gains of one and biases of zero would hide a wrong mapping. Returns it."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 or not vectors_only:
                p.add_(scale * torch.randn_like(p))
    return model


def save_hf(model, folder: Path, tok=None) -> Path:
    """``model.save_pretrained(folder)`` without transformers' progress bar, and ``tok``'s ``tokenizer.json``
    beside it when given. Returns ``folder``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        transformers.utils.logging.enable_progress_bar()
    if tok is not None:
        tok.tok.save(str(Path(folder) / "tokenizer.json"))
    return Path(folder)
