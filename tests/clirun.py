"""Run ``diffattn ...`` the two ways the tests need: :func:`run_main` in this process through ``main(argv)`` (the
default: no interpreter start, no second import of torch), and :func:`run_diffattn` as ``python -m diffattn``
in a real subprocess on this checkout's sources (not an installed copy), for the tests where a real process is
the point: signals, kill -9, exit status, start-up, the installed entry point."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def run_diffattn(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 120,
                 module: str = "diffattn") -> subprocess.CompletedProcess:
    """``python -m <module> *args`` with PYTHONPATH on src/ and one OpenMP thread; returns the finished
    process (stdout and stderr as text)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@dataclass
class Ran:
    """What :func:`run_main` returns: the fields of a finished ``subprocess.CompletedProcess`` the tests read."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _in_folder_captured(cwd: str | os.PathLike | None) -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """Run the body in folder ``cwd`` with stdout and stderr captured; the working folder is put back."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        os.chdir(here)


def run_main(*args: object, cwd: str | os.PathLike | None = None) -> Ran:
    """``diffattn *args`` in this process, in folder ``cwd``: the exit code and what it printed. What a command
    may change for the whole process (the working folder, torch's thread count and determinism) is put back."""
    import torch

    from diffattn.cli.main import main

    threads, determinism = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with _in_folder_captured(cwd) as (out, err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, a usage error
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(determinism)
    return Ran(code, out.getvalue(), err.getvalue())


def run_script(source: str, cwd: str | os.PathLike | None = None) -> Ran:
    """Python ``source`` run as a script (``__name__ == "__main__"``) in this process, in folder ``cwd``: exit 0,
    or 1 with its traceback as stderr."""
    with _in_folder_captured(cwd) as (out, err):
        try:
            exec(compile(source, "<script>", "exec"), {"__name__": "__main__"})
        except Exception:
            return Ran(1, out.getvalue(), traceback.format_exc())
    return Ran(0, out.getvalue(), err.getvalue())
