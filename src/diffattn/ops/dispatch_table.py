"""The dispatch table that ``auto`` reads (:mod:`diffattn.ops.backends`): ``dispatch.json`` beside this module,
rows keyed by (kernel family, device capability such as ``sm_90``, dtype), each naming the layout measured fastest
there and the results file it came from. Plain data and its reader."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

DISPATCH_FILE = Path(__file__).with_name("dispatch.json")


@dataclass(frozen=True)
class Row:
    """One measured row of the dispatch table: on ``capability`` (``sm_90``; :func:`capability`) in ``dtype``
    ("bfloat16"), ``auto`` runs ``layout`` (a kernel of ``family``, or its safe path) and ``epilogue`` ("eager"
    or "compiled": V1's λ, subtraction, per-head norm and scale in one compiled region); ``source`` is the results
    file it was measured in and ``measured`` what it showed (a line)."""

    family: str
    capability: str
    dtype: str
    layout: str
    source: str
    measured: str = ""
    epilogue: str = "eager"


ROW_KEYS = tuple(Row.__dataclass_fields__)


def parse_rows(data: object, where: str) -> list[Row]:
    """The rows of a dispatch table as read from JSON (``{"rows": [{...}, ...]}``); a ValueError naming ``where``
    and the bad row otherwise."""
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{where}: a dispatch table is {{\"rows\": [...]}}")
    out = []
    for i, r in enumerate(rows):
        need = {"family", "capability", "dtype", "layout", "source"}
        if (not isinstance(r, dict) or not need <= set(r) or not set(r) <= set(ROW_KEYS)
                or not all(isinstance(v, str) for v in r.values())):
            raise ValueError(f"{where}: row {i} must have the string fields {sorted(need)} (and optionally "
                             f"measured, epilogue); got {r!r}")
        if r.get("epilogue", "eager") not in ("eager", "compiled"):
            raise ValueError(f"{where}: row {i}: epilogue must be 'eager' or 'compiled', got {r['epilogue']!r}")
        out.append(Row(**r))
    return out


@functools.lru_cache(maxsize=1)
def shipped_table() -> tuple[Row, ...]:
    return tuple(parse_rows(json.loads(DISPATCH_FILE.read_text()), str(DISPATCH_FILE.name)))


def capability(device: torch.device | str) -> str:
    """The table's device key: ``sm_<major><minor>`` for a CUDA device, else the device type ("cpu")."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return device.type
