"""A folder from elsewhere never makes a command read or write outside it (issue 32): a symbolic link planted as
the run folder's lock or one of its files, manifest entries and transformers index entries that lead out of
their folder, and links in a model folder (only the Hugging Face cache layout may point out, into its blobs/).
Every case is refused in one line, exit 2, before anything is opened, hashed or changed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from clirun import run_main
from hostile import (
    ENTRY_POINTS,
    as_hub_cache,
    copy_run,
    edit_manifest,
    llama_folder,
    one_line_refusal,
    run_entry,
    sha256,
    train_tiny,
    tree,
)

import diffattn
import diffattn.checkpoint.verify as verify
from diffattn.checkpoint.model_folders import load_pretrained
from diffattn.system.atomic_files import Refused, UnsafePath, confined, open_nofollow
from diffattn.system.run_lock import LOCK_NAME
from diffattn.train.diagnostics import DiagnosticsLog
from diffattn.train.runlog import append_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("hostile"))


@pytest.fixture
def outside(tmp_path) -> Path:
    f = tmp_path / "outside" / "secret.txt"
    f.parent.mkdir()
    f.write_text("SECRET\n")
    return f


# ------------------------------------------------------------------------------------------------ writes


@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
@pytest.mark.parametrize("command", ["resume", "train", "study", "compare"])
def test_a_symlinked_lock_is_refused_and_nothing_is_written_through_it(run, tmp_path, outside, command, dangling):
    target = outside.parent / "nothing-here" if dangling else outside
    folder = copy_run(run, tmp_path / "r") if command in ("resume", "train") else tmp_path / "r"
    folder.mkdir(exist_ok=True)
    os.symlink(target, folder / LOCK_NAME)
    before = tree(folder)
    args = {"resume": ["train", "--out", folder, "--resume", "--no-progress"],
            "train": ["train", "--config", "tiny", "--data.path", outside, "--out", folder, "--overwrite"],
            "study": ["study", outside, "--out", folder, "--quick"],
            "compare": ["compare", "--out", folder, "--quick"]}[command]
    r = run_main(*args)
    one_line_refusal(r, str(folder / LOCK_NAME), "symbolic link")
    assert outside.read_text() == "SECRET\n" and not (outside.parent / "nothing-here").exists()
    assert tree(folder) == before


@pytest.mark.parametrize("name", ["metrics.csv", "diagnostics.csv", "resolved.toml"])
def test_a_symlinked_run_file_is_refused_before_the_resume_changes_anything(run, tmp_path, outside, name):
    folder = copy_run(run, tmp_path / "r")
    (folder / name).unlink()
    os.symlink(outside, folder / name)
    before = tree(folder)
    r = run_main("train", "--out", folder, "--resume", "--train.steps", "6", "--no-progress")
    one_line_refusal(r, str(folder / name), "symbolic link")
    assert outside.read_text() == "SECRET\n" and tree(folder) == before


def test_appends_and_read_then_rewrite_never_go_through_a_link(tmp_path, outside):
    """The writers themselves refuse a link (a race past the folder check would meet this)."""
    for name in ("metrics.csv", "diagnostics.csv", "events.log"):
        os.symlink(outside, tmp_path / name)
    with pytest.raises(UnsafePath, match="metrics.csv is a symbolic link"):
        append_metrics(tmp_path / "metrics.csv", {"step": 1})
    with pytest.raises(UnsafePath, match="diagnostics.csv is a symbolic link"):
        DiagnosticsLog(tmp_path / "diagnostics.csv", start_step=3)  # its first line would be copied in
    with pytest.raises(UnsafePath, match="events.log is a symbolic link"):
        open_nofollow(tmp_path / "events.log", "a")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UnsafePath, match="not a regular file"):
        open_nofollow(tmp_path / "fifo", "a")  # would block forever waiting for a reader
    assert outside.read_text() == "SECRET\n"
    with open_nofollow(tmp_path / "plain.csv", "a") as f:  # a plain file is written as before
        f.write("x\n")
    assert (tmp_path / "plain.csv").read_text() == "x\n"


def test_the_study_database_is_never_written_through_a_link(tmp_path, outside):
    from diffattn.experiments.study.optuna_log import open_storage

    for name in ("optuna.db", "optuna.db-wal"):  # SQLite writes both in place
        os.symlink(outside, tmp_path / name)
        with pytest.raises(UnsafePath, match=f"{name} is a symbolic link"):
            open_storage(tmp_path, None)
        os.unlink(tmp_path / name)
    assert outside.read_text() == "SECRET\n"


@pytest.mark.parametrize("dangling", [False, True], ids=["link", "dangling-link"])
def test_a_study_cell_whose_lock_is_a_link_fails_instead_of_waiting(tmp_path, outside, dangling):
    """A planted link as a cell's lock file was taken for "another worker holds this cell" (CellInUse), and the
    worker waited for it forever; it is now refused (the cell fails in one line, the others run) and never
    followed."""
    from types import SimpleNamespace

    from diffattn.checkpoint.output_guard import OutputInUse
    from diffattn.experiments.experiment_folder import cell_name
    from diffattn.experiments.study.cell import run_cell

    folder = tmp_path / "cells" / cell_name("diff", 0.003, 0)
    folder.mkdir(parents=True)
    os.symlink(tmp_path / "nowhere" if dangling else outside, folder / LOCK_NAME)
    spec, arm = SimpleNamespace(model=SimpleNamespace(d_model=16)), SimpleNamespace(name="diff")
    with pytest.raises(Refused, match="symbolic link") as refused:
        run_cell(tmp_path, spec, arm, 0.003, 0, source=None, tokenizer=None)
    assert not isinstance(refused.value, OutputInUse)  # what a worker waits on
    assert outside.read_text() == "SECRET\n" and not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------------------------------------------ reads

@pytest.mark.parametrize("point", ENTRY_POINTS)
def test_a_manifest_entry_out_of_the_folder_is_refused_before_anything_is_hashed(run, tmp_path, outside,
                                                                                  monkeypatch, point):
    """main's behaviour: the entry ../../outside/secret.txt, with the secret's true sha256, was opened, hashed
    and accepted (exit 0): a crafted checkpoint learnt whether a file exists and what it holds."""
    folder = copy_run(run, tmp_path / "r")
    entry = os.path.relpath(outside, folder / "ckpt")
    edit_manifest(folder / "ckpt", lambda f: f.update({entry: {"sha256": sha256(outside), "bytes": 7}}))
    hashed: list[str] = []
    real = verify.file_sha256
    monkeypatch.setattr(verify, "file_sha256", lambda p: hashed.append(str(p)) or real(p))
    before = tree(folder)
    r = run_entry(point, folder, tmp_path)
    one_line_refusal(r, repr(entry), "not a plain file name")
    assert hashed == [] and tree(folder) == before
    assert not (tmp_path / "exported").exists() and not (tmp_path / "converted").exists()


@pytest.mark.parametrize("entry", ["/etc/hostname", "sub/model.safetensors", "..", "a\\b"])
def test_every_manifest_entry_is_a_plain_name_in_the_folder(run, tmp_path, entry):
    folder = copy_run(run, tmp_path / "r")
    edit_manifest(folder / "ckpt", lambda f: f.update({entry: {"sha256": "0" * 64, "bytes": 1}}))
    one_line_refusal(run_main("info", folder), "not a plain file name")


def _latest_only(folder: Path) -> Path:
    """The run without its older checkpoints: a damaged ckpt/ is then an error, not a fallback with a warning."""
    for p in folder.glob("ckpt-step-*"):
        shutil.rmtree(p)
    return folder


def test_a_manifest_entry_with_control_characters_is_named_escaped(run, tmp_path):
    folder = copy_run(run, tmp_path / "r")
    entry = "\x1b[2J\x1b[31mALL GOOD\x07"
    edit_manifest(folder / "ckpt", lambda f: f.update({entry: {"sha256": "0" * 64, "bytes": 1}}))
    r = run_main("info", folder)  # the warning of the fallback to ckpt-step-2 names it escaped
    assert r.returncode == 0 and "file \\x1b[2J\\x1b[31mALL GOOD\\x07 is missing" in r.stderr
    assert "\x1b" not in r.stderr + r.stdout
    err = one_line_refusal(run_main("info", _latest_only(folder)))
    assert "\\x1b[2J\\x1b[31mALL GOOD\\x07" in err  # main printed the raw sequence: the screen was cleared


@pytest.mark.parametrize("meta", ["yes", None, 3, {"sha256": 5, "bytes": 1}, {"sha256": "ab"}],
                         ids=["str", "null", "int", "sha-not-str", "no-bytes"])
def test_a_manifest_entry_that_is_not_an_object_is_one_line(run, tmp_path, meta):
    folder = _latest_only(copy_run(run, tmp_path / "r"))
    edit_manifest(folder / "ckpt", lambda f: f.update({"config.json": meta}))
    one_line_refusal(run_main("info", folder), "'config.json' is not an object")  # main: AttributeError


@pytest.mark.parametrize("point", ["info", "generate", "resume", "load_pretrained"])
def test_a_symlinked_model_file_out_of_the_folder_is_refused(run, tmp_path, point):
    folder = copy_run(run, tmp_path / "r")
    elsewhere = tmp_path / "elsewhere.safetensors"
    (folder / "ckpt" / "model.safetensors").rename(elsewhere)
    os.symlink(elsewhere, folder / "ckpt" / "model.safetensors")  # main loaded it (exit 0)
    one_line_refusal(run_entry(point, folder, tmp_path), "model.safetensors is a symbolic link out of its folder")


def test_a_symlinked_ckpt_folder_out_of_the_run_is_refused(run, tmp_path):
    folder = copy_run(run, tmp_path / "r")
    (folder / "ckpt").rename(tmp_path / "elsewhere")
    for p in folder.glob("ckpt-step-*"):
        p.rename(tmp_path / p.name)
    os.symlink(tmp_path / "elsewhere", folder / "ckpt")
    one_line_refusal(run_main("info", folder), "ckpt is a symbolic link out of its folder")


def test_a_link_inside_the_folder_is_read(run, tmp_path):
    folder = copy_run(run, tmp_path / "r")
    ck = folder / "ckpt"
    (ck / "model.safetensors").rename(ck / "weights.bin")
    os.symlink("weights.bin", ck / "model.safetensors")
    assert run_main("info", folder).returncode == 0


# ------------------------------------------------------------------------------------- transformers folders


def test_an_index_entry_out_of_the_folder_is_refused(tmp_path):
    src = llama_folder(tmp_path / "llama")
    (src / "model.safetensors").rename(tmp_path / "w.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../w.safetensors"}}))
    r = run_main("convert", src, "--to", "diff", "--out", tmp_path / "out")  # main: loaded it, exit 0
    one_line_refusal(r, "weight file '../w.safetensors' is not a plain file name")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": []}, [], {"weight_map": {"a": 3}}],
                         ids=["no-weight_map", "list-map", "not-an-object", "entry-not-a-name"])
def test_an_index_without_a_weight_map_is_one_line(tmp_path, index):
    src = llama_folder(tmp_path / "llama")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_refusal(run_main("convert", src, "--to", "diff", "--out", tmp_path / "out"), "model.safetensors.index")


def test_an_empty_model_file_is_one_line(tmp_path):
    src = llama_folder(tmp_path / "llama")
    (src / "model.safetensors").write_bytes(b"")  # main: SafetensorError traceback
    one_line_refusal(run_main("convert", src, "--to", "diff", "--out", tmp_path / "out"),
                     "not a readable safetensors file")
    pre = tmp_path / "pre"
    diffattn.TransformerLM(diffattn.ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=1)).save_pretrained(pre)
    (pre / "model.safetensors").write_bytes(b"")
    one_line_refusal(run_main("info", pre), "model.safetensors cannot be loaded")


def test_a_model_file_linked_out_of_a_transformers_folder_is_refused(tmp_path):
    src = llama_folder(tmp_path / "llama")
    (src / "model.safetensors").rename(tmp_path / "w.safetensors")
    os.symlink(tmp_path / "w.safetensors", src / "model.safetensors")
    one_line_refusal(run_main("convert", src, "--to", "diff", "--out", tmp_path / "out"),
                     "model.safetensors is a symbolic link out of its folder")


def test_the_hugging_face_cache_layout_keeps_loading(run, tmp_path):
    """snapshots/<rev>/<file> -> ../../blobs/<sha256>: a transformers folder converts, a save_pretrained folder
    and a diffattn checkpoint (one level deeper) load, exactly as their plain copies."""
    cache = tmp_path / "hub"
    snap = as_hub_cache(llama_folder(tmp_path / "llama"), cache)
    assert all(p.is_symlink() for p in snap.iterdir())
    assert run_main("convert", snap, "--to", "diff", "--out", tmp_path / "conv").returncode == 0

    plain = tmp_path / "pre"
    model = load_pretrained(run)
    model.save_pretrained(plain)
    snap2 = as_hub_cache(plain, tmp_path / "hub2")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(load_pretrained(snap2)(ids), model(ids))

    snap3 = as_hub_cache(run / "ckpt", tmp_path / "hub3", subdir="ckpt")
    assert torch.equal(load_pretrained(snap3)(ids), model(ids))
    assert run_main("info", snap3).returncode == 0


def test_a_cache_link_that_leaves_the_repo_is_refused(tmp_path):
    snap = as_hub_cache(llama_folder(tmp_path / "llama"), tmp_path / "hub")
    (snap / "model.safetensors").unlink()
    os.symlink(tmp_path / "llama" / "model.safetensors", snap / "model.safetensors")  # not into its blobs/
    one_line_refusal(run_main("convert", snap, "--to", "diff", "--out", tmp_path / "out"),
                     "symbolic link out of its folder")


def test_confined_names(tmp_path):
    (tmp_path / "f").write_text("x")
    os.symlink("f", tmp_path / "inside")
    os.symlink("/etc/hostname", tmp_path / "out")
    assert confined(tmp_path, "f") == tmp_path / "f" and confined(tmp_path, "inside") == tmp_path / "inside"
    assert confined(tmp_path, "absent") == tmp_path / "absent"  # a missing file is the reader's to report
    for bad in ("../f", "/etc/hostname", "a/b", "a\\b", ".", "..", "", 3, None, "a\0b"):
        with pytest.raises(UnsafePath, match="not a plain file name"):
            confined(tmp_path, bad)
    with pytest.raises(UnsafePath, match="out of its folder"):
        confined(tmp_path, "out")
