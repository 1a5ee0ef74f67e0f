"""A folder that is not a model (issue 52): one message from every command that takes a model folder, naming what a
model folder holds; and a refusal is quick (issue 51 item 4): it comes before torch is imported. Whether torch was
imported is read from ``sys.modules`` in a fresh interpreter that runs every command in turn, not timed (the time
is benchmarks/bench_startup.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import SRC

from diffattn.checkpoint.folder_kind import (
    CHECKPOINT,
    COMPARISON,
    MODEL_FOLDER,
    PRETRAINED,
    RUN,
    TRANSFORMERS,
    NotAModelFolder,
    model_folder_kind,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}

# Every command that takes a model folder, with what else it needs to get that far (FOLDER: the folder given).
COMMANDS = {
    "info": ["info", "FOLDER"],
    "convert": ["convert", "FOLDER", "--to", "diff", "--out", "out-convert"],
    "generate": ["generate", "FOLDER", "--prompt", "hi"],
    "eval": ["eval", "FOLDER"],
    "export --to hf": ["export", "FOLDER", "--to", "hf", "--out", "out-hf"],
    "export --to vllm": ["export", "FOLDER", "--to", "vllm", "--out", "out-vllm"],
    "heads": ["heads", "FOLDER"],
    "serve": ["serve", "FOLDER"],
    "train --init-from": ["train", "--init-from", "FOLDER", "--config", "tiny", "--out", "out-train"],
}

# One interpreter: each command through main(), then its exit code, whether torch is loaded, and its stderr.
_RUN_ALL = """
import contextlib, io, json, sys
from diffattn.cli.main import main
for name, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    print(json.dumps([name, rc, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'), err.getvalue()]))
"""


def _run_all(cases: list[tuple[str, list[str]]], cwd: Path) -> dict[str, tuple[int, list[str], str]]:
    r = subprocess.run([sys.executable, "-c", _RUN_ALL, json.dumps(cases)], cwd=cwd, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return {name: (rc, torch, err) for name, rc, torch, err in map(json.loads, r.stdout.splitlines())}


def _not_models(tmp_path: Path) -> dict[str, str]:
    """Folders (and a file, and nothing) that hold no model: {name: what the message says of it}."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("my notes\n")
    (tmp_path / "settings").mkdir()
    (tmp_path / "settings" / "config.json").write_text('{"lr": 0.001}')  # a config.json of something else
    (tmp_path / "afile").write_text("text\n")
    return {"empty": "it is empty", "notes": "it holds no manifest.json, ckpt/ or config.json",
            "settings": "its config.json names no model", "afile": "it is a file, not a folder",
            "missing": "it does not exist"}


def test_every_command_refuses_a_folder_that_is_no_model_alike_before_importing_torch(tmp_path: Path) -> None:
    folders = _not_models(tmp_path)
    cases = [(f"{folder} {name}", [folder if a == "FOLDER" else a for a in argv])
             for folder in folders for name, argv in COMMANDS.items()]
    results = _run_all(cases, tmp_path)
    assert len(results) == len(cases)
    for folder, why in folders.items():
        said = {}
        for name in COMMANDS:
            rc, torch, err = results[f"{folder} {name}"]
            assert rc == 2 and torch == [], (folder, name, rc, torch, err)  # refused, torch never imported
            assert err.count("\n") == 1, (folder, name, err)  # one line
            said[name] = err.removeprefix("error: ").removeprefix("--init-from: ")
        assert len(set(said.values())) == 1, said  # the same message from every command
        line = said["info"]
        assert line.startswith(f"{folder}: not a model folder ({why}") and MODEL_FOLDER in line, line
    for out in ("out-convert", "out-hf", "out-vllm", "out-train"):
        assert not (tmp_path / out).exists()  # nothing written


def test_a_resume_of_a_run_that_does_not_exist_is_refused_before_torch(tmp_path: Path) -> None:
    results = _run_all([("out", ["train", "--resume", "--out", "nope"]),
                        ("config", ["train", "--resume", "--config", "tiny"])], tmp_path)
    for name, where in (("out", "nope"), ("config", str(Path("runs") / "tiny"))):
        rc, torch, err = results[name]
        assert rc == 2 and torch == [], (name, err)
        assert err == f"error: cannot resume: {where} does not exist, so there is no run to continue (a new run: " \
                      f"diffattn train --config CONFIG --out {where})\n"
    assert not (tmp_path / "nope").exists() and not (tmp_path / "runs").exists()


def test_the_kinds(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    assert model_folder_kind(run) == RUN
    old = tmp_path / "old"
    (old / "ckpt-step-3").mkdir(parents=True)
    assert model_folder_kind(old) == RUN and model_folder_kind(old / "ckpt") == RUN  # ckpt/ deleted: falls back
    for name, config, kind in (("hf", {"model_type": "llama"}, TRANSFORMERS),
                               ("hub", {"diffattn_class": "TransformerLM"}, PRETRAINED)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert model_folder_kind(tmp_path / name) == kind
    cmp = tmp_path / "cmp"
    (cmp / "runs").mkdir(parents=True)
    (cmp / "report.md").write_text("# report\n")
    assert model_folder_kind(cmp) == COMPARISON
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")  # handed on: the reader names the damage
    assert model_folder_kind(broken) == CHECKPOINT
    with pytest.raises(NotAModelFolder, match="not a model folder"):
        model_folder_kind(tmp_path / "nope")


def test_a_config_json_linked_out_of_the_folder_is_not_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text('{"lr": 1}')
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").symlink_to(outside)
    # not read through the link: handed on to the readers, which refuse the link itself
    assert model_folder_kind(tmp_path / "m") not in (TRANSFORMERS, PRETRAINED)


def test_the_library_readers_say_the_same(tmp_path: Path) -> None:
    """load_pretrained, open_model_folder and resolve_checkpoint_dir (what train --init-from, eval, heads read
    with) refuse a folder that is no model with the commands' message."""
    from diffattn.checkpoint.model_folders import load_pretrained, open_model_folder
    from diffattn.checkpoint.run_folder import resolve_checkpoint_dir

    folders = _not_models(tmp_path)
    for folder in folders:
        expected = str(pytest.raises(NotAModelFolder, model_folder_kind, tmp_path / folder).value)
        for read in (load_pretrained, open_model_folder, resolve_checkpoint_dir):
            with pytest.raises(ValueError) as e:
                read(tmp_path / folder)
            assert str(e.value) == expected, (read.__name__, folder)


def test_serve_without_vllm_is_refused_before_torch(tmp_path: Path) -> None:
    """`serve` of a model folder on a machine without vLLM (issue 51 item 4: it imported torch first)."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    script = ("import sys\nimport diffattn.interop.vllm as plugin\nplugin.installed_version = lambda: None\n"
              "from diffattn.cli.main import main\nrc = main(['serve', 'hf'])\n"
              "print(rc, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.stdout == "2 []\n", r.stderr
    assert r.stderr.startswith("error: vLLM is not installed; ") and r.stderr.count("\n") == 1, r.stderr
