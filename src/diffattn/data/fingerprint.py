"""The data a run was fed: its files' sizes and sha256 (:func:`data_fingerprint`, recorded in the run config), and
what changed since (:func:`data_changes`), so a resumed run or an evaluation can say that its data moved."""

from __future__ import annotations

from pathlib import Path

from diffattn.system.atomic_files import file_sha256
from diffattn.system.untrusted import utf8_name


def _files(p: Path) -> dict[str, Path]:
    """{name as recorded: path} of the data's files; a name that is not UTF-8 is refused (it is recorded in UTF-8
    files: the run config, resolved.toml)."""
    if p.is_file():
        return {utf8_name(p.name, "the data file"): p}
    if p.is_dir():
        return {utf8_name(f.relative_to(p).as_posix(), "the data file"): f for f in sorted(p.rglob("*"))
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)}
    raise FileNotFoundError(f"{p}: no such file or folder")


def data_fingerprint(path: str | Path) -> dict:
    """Absolute path, and size + sha256 of every file under it (a file, or a folder's non-hidden files), so a
    resumed run can tell whether its data changed. ``{"path", "files": {name: {"bytes", "sha256"}}}``."""
    p = Path(path).expanduser().resolve()
    return {"path": utf8_name(p, "the data path"), "files": {name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
                                      for name, f in _files(p).items()}}


def _sizes_then_hashes(root: Path, old: dict) -> dict:
    """The files under ``root`` now, as :func:`data_fingerprint` gives them, hashing only those whose size is
    the one recorded in ``old`` (a file of another size changed: no need to read it, which for a large one takes
    minutes)."""
    out = {}
    for name, f in _files(root).items():
        size = f.stat().st_size
        same = isinstance(old.get(name), dict) and old[name].get("bytes") == size
        out[name] = {"bytes": size, "sha256": file_sha256(f) if same else None}
    return out


def data_changes(recorded: dict) -> list[str]:
    """What differs between the data recorded in ``recorded`` (a :func:`data_fingerprint`) and the files on
    disk now, one phrase each, naming the file; empty if nothing changed."""
    root = Path(recorded["path"])
    if not root.exists():
        return [f"{root} no longer exists"]
    old = recorded.get("files", {})
    changes = []
    try:
        now = _sizes_then_hashes(root, old)
    except OSError as e:
        return [f"{root} cannot be read ({e})"]
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
