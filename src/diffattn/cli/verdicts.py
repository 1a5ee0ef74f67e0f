"""``diffattn verdicts DIR [DIR ...] --against standard,diff_v2``: verdict tables over finished studies, per text and
across texts (the command line of :func:`diffattn.experiments.study.folder_results.verdict_tables`)."""

from __future__ import annotations

import argparse
import sys

from diffattn.system.atomic_files import printable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folders", nargs="+", metavar="DIR", help="finished `diffattn study` folders (one per text)")
    p.add_argument("--against", default="standard",
                   help="reference arms, comma-separated (default: standard); e.g. standard,diff_v2")
    p.add_argument("--names", default=None, help="a name per folder, comma-separated (default: the folder names)")


def run(args: argparse.Namespace) -> int:
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.experiments.study.folder_results import verdict_tables

    against = [a.strip() for a in args.against.split(",") if a.strip()]
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    try:
        print(verdict_tables(args.folders, against or ["standard"], names), end="")
    except ValueError as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    return 0
