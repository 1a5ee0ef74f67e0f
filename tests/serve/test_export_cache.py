"""The export ``diffattn serve`` keeps for a folder vLLM cannot read as it is (issue 50, item 2): reused while the
source is unchanged, a new one when it changed, published whole or not at all, never written outside the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diffattn.interop.vllm import export_cache
from diffattn.interop.vllm.export_cache import STAMP, reuse_or_export, source_fingerprint


def _checkpoint(folder: Path, weights: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": {"sha256": weights}}}))
    return folder


def _writer(calls: list[Path]):
    def write(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
    return write


def test_an_unchanged_source_is_exported_once_and_a_changed_one_again(tmp_path):
    src, root, calls = _checkpoint(tmp_path / "run", "a"), tmp_path / "cache", []
    first, reused = reuse_or_export(src, _writer(calls), root)
    assert not reused and first.is_relative_to(root) and len(calls) == 1
    assert json.loads((first / STAMP).read_text())["source"] == str(src.resolve())
    assert reuse_or_export(src, _writer(calls), root) == (first, True) and len(calls) == 1
    _checkpoint(src, "b")  # the run saved another checkpoint
    second, reused = reuse_or_export(src, _writer(calls), root)
    assert not reused and second != first and len(calls) == 2
    assert not first.exists() and sorted(p.name for p in second.parent.iterdir()) == [second.name]
    assert sorted(p.name for p in src.iterdir()) == ["manifest.json"]  # the source is only read


def test_a_failed_export_leaves_nothing_and_a_later_one_is_whole(tmp_path):
    src, root = _checkpoint(tmp_path / "run", "a"), tmp_path / "cache"

    def dies(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        reuse_or_export(src, dies, root)
    assert not [p for p in root.rglob("*") if p.is_file()]
    folder, reused = reuse_or_export(src, _writer([]), root)
    assert not reused and (folder / "config.json").is_file() and (folder / STAMP).is_file()


def test_an_export_another_serve_published_meanwhile_is_used(tmp_path, monkeypatch):
    src, root = _checkpoint(tmp_path / "run", "a"), tmp_path / "cache"
    theirs, _ = reuse_or_export(src, _writer([]), root)
    mine: list[Path] = []
    monkeypatch.setattr(export_cache, "_valid", lambda folder, *a: bool(mine))  # not there yet when we looked
    folder, reused = reuse_or_export(src, _writer(mine), root)
    assert (folder, reused) == (theirs, True) and not mine[0].exists()  # our copy went, theirs stayed


def test_a_source_whose_fingerprint_cannot_be_read_is_never_reused(tmp_path):
    src, root, calls = tmp_path / "damaged", tmp_path / "cache", []
    src.mkdir()
    os.mkfifo(src / "manifest.json")  # read as JSON it would hang: refused, not waited on
    assert source_fingerprint(src) is None
    first, _ = reuse_or_export(src, _writer(calls), root)
    second, reused = reuse_or_export(src, _writer(calls), root)
    assert not reused and second != first and len(calls) == 2 and not first.exists()
