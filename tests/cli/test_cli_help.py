"""`diffattn --help` output: each default shown once, lists as typed, a real description for every command, and
`diffattn --version`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch
from clirun import SRC, run_diffattn, run_main

import diffattn
from diffattn.cli.main import COMMANDS, DefaultsHelpFormatter

# Prints every command's --help in one fresh interpreter (one process, not one per command: each start-up
# imports torch, tens of seconds on a loaded machine), separated by a marker line.
_ALL_HELP = """
import sys
from diffattn.cli import main as cli
for name in cli.COMMANDS:
    print("=== " + name, flush=True)
    try:
        cli.main([name, "--help"])
    except SystemExit as e:
        assert e.code == 0, (name, e.code)
"""


def _options(help_text: str) -> list[str]:
    """The entries of the argument sections of a --help text, each joined to one line: an entry starts two spaces
    in and goes on over the lines indented further (the usage lines come before any entry and are skipped)."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):
            entries.append(line.strip())
        elif line.startswith("   ") and entries:
            entries[-1] += " " + line.strip()
    return entries


def _all_help() -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _ALL_HELP], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    parts = re.split(r"^=== (\S+)\n", r.stdout, flags=re.M)[1:]
    return dict(zip(parts[0::2], parts[1::2]))


def test_every_command_help_shows_each_default_once_and_no_list_reprs() -> None:
    helps = _all_help()
    assert sorted(helps) == sorted(COMMANDS)
    n_defaults = 0
    for name, text in helps.items():
        opts = _options(text)
        assert opts, f"{name}: no options parsed from\n{text}"
        for entry in opts:
            assert entry.lower().count("(default") <= 1, f"diffattn {name}: default repeated: {entry}"
            assert "(default: None)" not in entry and "(default: False)" not in entry, f"diffattn {name}: {entry}"
            assert not re.search(r"\[('|\d)", entry), f"diffattn {name}: a Python list in the help: {entry}"
            n_defaults += "(default: " in entry
    # the formatter still adds defaults the help text does not mention
    assert n_defaults >= 5
    assert re.search(r"--bits BITS\s+quantization bit widths \(default: 16,8,6,4\)", helps["eval"])
    assert re.search(r"--seeds SEEDS\s+.*\(default: 3\)", helps["study"])


def test_formatter_rules() -> None:
    p = argparse.ArgumentParser(prog="x", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--a", type=int, default=5, help="an int")
    p.add_argument("--b", default=None, help="none")
    p.add_argument("--c", action="store_true", help="a flag")
    p.add_argument("--d", default=["p", "q"], help="a list")
    p.add_argument("--e", default=1000, help="steps (default 1000, --quick 12)")
    p.add_argument("--f", default="", help="empty")
    p.add_argument("--g", default="50%", help="a percentage")
    p.add_argument("--h2", default=3, help="Default 3: because")
    p.add_argument("pos", help="required positional")
    lines = {e.split()[0]: e for e in _options(p.format_help())}
    assert lines["--a"].endswith("an int (default: 5)")
    assert lines["--b"].endswith("none")
    assert lines["--c"].endswith("a flag")
    assert lines["--d"].endswith("a list (default: p,q)")
    assert lines["--e"].endswith("steps (default 1000, --quick 12)")
    assert lines["--f"].endswith("empty")
    assert lines["--g"].endswith("a percentage (default: 50%)")
    assert lines["--h2"].endswith("Default 3: because")
    assert lines["pos"].endswith("required positional")


def test_info_has_a_command_description() -> None:
    r = run_main("info", "--help")
    assert r.returncode == 0, r.stderr
    description = r.stdout.split("\n\n")[1]
    # was checkpoint.py's module docstring ("Checkpoints: a directory of safetensors + JSON files, ...")
    assert "directory of safetensors" not in description
    assert description.startswith("Print a checkpoint's")


def test_version() -> None:
    r = run_diffattn("--version", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"diffattn {diffattn.__version__} (torch {torch.__version__})"


def test_every_option_of_every_command_has_help() -> None:
    """compare's --d-model, --n-layers, --batch-size and --lr and eval's --batch-size and --seed once had none."""
    from diffattn.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"diffattn {name} {'/'.join(a.option_strings) or a.dest}"
               for name, parser in sub.choices.items() for a in parser._actions
               if a.dest != "help" and not (a.help or "").strip()]
    assert sorted(sub.choices) == sorted(COMMANDS)
    assert not missing, f"options without help: {missing}"


def test_help_texts_say_what_runs_get() -> None:
    """Issue 32: `doctor --help` stopped mid-sentence (a docstring's first line, not its first sentence),
    `convert --help` left out dint, `study --help` gave --n-heads default 4 while runs take their heads from the
    width rule, and `train --help` did not list the --section.field fields. (Issue 42: convert's help names no
    list of types, which a new variant's recipe would leave stale; a --to that has no recipe lists them all.)"""
    import dataclasses

    from diffattn.cli.main import build_parser
    from diffattn.configs.field_list import FIELDS
    from diffattn.configs.run_config import SECTIONS, field_items
    from diffattn.experiments.study.defaults import default_head_dim
    from diffattn.experiments.study.spec import head_counts
    from diffattn.interop.convert import check_request, targets

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in sub.items():
        assert parser.description.rstrip().endswith("."), f"diffattn {name}: {parser.description!r}"
    assert sub["doctor"].description.endswith("each registered attention variant.")
    to = next(a for a in sub["convert"]._actions if a.dest == "to")
    helps = to.help + sub["convert"].description
    named = [t for t in targets() if t not in ("diff", "standard") and t in helps]  # standard: the source as it is
    assert "dint" in targets() and not named
    with pytest.raises(ValueError, match=", ".join(targets())):
        check_request("nope", "exact")
    n_heads = next(a for a in sub["study"]._actions if a.dest == "n_heads").help
    w = default_head_dim(128)
    assert "default 4" not in n_heads and "width rule" in n_heads
    assert f"d_model 128: width {w}, DIFF {head_counts(128, w, 'diff')}, baseline {head_counts(128, w, 'standard')}" \
        in n_heads
    assert FIELDS == field_items(), "configs/field_list.py is stale: write field_items() into it"
    epilog = " ".join(sub["train"].format_help().split("Every field of the run config")[1].split())
    for section, cls in SECTIONS.items():
        listed = epilog.split(f"--{section}. ")[1].split(" --")[0]
        for f in dataclasses.fields(cls):
            assert (f.name in listed) == (f.name != "fingerprint"), (section, f.name, listed)
    assert "attention='diff'" in epilog and "vocab_size (from the data)" in epilog
