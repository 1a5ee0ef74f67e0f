"""One place for refusals (issue 52): every error class the library raises for input it refuses is a
:class:`~diffattn.system.untrusted.Refused`, and ``cli/main.py`` turns any of them that no command caught into one line,
exit 2 (``export`` of a run whose best/ leads outside it ended in a traceback, exit 1: the CheckpointError its note
raised was no Refused)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from clirun import run_main

from diffattn.system.untrusted import Refused

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).resolve().parents[2] / "src"
# what a class may derive from and still be no refusal: Python's own input errors are for bad calls (programming
# errors), the library's refusals are Refused
PLAIN = {"ValueError", "TypeError"}


def _error_classes() -> list[tuple[str, str, str]]:
    """(module, class, base) of every class in the package whose base is ValueError or TypeError."""
    found = []
    for path in sorted((SRC / "diffattn").rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in PLAIN:
                        found.append((module, node.name, base.id))
    return found


def test_the_library_defines_no_refusal_outside_refused():
    """A class deriving from ValueError directly is a refusal no one place catches: only Refused itself does."""
    assert _error_classes() == [("diffattn.system.untrusted", "Refused", "ValueError")]


@pytest.mark.parametrize("module,name", [
    ("diffattn.checkpoint.verify", "CheckpointError"), ("diffattn.checkpoint.verify", "CheckpointRefused"),
    ("diffattn.checkpoint.output_guard", "OutputError"), ("diffattn.checkpoint.hf_families", "FamilyError"),
    ("diffattn.checkpoint.tensor_files", "TensorFileError"), ("diffattn.configs.fields", "ConfigError"),
    ("diffattn.data.text", "DataError"), ("diffattn.model.pretrained", "PretrainedError"),
    ("diffattn.system.run_lock", "FolderInUse"), ("diffattn.experiments.study.spec", "StudyError"),
    ("diffattn.eval.checkpoint_eval", "EvalError"), ("diffattn.ops.backends", "BackendError")])
def test_a_refusal_no_command_caught_is_one_line_exit_2(monkeypatch, module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, Refused) and issubclass(cls, ValueError)  # callers catching ValueError still do

    def refuse(args):
        raise cls("crafted\x1b[2J input refused")

    import diffattn.cli.info as info

    monkeypatch.setattr(info, "run", refuse)
    r = run_main("info", "anything")
    assert r.returncode == 2 and r.stderr == "error: crafted\\x1b[2J input refused\n", r.stderr
