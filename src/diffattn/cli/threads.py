"""``--threads N``: torch's intra-op threads for one command (``train``, ``eval``, ``generate``; ``compare`` and
``study`` have the same option with their own default, 1). Torch's default, one thread per core, is right on an
idle machine; on cores that another process is using, threads wait on each other and a small model ran 10-40x
slower than on one. More threads than the machine has CPUs is refused when the command line is read (OpenMP
would try to allocate a stack for each: 10⁹ threads asked for 216 GB), before anything is written."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from diffattn.cli.options import int_at_least


def machine_cpus() -> int:
    """The logical CPUs of this machine: the most threads any command may ask for."""
    return os.cpu_count() or 1


def threads_type() -> Callable[[str], int]:
    """The argparse ``type`` of every ``--threads``: 0 (the command's default) up to :func:`machine_cpus`."""
    return int_at_least("--threads", 0, machine_cpus(), "this machine's CPUs")


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=threads_type(), default=0, metavar="N",
                   help="torch intra-op threads (default 0: torch's default, one per core); on cores other "
                   "processes are busy on, 1 is often several times faster")


@contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run with ``n`` intra-op threads (0: leave torch's setting), then restore it (in-process callers, tests);
    yields the number in use."""
    import torch  # heavy: imported when the command runs, not for its --help

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
