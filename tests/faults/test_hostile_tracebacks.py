"""Crafted files and names that ended in a traceback (issue 39): each is one line, exit 2, and changes nothing (a
refused resume leaves resolved.toml as it was: the run records its config only once it has started). Deep
nesting, crafted resume state, train-state fields of the wrong type, a RoPE theta of NaN, names that are not
UTF-8, a tokenizer larger than its model's vocabulary, a missing extra."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
from clirun import run_main
from faultinject import tiny_run
from hostile import (
    ENTRY_POINTS,
    copy_run,
    edit_json,
    one_line_refusal,
    resign,
    run_entry,
    set_config,
    train_tiny,
    tree,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = 100_000  # deeper than Python's recursion limit: main raised RecursionError


def _deep() -> list:
    return json.loads("[" * 200 + "]" * 200)  # a document within the limit, nested past MAX_DEPTH


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("tracebacks"))


def _crafted(run: Path, tmp: Path) -> Path:
    """A copy of the run with its older checkpoints gone (the crafted ckpt/ cannot be passed over for one)."""
    folder = copy_run(run, tmp / "r")
    for p in folder.glob("ckpt-step-*"):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    return folder


# ------------------------------------------------------------------------------------------------ nesting


@pytest.mark.parametrize("point", ["info", "generate", "eval", "resume"])
@pytest.mark.parametrize("where", ["config", "manifest"])
def test_a_json_nested_too_deeply_is_one_line(run, tmp_path, point, where):
    folder = _crafted(run, tmp_path)
    ck = folder / "ckpt"
    if where == "manifest":
        (ck / "manifest.json").write_text("[" * DEEP + "]" * DEEP)
    else:
        text = (ck / "config.json").read_text()
        (ck / "config.json").write_text(text.replace('"train_state": {', f'"x": {"[" * DEEP + "]" * DEEP}, '
                                                     '"train_state": {', 1))
        resign(ck, "config.json")
    before = tree(folder)
    one_line_refusal(run_entry(point, folder, tmp_path), "nests more than 64 levels deep")
    assert tree(folder) == before


def test_a_toml_nested_too_deeply_is_one_line(tmp_path):
    cfg, corpus = tiny_run(tmp_path)
    cfg.write_text(cfg.read_text() + f"\n[deep]\nx = {'[' * DEEP}{']' * DEEP}\n")
    one_line_refusal(run_main("train", "--config", cfg, "--data.path", corpus, "--out", tmp_path / "o"),
                     "the TOML nests more than 64 levels deep")
    assert not (tmp_path / "o").exists()


def test_a_vllm_folder_config_nested_too_deeply_is_one_problem(tmp_path):
    from diffattn.interop.vllm.served import folder_problems

    f = tmp_path / "config.json"
    f.write_text("[" * DEEP + "]" * DEEP)  # main: RecursionError from serve
    assert folder_problems(tmp_path) == [f"{f} cannot be read as JSON ({f}: the JSON nests more than 64 levels deep; "
                                         "no file diffattn reads does: it is refused)"]


# ------------------------------------------------------------------------------------------------ resume


def _header(path: Path, header: object) -> None:
    """Replace a safetensors file's header, keeping its data."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


CRAFTED_RESUME = {
    "optimizer lr text": ("optimizer.json", lambda o: o["param_groups"][0].update(lr="fast"), "param_groups[0].lr"),
    "optimizer groups object": ("optimizer.json", lambda o: o.update(param_groups={"a": 1}), "optimizer.json"),
    "optimizer state entry": ("optimizer.json", lambda o: o["state"][0].update(key_type="int", key="x"),
                              "optimizer"),
    "optimizer value text": ("optimizer.json", lambda o: (o["state"][0]["tensors"].remove("exp_avg_sq"),
                                                          o["state"][0]["values"].update(exp_avg_sq="x")),
                             "not a floating-point tensor"),
    "rng_meta": ("config.json", lambda c: c["train_state"]["rng_meta"].update(python=["x", None]),
                 "train_state.rng_meta"),
    "step 1e30": ("config.json", lambda c: c["train_state"].update(step=10**30), "train_state.step"),
    "list header": ("model.safetensors", [1, 2, 3], "not a valid safetensors file"),
    "nested header": ("model.safetensors", _deep(), "not a valid safetensors file"),
    "optimizer list header": ("optimizer.safetensors", [1], "not a valid safetensors file"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED_RESUME))
def test_a_crafted_checkpoint_is_refused_on_resume_and_changes_nothing(run, tmp_path, case):
    """main: IndexError, ValueError, TypeError, RecursionError; and each crash rewrote resolved.toml."""
    name, change, needle = CRAFTED_RESUME[case]
    folder = _crafted(run, tmp_path)
    ck = folder / "ckpt"
    if name.endswith(".safetensors"):
        _header(ck / name, change)
        resign(ck, name)
    else:
        edit_json(ck, name, change)
    before = tree(folder)
    r = run_main("train", "--out", folder, "--resume", "--train.steps", "6", "--no-progress")
    one_line_refusal(r, needle)
    assert tree(folder) == before  # resolved.toml, metrics.csv: as they were


def test_a_crafted_rng_state_is_refused_on_resume(run, tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = _crafted(run, tmp_path)
    save_file({"data": torch.zeros(3, dtype=torch.uint8)}, str(folder / "ckpt" / "rng.safetensors"))
    resign(folder / "ckpt", "rng.safetensors")
    before = tree(folder)
    r = run_main("train", "--out", folder, "--resume", "--no-progress")
    one_line_refusal(r, "the RNG state cannot be restored")
    assert tree(folder) == before


# ------------------------------------------------------------------------------------------------ fields


@pytest.mark.parametrize("point", ["info", "eval", "export"])
@pytest.mark.parametrize("field,value", [("best", "x"), ("history", 5), ("step", "3"), ("tokens_seen", [])])
def test_a_train_state_field_of_the_wrong_type_is_one_line(run, tmp_path, point, field, value):
    """main: AttributeError from eval and export."""
    folder = _crafted(run, tmp_path)
    for ck in (folder / "ckpt", folder / "best"):
        edit_json(ck, "config.json", lambda c: c["train_state"].update({field: value}))
    one_line_refusal(run_entry(point, folder, tmp_path), f"train_state.{field} must be")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("point", ["eval", "export"])
@pytest.mark.parametrize("best", [{"metric": 5, "value": "x", "step": [1]}, {"metric": "val_loss", "value": 1.0,
                                                                             "step": "3"}])
def test_a_best_checkpoint_of_the_wrong_type_is_one_line_in_the_note(run, tmp_path, point, best):
    """Only best/ crafted: the last checkpoint reads, the note about the best one read best/ (issue 52: export
    ended in a traceback, exit 1, as best/ raised a CheckpointError no command caught)."""
    folder = _crafted(run, tmp_path)
    edit_json(folder / "best", "config.json", lambda c: c["train_state"].update(best=best))
    before = tree(folder)
    one_line_refusal(run_entry(point, folder, tmp_path), "best: config.json is invalid: train_state.best must be")
    assert tree(folder) == before and not (tmp_path / "exported").exists()


@pytest.mark.parametrize("theta", [float("nan"), -1.0])
@pytest.mark.parametrize("point", ["generate", "eval", "resume"])
def test_a_rope_theta_that_is_no_frequency_is_refused(run, tmp_path, point, theta):
    """main: generate raised a traceback, eval printed nan, train accepted it."""
    folder = _crafted(run, tmp_path)
    set_config(folder / "ckpt", rope_theta=theta)
    before = tree(folder)
    one_line_refusal(run_entry(point, folder, tmp_path), "rope_theta must be")
    assert tree(folder) == before


@pytest.mark.parametrize("field", ["init_std", "rope_theta", "lambda_std", "norm_eps"])
def test_a_model_number_that_is_nan_is_refused_before_training(tmp_path, field):
    cfg, corpus = tiny_run(tmp_path)
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", tmp_path / "o", f"--model.{field}", "nan")
    one_line_refusal(r, f"{field} must be a finite number")
    assert not (tmp_path / "o").exists()


def test_a_char_tokenizer_larger_than_the_vocabulary_is_refused(run, tmp_path):
    """main: eval ended in an IndexError from the embedding."""
    folder = _crafted(run, tmp_path)
    extra = "".join(chr(0x4E00 + i) for i in range(40))
    edit_json(folder / "ckpt", "config.json", lambda c: c["tokenizer"].update(chars=c["tokenizer"]["chars"] + extra))
    for point in ("eval", "generate", "info"):
        one_line_refusal(run_entry(point, folder, tmp_path), "tokens but the model's vocabulary only")


# ------------------------------------------------------------------------------------------------ names


def test_names_that_are_not_utf8_are_refused_before_anything_is_written(run, tmp_path):
    """main: UnicodeEncodeError for the data, --out and export's --out; a run under such a path could not be read."""
    cfg, corpus = tiny_run(tmp_path)
    latin1 = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"caf\xe9")))
    data = latin1.with_suffix(".txt")
    data.write_text(corpus.read_text())
    cases = [["train", "--config", cfg, "--data.path", data, "--out", tmp_path / "o"],
             ["train", "--config", cfg, "--data.path", corpus, "--out", latin1],
             ["export", run, "--to", "hf", "--out", latin1]]
    for args in cases:
        one_line_refusal(run_main(*args), "caf\\xe9", "is not valid UTF-8")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text(corpus.read_text())
    os.rename(data, folder / data.name)  # a name inside a data folder: recorded in the run too
    one_line_refusal(run_main("train", "--config", cfg, "--data.path", folder, "--out", tmp_path / "o"),
                     "the data file caf\\xe9.txt is not valid UTF-8")
    assert not (tmp_path / "o").exists() and not latin1.exists()


# ------------------------------------------------------------------------------------------------ extras


@pytest.mark.parametrize("to", ["hf", "vllm"])
def test_a_missing_hf_extra_is_one_line_and_writes_nothing(run, tmp_path, monkeypatch, to):
    """main: a traceback ending in the right message, exit 1."""
    for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    r = run_main("export", run, "--to", to, "--out", tmp_path / "exported")
    one_line_refusal(r, "needs the `transformers` package", '.[hf]')
    assert not (tmp_path / "exported").exists()


def test_every_entry_point_still_reads_the_run(run, tmp_path):
    """The control: the untouched run passes every reader the cases above refuse."""
    for point in ENTRY_POINTS:
        if point != "convert":  # convert takes a standard-attention source
            (tmp_path / point).mkdir()
            r = run_entry(point, copy_run(run, tmp_path / point / "r"), tmp_path / point)
            assert r.returncode == 0, (point, r.stderr)
