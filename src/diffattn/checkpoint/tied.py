"""Tied weights in a state dict: entries that share one storage, stored once (safetensors refuses shared
tensors) and re-created as aliases on load (:attr:`diffattn.checkpoint.format.Checkpoint.tied`)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def storage_key(t: Tensor) -> tuple | None:
    """Equal for two tensors that are the same view of one storage (tied weights); None for an empty one."""
    if t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def tied_aliases(state: Mapping[str, Tensor]) -> dict[str, str]:
    """{alias: stored name} for the entries of a model's state dict that share another entry's storage (tied
    weights), as :attr:`~diffattn.checkpoint.format.Checkpoint.tied` records them; nothing is copied."""
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = storage_key(t)
        if key is not None and key in seen:
            tied[name] = seen[key]
        elif key is not None:
            seen[key] = name
    return tied


def dedup_state_dict(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store each storage once (safetensors refuses shared tensors). Returns (tensors, {alias: stored}); the
    tensors are the state dict's own (DTensors are gathered one at a time as they are written)."""
    out: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"state dict entry {name!r} is not a tensor ({type(t).__name__})")
        t = t.detach()
        key = storage_key(t.to_local() if hasattr(t, "full_tensor") else t)
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out[name] = t
    return out, tied
