"""Imports sit at the top of a module. One inside a function is kept only for an optional or heavy dependency
(triton, transformers, matplotlib, optuna, datasets, tensorboard, FSDP) or for lazy command loading, and says
so in a comment on its line or on the line above, once for a group of imports (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

import diffattn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PKG = Path(diffattn.__file__).parent
PENDING: set[str] = set()


def uncommented_imports(source: str) -> list[tuple[int, str]]:
    """(line, statement) of every import inside a function with no comment on its lines or on the line above,
    and not directly below an import that has one (a group of imports shares its comment)."""
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    imports = sorted({(node.lineno, node.end_lineno) for fn in ast.walk(ast.parse(source))
                      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))})
    found, justified_until = [], -1
    for start, end in imports:
        above = start - 1
        if (set(range(start, end + 1)) & comments or justified_until == above
                or (above in comments and lines[above - 1].strip().startswith("#"))):
            justified_until = end
        else:
            found.append((start, lines[start - 1].strip()))
    return found


def test_every_import_inside_a_function_says_why() -> None:
    bad = [f"{path.relative_to(PKG).as_posix()}:{n}: {text}"
           for path in sorted(PKG.rglob("*.py")) if path.relative_to(PKG).as_posix() not in PENDING
           for n, text in uncommented_imports(path.read_text(encoding="utf-8"))]
    assert not bad, "imports inside functions without a reason (move them to the top, or say why):\n" + "\n".join(bad)


def test_the_check_reads_comments_on_the_line_and_above() -> None:
    src = ("def f():\n"
           "    import a  # optional\n"
           "    # heavy\n"
           "    import b\n"
           "    import bb\n"
           "\n"
           "    import c\n"
           "    from e import (\n"
           "        g,  # optional\n"
           "    )\n"
           "    x = 1  # not about d\n"
           "    import d\n")
    assert uncommented_imports(src) == [(7, "import c"), (12, "import d")]


# ------------------------------------------------------------------------------------------------------------
# An import made while the program runs (inside a function, or by importlib / __import__ with the module's name)
# is invisible to import-linter, which reads module-level imports: this check reads them all, so none climbs
# back up a layer (ops/backends.py once imported diffattn.attention by name, the package's one circle).
def _contracts() -> list[tuple[str, list[set[str]]]]:
    """Every layers contract of pyproject.toml: (its container, its layers top first, each a set of sibling names:
    "eval | interop" -> two)."""
    cfg = tomllib.loads((PKG.parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    return [(container, [{n.strip() for n in layer.split("|")} for layer in c["layers"]])
            for c in cfg["tool"]["importlinter"]["contracts"] if c["type"] == "layers" for container in c["containers"]]


def _layers() -> list[set[str]]:
    """The package's layer contract (container ``diffattn``)."""
    return next(layers for container, layers in _contracts() if container == "diffattn")


def _layer_of(module: str, layers: list[set[str]], container: str = "diffattn") -> tuple[int, str] | None:
    """(layer index, top-first; the sibling name) of ``CONTAINER.X...``, or None for a module on no layer."""
    prefix = container.split(".")
    parts = module.split(".")
    if parts[:len(prefix)] != prefix or len(parts) <= len(prefix):
        return None
    name = parts[len(prefix)]
    return next(((i, name) for i, names in enumerate(layers) if name in names), None)


def run_time_imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import of diffattn inside a function, and every
    ``importlib.import_module("diffattn...")`` / ``__import__("diffattn...")`` anywhere in ``source``."""
    found = []
    tree = ast.parse(source)
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    base = node.module
                    if node.level:  # relative: resolved against this module's package
                        base = ".".join(module.split(".")[:-node.level] + [node.module])
                    found.append((node.lineno, base))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                     or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
            found.append((node.lineno, node.args[0].value))
    return sorted({(n, m) for n, m in found if m.split(".")[0] == "diffattn"})


def climbing_imports(source: str, module: str, layers: list[set[str]], container: str = "diffattn") -> list[str]:
    """The run-time imports of ``module`` that reach a higher layer or a sibling of its own layer of ``container``."""
    here = _layer_of(module, layers, container)
    if here is None:
        return []
    bad = []
    for line, target in run_time_imports(source, module):
        there = _layer_of(target, layers, container)
        if there is not None and (there[0] < here[0] or (there[0] == here[0] and there[1] != here[1])):
            bad.append(f"{module}:{line} imports {target} at run time")
    return bad


def test_no_run_time_import_climbs_a_layer() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        bad += [b for container, layers in _contracts()
                for b in climbing_imports(path.read_text(encoding="utf-8"), module, layers, container)]
    assert not bad, "imports made at run time that climb a layer (import-linter cannot see them):\n" + "\n".join(bad)


def test_the_run_time_import_check_sees_importlib_and_function_imports() -> None:
    layers = _layers()
    src = ("import importlib\n"
           "def f():\n"
           "    importlib.import_module('diffattn.attention')\n"
           "def g():\n"
           "    from diffattn.model.config import ModelConfig\n"
           "    from diffattn.ops.core import sdpa  # same layer: fine\n")
    assert climbing_imports(src, "diffattn.ops.backends", layers) == [
        "diffattn.ops.backends:3 imports diffattn.attention at run time",
        "diffattn.ops.backends:5 imports diffattn.model.config at run time"]
    assert climbing_imports(src, "diffattn.cli.doctor", layers) == []
    system = next(layers for container, layers in _contracts() if container == "diffattn.system")
    assert climbing_imports("def f():\n    import diffattn.system.io_errors\n", "diffattn.system.run_lock", system,
                            "diffattn.system") == [
        "diffattn.system.run_lock:2 imports diffattn.system.io_errors at run time"]  # a sibling layer
    assert climbing_imports("def f():\n    import diffattn.system.run_lock\n", "diffattn.system.untrusted", system,
                            "diffattn.system") == [
        "diffattn.system.untrusted:2 imports diffattn.system.run_lock at run time"]  # up, inside the system layer
