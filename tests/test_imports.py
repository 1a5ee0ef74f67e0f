"""Imports sit at the top of a module. One inside a function is kept only for an optional or heavy dependency
(triton, transformers, matplotlib, optuna, datasets, tensorboard, FSDP) or for lazy command loading, and says
so in a comment on its line or on the line above, once for a group of imports (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import diffattn

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
