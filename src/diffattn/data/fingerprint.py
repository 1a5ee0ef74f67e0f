"""The data a run was fed: its files' sizes and sha256 (:func:`data_fingerprint`, recorded in the run config), and
what changed since (:func:`data_changes`), so a resumed run or an evaluation can say that its data moved."""

from __future__ import annotations

from pathlib import Path

from diffattn.fileio import file_sha256


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
