"""``--threads N``: torch's intra-op threads for one command (``train``, ``eval``, ``generate``; ``compare`` has the
same option with its own default, 1). Torch's default, one thread per core, is right on an idle machine; on cores
that another process is using, threads wait on each other and a small model ran 10-40x slower than on one."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from diffattn.cli.options import int_at_least


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int_at_least("--threads", 0), default=0, metavar="N",
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
