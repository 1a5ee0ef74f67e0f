"""The run configs that ship with diffattn (``diffattn/configs/*.toml``): their names and paths. Imports nothing
heavy, so a command's ``--help`` lists them without loading torch."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from diffattn.system.untrusted import Refused


class ConfigNotFound(Refused):
    """``--config`` names neither a file nor a packaged config (one line; the run config raises it as a
    ConfigError)."""


def config_path(name: str) -> Path:
    """A TOML path, or the name of a packaged config (``tiny`` -> diffattn/configs/tiny.toml)."""
    p = Path(name)
    if p.is_file() or (p.exists() and not p.is_dir()):  # a FIFO is refused when it is read (read_toml)
        return p
    if len(p.parts) == 1 and not name.endswith(".toml"):
        packaged = resources.files("diffattn") / "configs" / f"{name}.toml"
        if packaged.is_file():
            return Path(str(packaged))
    raise ConfigNotFound(
        f"config {name!r} not found: not a file, and not a packaged config "
        f"(available: {', '.join(packaged_configs())})"
    )


def packaged_configs() -> list[str]:
    """The names of the packaged configs (``tiny``, ...), sorted."""
    d = resources.files("diffattn") / "configs"
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".toml")) if d.is_dir() else []
