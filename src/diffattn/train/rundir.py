"""Run folders: refuse to write a new run over an old one unless asked, and clear an old one when asked.

Every command that writes a run folder (``diffattn train``, the classifier, ``diffattn compare``) calls
:func:`claim_run_dir` first, so re-running a command into a folder that already holds results never silently
destroys them. Only the files a run writes are removed by ``--overwrite``; anything else in the folder stays.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from diffattn.train.checkpoint import file_sha256

# What a training run leaves in its folder (train.py, classify.py, the diagnostics file, TensorBoard).
TRAIN_OUTPUTS = ("ckpt", "ckpt-step-*", "metrics.csv", "metrics.jsonl", "diagnostics.csv", "resolved.toml", "tb")
# What the synthetic `diffattn compare` writes (its --data experiment resumes in place instead).
COMPARE_OUTPUTS = ("report.md", "report.html", "summary.md", "results.json", "config.json", "command.txt", "*.png",
                   "runs")


class RunDirError(ValueError):
    """The output folder already holds a run and neither resuming nor overwriting was asked for."""


def run_outputs(out: Path, patterns: Iterable[str] = TRAIN_OUTPUTS) -> list[Path]:
    """The entries of ``out`` that a previous run wrote (matched by ``patterns``), sorted."""
    if not out.is_dir():
        return []
    found = {p for pat in patterns for p in out.glob(pat)}
    return sorted(found)


def claim_run_dir(out: Path, *, overwrite: bool, what: str = "train", resumable: bool = True,
                  patterns: Iterable[str] = TRAIN_OUTPUTS) -> list[Path]:
    """Make ``out`` ready for a new run. If it holds a previous run: with ``overwrite`` remove that run's
    outputs (and return them), else raise :class:`RunDirError` naming ``--resume`` (if ``resumable``) and
    ``--overwrite``."""
    old = run_outputs(out, patterns)
    if not old:
        return []
    if not overwrite:
        names = ", ".join(p.name for p in old[:4]) + (", ..." if len(old) > 4 else "")
        resume = f"To continue it: diffattn {what} --out {out} --resume. " if resumable else ""
        raise RunDirError(
            f"{out} already holds a run ({names}); nothing was changed. {resume}To replace it: add --overwrite."
        )
    for p in old:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return old


# ----------------------------------------------------------------------------------- the data a run was fed


def data_fingerprint(path: str | Path) -> dict:
    """Absolute path, and size + sha256 of every file under it (a file, or a folder's non-hidden files), so a
    resumed run can tell whether its data changed. ``{"path", "files": {name: {"bytes", "sha256"}}}``."""
    p = Path(path).expanduser().resolve()
    if p.is_file():
        files = {p.name: p}
    elif p.is_dir():
        files = {f.relative_to(p).as_posix(): f for f in sorted(p.rglob("*"))
                 if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)}
    else:
        raise FileNotFoundError(f"{p}: no such file or folder")
    return {"path": str(p), "files": {name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
                                      for name, f in files.items()}}


def data_changes(recorded: dict) -> list[str]:
    """What differs between the data recorded in ``recorded`` (a :func:`data_fingerprint`) and the files on
    disk now, one phrase each, naming the file; empty if nothing changed."""
    root = Path(recorded["path"])
    if not root.exists():
        return [f"{root} no longer exists"]
    try:
        now = data_fingerprint(root)["files"]
    except OSError as e:
        return [f"{root} cannot be read ({e})"]
    old = recorded.get("files", {})
    changes = []
    for name, meta in old.items():
        f = root / name if root.is_dir() else root
        if name not in now:
            changes.append(f"{f} is missing")
        elif now[name]["bytes"] != meta["bytes"]:
            changes.append(f"{f} changed size ({meta['bytes']:,} -> {now[name]['bytes']:,} bytes)")
        elif now[name]["sha256"] != meta["sha256"]:
            changes.append(f"{f} changed content (sha256 differs)")
    changes += [f"{root / name} is new" for name in now if name not in old]
    return changes
