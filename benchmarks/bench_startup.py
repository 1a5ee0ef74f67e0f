"""Start-up time: `import diffattn`, `from diffattn import TransformerLM`, `diffattn --help` and
`diffattn COMMAND --help` of every command against `import torch`, as whole processes, median of N runs each,
interleaved in one run (issue 21 item 6, issue 25 item 3, issue 34 item 4).

Targets: `import diffattn` at most 0.4 s more than `import torch`, `diffattn --help` at most 0.6 s more (issue
21); `diffattn COMMAND --help` of every command under 0.3× an `import torch` (issue 34: the help imports no
torch); and so is a refusal of a folder that holds no model, or of a --resume of a run that does not exist (issue
51 item 4: each took 50-76 s on a busy machine, torch imported first): `diffattn info EMPTY`, `convert`,
`generate`, `eval`, `export`, `heads`, `serve` of an empty folder, `train --resume --out MISSING` (exit 2, run in
a temporary folder). The `× torch` column is each median over `import torch`'s median of the same tree.

    python benchmarks/bench_startup.py                        # this checkout's src/
    python benchmarks/bench_startup.py --before /tmp/old/src  # and another tree (e.g. `git archive main src`), same run

Each command is a fresh interpreter with PYTHONPATH on the tree's src/ and one OpenMP thread; the commands run
round-robin, so a slow moment on a shared machine touches every command alike. `diffattn --help` is run the way
the console script runs it (`from diffattn.cli.main import main; sys.exit(main())`), without a shell wrapper.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
SCRIPT = "import sys; from diffattn.cli.main import main; sys.argv[0] = 'diffattn'; sys.exit(main())"
COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import diffattn": ["-c", "import diffattn"],
    "from diffattn import TransformerLM": ["-c", "from diffattn import TransformerLM"],
    "diffattn --help": ["-c", SCRIPT, "--help"],
}
# every command's --help (the list the CLI itself has; cli/main.py imports nothing heavy)
sys.path.insert(0, str(SRC))
from diffattn.cli.main import COMMANDS as _CLI  # noqa: E402

COMMANDS.update({f"diffattn {c} --help": ["-c", SCRIPT, c, "--help"] for c in _CLI})
# refusals (exit 2), run in a temporary folder holding the empty folder EMPTY
REFUSALS = {
    "diffattn info EMPTY": ["info", "EMPTY"],
    "diffattn convert EMPTY": ["convert", "EMPTY", "--to", "diff", "--out", "o"],
    "diffattn generate EMPTY": ["generate", "EMPTY", "--prompt", "hi"],
    "diffattn eval EMPTY": ["eval", "EMPTY"],
    "diffattn export EMPTY": ["export", "EMPTY", "--to", "hf", "--out", "o"],
    "diffattn heads EMPTY": ["heads", "EMPTY"],
    "diffattn serve EMPTY": ["serve", "EMPTY"],
    "diffattn train --resume MISSING": ["train", "--resume", "--out", "MISSING"],
}
COMMANDS.update({name: ["-c", SCRIPT, *argv] for name, argv in REFUSALS.items()})
TARGETS = {"import diffattn": 0.4, "diffattn --help": 0.6}  # seconds over `import torch`
RATIO_TARGET = 0.3  # a command's --help: at most this times `import torch`


def wall(args: list[str], src: Path, cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       cwd=cwd)
    dt = time.perf_counter() - t0
    expected = 2 if "EMPTY" in args or "MISSING" in args else 0  # a refusal is exit 2
    if r.returncode != expected:
        raise SystemExit(f"{args} exited {r.returncode}, not {expected}: {r.stderr[-500:]}")
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each command (the median is reported)")
    p.add_argument("--before", type=Path, default=None, help="another src/ tree to time in the same run")
    p.add_argument("--only", default=None, help="time only the commands whose name contains this (and torch)")
    args = p.parse_args()
    if args.only:
        for name in [n for n in COMMANDS if args.only not in n and n != "import torch"]:
            del COMMANDS[name]
    trees = {"after": SRC} if args.before is None else {"before": args.before.resolve(), "after": SRC}
    jobs = [(tree, name) for tree in trees for name in COMMANDS]
    times: dict[tuple[str, str], list[float]] = {j: [] for j in jobs}
    with tempfile.TemporaryDirectory() as cwd:
        (Path(cwd) / "EMPTY").mkdir()
        for tree in trees.values():  # warm the page cache and the .pyc files
            for a in COMMANDS.values():
                wall(a, tree, Path(cwd))
        for r in range(args.repeats):
            order = jobs[r % len(jobs):] + jobs[:r % len(jobs)]
            for tree, name in order:
                times[(tree, name)].append(wall(COMMANDS[name], trees[tree], Path(cwd)))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; median of {args.repeats} whole-process runs, "
          "seconds; Δ = minus `import torch` of the same tree, × = over `import torch`")
    print(f"| command | {' | '.join(f'{t} (s) | {t} Δ | {t} ×' for t in trees)} | target |")
    print("|---|" + "---|---|---|" * len(trees) + "---|")
    for name in COMMANDS:
        cells = []
        for tree in trees:
            med = statistics.median(times[(tree, name)])
            torch_med = statistics.median(times[(tree, "import torch")])
            cells += [f"{med:.2f}", f"{med - torch_med:+.2f}", f"{med / torch_med:.2f}"]
        target = (f"Δ ≤ +{TARGETS[name]:.1f}" if name in TARGETS
                  else f"× < {RATIO_TARGET}" if (name.endswith(" --help") and name != "diffattn --help")
                  or name in REFUSALS else "")
        print(f"| {name} | {' | '.join(cells)} | {target} |")


if __name__ == "__main__":
    main()
