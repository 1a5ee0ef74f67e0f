"""A run config written as TOML (``resolved.toml``): what :mod:`tomllib` reads back as the same run config."""

from __future__ import annotations

import json
import math
from typing import Any

from diffattn.configs.run_config import ConfigError


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also wants DEL escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        if any(x is None for x in v):
            raise ConfigError(f"TOML arrays cannot hold None: {v!r}")
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{" + items + "}"
    raise ConfigError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _toml_key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def to_toml(cfg: dict[str, Any]) -> str:
    """Write a run config as TOML (None values, which TOML cannot express, become comments and read back as
    absent -> the field's default). Nested tables in a section are written as inline tables."""
    lines: list[str] = []
    scalars = {k: v for k, v in cfg.items() if not isinstance(v, dict)}
    for k, v in scalars.items():
        lines.append(f"# {k} = None" if v is None else f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in cfg.items():
        if not isinstance(v, dict):
            continue
        lines += ["", f"[{_toml_key(k)}]"]
        for kk, vv in v.items():
            lines.append(f"# {kk} = None" if vv is None else f"{_toml_key(kk)} = {_toml_value(vv)}")
    return "\n".join(lines) + "\n"
