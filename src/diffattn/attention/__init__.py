"""The attention registry and one file per variant: reference op, fast op, module, registry entry.

Every module of this package is imported here, so a variant's file registers itself (``@register``) as soon as
the package is imported: a new variant is one new file and nothing else. Every registered module class is
exported from here by its class name (``from diffattn.attention import DistanceAttention``), and from the
top-level package (``diffattn.DistanceAttention``).
"""

import importlib
import pkgutil
from types import ModuleType

from diffattn.attention.registry import attention_classes


def import_submodules(package: str) -> list[ModuleType]:
    """Import every module directly inside ``package`` (a dotted name), in name order; returns them."""
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    return [importlib.import_module(f"{package}.{name}") for name in names]


import_submodules(__name__)
globals().update(attention_classes())
__all__ = ["import_submodules", *sorted(attention_classes())]
