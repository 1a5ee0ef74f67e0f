"""Typed values from a TOML file or the command line: the walk over a dataclass's field types that the run config
(:mod:`diffattn.configs.run_config`) uses for every section, and its one-line :class:`ConfigError`. A value typed
on the command line (:class:`Given`) is parsed as a literal and converted to its field's type; a TOML value is
typed already and only checked."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from diffattn.system.untrusted import Refused


class ConfigError(Refused):
    """A run config or a command-line override is invalid."""


def checked(make: Any) -> Any:
    """``make()``, a dataclass's own check failing as a ConfigError."""
    try:
        return make()
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def parse_literal(raw: str) -> Any:
    """Untyped value from the command line: bool, None, int, float, JSON list/dict, else the string."""
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.strip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw


class Given(str):
    """A value as typed on the command line: converted to its field's type (a TOML value is typed already)."""


NAMES = {bool: "a bool (true/false)", int: "an int", float: "a number", str: "a string",
          dict: "a table / JSON object", list: "a list"}


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` (a TOML value, or a :class:`Given` string) as the annotated type ``tp``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, Given) and value.strip().lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot parse {value!r}")
    base = typing.get_origin(tp) or tp
    given = parse_literal(value) if isinstance(value, Given) and base is not str else value
    if base is Any:
        return given
    if base is float and isinstance(given, int) and not isinstance(given, bool):
        given = float(given)  # a float field takes any number
    if base is bool and isinstance(value, Given) and value.strip().lower() in ("1", "0", "yes", "no"):
        given = value.strip().lower() in ("1", "yes")
    if isinstance(given, base) and not (base is int and isinstance(given, bool)):
        return str(given) if base is str else given
    shown = str(value) if isinstance(value, Given) else value
    raise ConfigError(f"{where}: expected {NAMES.get(base, getattr(base, '__name__', base))}, got {shown!r}")


def literal(v: Any) -> Any:
    return parse_literal(v) if isinstance(v, Given) else v


def is_table(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict or any(is_table(a) for a in typing.get_args(tp))
