"""An optimizer's state_dict as a checkpoint stores it: its tensors (for safetensors) and the rest as JSON, and
back. Nothing is pickled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def split_optimizer_state(optimizer_state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Optimizer state_dict -> (tensors for safetensors, JSON-able rest). State keys may be ints (torch's own
    state_dict) or parameter names (torch.distributed.checkpoint's); the JSON records which."""
    tensors: dict[str, Tensor] = {}
    state_meta: list[dict[str, Any]] = []
    for i, (key, st) in enumerate(optimizer_state.get("state", {}).items()):
        entry: dict[str, Any] = {
            "key": key,
            "key_type": "int" if isinstance(key, int) else "str",
            "tensors": [],
            "values": {},
        }
        for k, v in st.items():
            if isinstance(v, Tensor):
                tensors[f"{i}.{k}"] = v.detach()  # gathered (a DTensor) and copied out as it is written
                entry["tensors"].append(k)
            else:
                entry["values"][k] = v
        state_meta.append(entry)
    groups = []
    for g in optimizer_state.get("param_groups", []):
        gg = {}
        for k, v in g.items():
            if isinstance(v, Tensor):
                v = v.item()
            gg[k] = list(v) if isinstance(v, tuple) else v
        groups.append(gg)
    return tensors, {"state": state_meta, "param_groups": groups}


def merge_optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_optimizer_state`: an optimizer state_dict from its tensors and JSON."""
    state: dict[Any, dict[str, Any]] = {}
    for i, entry in enumerate(meta["state"]):
        key = int(entry["key"]) if entry["key_type"] == "int" else entry["key"]
        st = dict(entry["values"])
        for k in entry["tensors"]:
            st[k] = tensors[f"{i}.{k}"]
        state[key] = st
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}
