"""The command line lives in diffattn.cli: one module per command, and no library module below it parses
arguments or imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import diffattn
from diffattn.cli.main import COMMANDS

PKG = Path(diffattn.__file__).parent
# Still parsing its own arguments until its move lands (`python -m diffattn.data`).
NOT_YET_MOVED = {"data/lm.py", "data/__main__.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _library_modules() -> list[Path]:
    """Every module but the CLI's own and the package's entry point (``python -m diffattn``)."""
    return [p for p in sorted(PKG.rglob("*.py"))
            if p.relative_to(PKG).parts[0] != "cli" and p.relative_to(PKG).as_posix() != "__main__.py"]


def test_commands_live_in_cli() -> None:
    outside = {name: mod for name, (mod, _) in COMMANDS.items() if not mod.startswith("diffattn.cli.")}
    assert not outside, outside


def test_library_modules_hold_no_argparse_and_do_not_import_the_cli() -> None:
    argparse_users, cli_users = [], []
    for path in _library_modules():
        rel = path.relative_to(PKG).as_posix()
        names = _imports(path)
        if "argparse" in names and rel not in NOT_YET_MOVED:
            argparse_users.append(rel)
        if any(n == "diffattn.cli" or n.startswith("diffattn.cli.") for n in names):
            cli_users.append(rel)
    assert not argparse_users, f"argument parsing belongs in diffattn/cli/: {argparse_users}"
    assert not cli_users, f"modules below the CLI import it: {cli_users}"
