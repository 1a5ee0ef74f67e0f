"""cli/options.py: the option types and helpers several commands share (in-process)."""

from __future__ import annotations

import argparse

import pytest

from diffattn.cli.options import add_output_folder, int_at_least, usage_error


def test_int_at_least_messages():
    assert int_at_least("--steps", 1)("5") == 5
    assert int_at_least("--threads", 0)("0") == 0
    for name, minimum, text, message in [
        ("--steps", 1, "x", "--steps must be a positive integer, got 'x'"),
        ("--steps", 1, "0", "--steps must be a positive integer, got 0"),
        ("--threads", 0, "1.5", "--threads must be a whole number >= 0, got '1.5'"),
        ("--threads", 0, "-1", "--threads must be >= 0, got -1"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as e:
            int_at_least(name, minimum)(text)
        assert str(e.value) == message


def test_output_folder_and_usage_error(capsys):
    p = argparse.ArgumentParser()
    add_output_folder(p, "where", "replace")
    assert vars(p.parse_args(["--out", "d"])) == {"out": "d", "overwrite": False}
    assert p.parse_args(["--out", "d", "--overwrite"]).overwrite is True
    assert usage_error("bad value") == 2
    assert capsys.readouterr().err == "error: bad value\n"
