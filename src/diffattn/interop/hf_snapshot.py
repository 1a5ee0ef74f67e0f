"""The code a custom-code transformers folder carries: diffattn's own modules, copied, with their imports made
relative (``diffattn export RUN --to hf`` for the attention types transformers does not ship).

transformers loads a folder's custom code (``trust_remote_code=True``) by copying the module its ``auto_map``
names and, recursively, every module that one imports as ``from .NAME import ...``, all from the folder itself
(one flat folder: a relative import names a file beside it). So the snapshot is flat: each diffattn module
``diffattn.a.b`` becomes ``diffattn_a_b.py`` (the two interop modules transformers names become
``modeling_diffattn.py`` and ``configuration_diffattn.py``), and each ``from diffattn.a.b import X`` becomes
``from .diffattn_a_b import X``. The modules copied are those the model needs, found by reading the imports:
:mod:`diffattn.interop.hf_custom_model` and, for each attention type the model uses, its class's module in the
registry (importing it registers the type), then everything they import from diffattn, lazily imported ones too.
Nothing is written twice: a change to an attention file is in the next export.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from pathlib import Path

from diffattn.attention.registry import ATTENTION

PACKAGE = "diffattn"
MODELING = "diffattn.interop.hf_custom_model"
CONFIGURATION = "diffattn.interop.hf_custom_config"
#: The modules transformers names by its conventions (``auto_map``), and the classes it loads from them.
RENAMED = {MODELING: "modeling_diffattn", CONFIGURATION: "configuration_diffattn"}
AUTO_MAP = {"AutoConfig": "configuration_diffattn.DiffattnConfig",
            "AutoModelForCausalLM": "modeling_diffattn.DiffattnForCausalLM"}


def file_stem(module: str) -> str:
    """The snapshot's name of diffattn module ``module`` (``diffattn.ops.core`` -> ``diffattn_ops_core``)."""
    return RENAMED.get(module) or module.replace(".", "_")


def _source_file(module: str) -> Path | None:
    """The file of ``module`` when it is a plain module (None: a package or nothing)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
        return None
    return Path(spec.origin)


def _ours(name: str | None) -> bool:
    return name is not None and (name == PACKAGE or name.startswith(PACKAGE + "."))


def _targets(node: ast.ImportFrom) -> list[tuple[str, str, str | None]]:
    """(module, name, alias) for each name ``from diffattn.x import name [as alias]`` brings in; the module is
    ``diffattn.x.name`` when ``diffattn.x`` is a package and ``name`` a module of it."""
    out = []
    for a in node.names:
        sub = f"{node.module}.{a.name}"
        if _source_file(node.module) is None and _source_file(sub) is not None:
            out.append((sub, "", a.asname or a.name))  # a module of a package: bound as a module
        elif _source_file(node.module) is not None:
            out.append((node.module, a.name, a.asname))
        else:
            raise ValueError(f"cannot snapshot `from {node.module} import {a.name}`: a package's own names do not "
                             "travel (import them from the module that defines them)")
    return out


def _imports(source: str) -> list[tuple[ast.AST, list[tuple[str, str, str | None]]]]:
    """Every diffattn import of ``source`` (at any depth: lazy ones too), with what it binds."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(_ours(a.name) for a in node.names):
            raise ValueError(f"cannot snapshot `import {node.names[0].name}` (line {node.lineno}): use from-imports")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            found.append((node, _targets(node)))
    return found


def _import_line(indent: str, module: str, name: str, alias: str | None) -> str:
    if not name:  # a module bound by name
        return f"{indent}from . import {file_stem(module)} as {alias}"
    return f"{indent}from .{file_stem(module)} import {name}" + (f" as {alias}" if alias else "")


_LITERAL = re.compile(r"""(importlib\.import_module\()(["'])(diffattn(?:\.\w+)+)\2\)""")


def rewrite(source: str) -> str:
    """``source`` with every diffattn import relative to the snapshot (each name on its own line, at the
    import's indentation) and ``importlib.import_module("diffattn.x")`` resolved inside the snapshot too."""
    lines = source.splitlines(keepends=True)
    for node, targets in sorted(_imports(source), key=lambda e: -e[0].lineno):
        indent = " " * node.col_offset
        new = [_import_line(indent, *t) + "\n" for t in targets]
        lines[node.lineno - 1:node.end_lineno] = new
    text = "".join(lines)
    return _LITERAL.sub(lambda m: f'{m[1]}".{file_stem(m[3])}", __package__)', text)


def snapshot_problems(types: list[str]) -> list[str]:
    """Why the code of attention ``types`` cannot travel in a snapshot (empty: it can): a type registered from
    outside diffattn (a script's, a test's) has no module the snapshot may copy."""
    return [f"attention {t!r} is registered from {ATTENTION[t].__module__}, outside the diffattn package, so its "
            "code cannot be copied into a custom-code folder (add it as a file of diffattn/attention)"
            for t in sorted(set(types)) if not _ours(ATTENTION[t].__module__)]


def modules_needed(types: list[str]) -> list[str]:
    """The diffattn modules a model of attention ``types`` needs, in name order: the modeling module, each
    type's module in the registry, and every diffattn module they import (transitively, lazy imports too)."""
    todo = [MODELING, CONFIGURATION, *(ATTENTION[t].__module__ for t in types)]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _source_file(module)
        if path is None:
            raise ValueError(f"cannot snapshot {module}: not a plain module")
        for _, targets in _imports(path.read_text(encoding="utf-8")):
            todo += [m for m, _, _ in targets]
        todo += [m for m in _literal_modules(path.read_text(encoding="utf-8")) if _source_file(m) is not None]
    return sorted(seen)


def _literal_modules(source: str) -> list[str]:
    return [m[3] for m in _LITERAL.finditer(source)]


def _bound_as_modules(modules: list[str]) -> list[str]:
    """The modules that ``modules`` import only as modules (``from diffattn.ops import backends``): written
    ``from . import NAME``, which transformers' search for the files to copy does not see."""
    bound = set()
    for module in modules:
        path = _source_file(module)
        assert path is not None  # modules_needed checked it
        for _, targets in _imports(path.read_text(encoding="utf-8")):
            bound |= {m for m, name, _ in targets if not name}
    return sorted(bound)


def _registration_block(types: list[str], modules: list[str]) -> str:
    """The lines the modeling file ends with: an import of each type's module (it registers the type), and of
    each module bound only as ``from . import NAME`` (transformers copies a custom model's files by following
    ``from .NAME import`` lines)."""
    lines = ["", "", "# Added by `diffattn export`: the attention types this model uses (importing a type's module",
             "# registers it) and the modules imported as modules (transformers copies the files a custom model's",
             "# `from .NAME import` lines name)."]
    for t in sorted(set(types)):
        cls = ATTENTION[t]
        lines.append(f"from .{file_stem(cls.__module__)} import {cls.__name__}  # registers {t!r}")
    lines += [f"from .{file_stem(m)} import __name__ as _{file_stem(m)}" for m in _bound_as_modules(modules)]
    return "\n".join(lines) + "\n"


def write_snapshot(folder: Path, types: list[str]) -> list[str]:
    """Write the modules a model of attention ``types`` needs into ``folder`` (:func:`modules_needed`,
    rewritten by :func:`rewrite`); returns the file names written.

    The configuration module ends with the hash of the others: transformers keeps, for the rest of the process,
    one model class per configuration class, and takes the configuration class of a folder by the hash of its
    file; so two folders whose model code differs (another attention type) must differ there too."""
    modules = modules_needed(types)
    texts = {}
    for module in modules:
        path = _source_file(module)
        assert path is not None  # modules_needed checked it
        text = rewrite(path.read_text(encoding="utf-8"))
        if module == MODELING:
            text += _registration_block(types, modules)
        texts[file_stem(module) + ".py"] = text
    digest = hashlib.sha256()
    for name in sorted(n for n in texts if n != "configuration_diffattn.py"):
        digest.update(name.encode() + b"\0" + texts[name].encode() + b"\0")
    texts["configuration_diffattn.py"] += f"\n\nMODEL_CODE = {digest.hexdigest()!r}  # sha256 of the model code files\n"
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    return sorted(texts)
