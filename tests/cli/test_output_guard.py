"""One output guard for every command that writes (issue 14, items 1, 4 and 5).

* ``convert`` refuses a non-empty ``--out`` (``--overwrite`` replaces only its own files) and always refuses its
  source folder; ``eval --out`` and ``heads --plot`` never replace a file without ``--overwrite``.
* Validate first, create second: unwritable outputs are a one-line error with exit 2 before any work, and a
  failed command leaves the file system as it found it.
* ``eval`` reads every checkpoint it claims to: classifier runs, comparison folders, converted models.

The command-line cases run through ``main(argv)``, as the program would (``clirun.run_main``)."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch
from clirun import run_main

from diffattn.checkpoint.format import CheckpointError, load_checkpoint, save_checkpoint
from diffattn.checkpoint.output_guard import (
    CHECKPOINT_FILES,
    OutputError,
    OutputFolder,
    RunDirError,
    check_output_dir,
    check_output_file,
    first_missing,
)
from diffattn.checkpoint.run_folder import resolve_checkpoint_dir
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "the cat sat on the mat. the dog sat on the log.\n" * 20


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``folder`` with its size and mtime: equal snapshots = nothing changed."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _lm_run(tmp_path: Path, name: str = "base", attention: str = "standard") -> Path:
    """A run folder as `diffattn train` leaves it (ckpt/, metrics.csv, resolved.toml) of an untrained char LM."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    tok = build_tokenizer("char", TEXT)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, attention=attention,
                      max_seq_len=16)
    torch.manual_seed(0)
    run = tmp_path / name
    save_checkpoint(run / "ckpt", TransformerLM(cfg), tokenizer=tok, train_state={"step": 2},
                    run_config={"task": "lm", "model": cfg.to_dict(), "train": {"seq_len": 16},
                                "data": {"path": str(corpus), "tokenizer": "char"}})
    (run / "metrics.csv").write_text("step,train_loss\n1,3.0\n2,2.9\n")
    (run / "resolved.toml").write_text("task = 'lm'\n")
    return run


def _one_line_error(r, *needles: str) -> str:
    """The process exited 2 with exactly one line on stderr (no traceback) naming every needle."""
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


# ------------------------------------------------------------------------------------------ the guard itself
def test_check_output_dir_validates_without_creating(tmp_path: Path) -> None:
    new = tmp_path / "a" / "b"
    assert check_output_dir(new, overwrite=False) == [] and not (tmp_path / "a").exists()
    assert first_missing(new) == tmp_path / "a"
    run = _lm_run(tmp_path, "old")
    before = _snapshot(run)
    with pytest.raises(RunDirError, match="already holds a run.*--resume.*--overwrite"):
        check_output_dir(run, overwrite=False)
    assert [p.name for p in check_output_dir(run, overwrite=True)] == ["ckpt", "metrics.csv", "resolved.toml"]
    assert _snapshot(run) == before  # checking never changes anything, even with overwrite
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        check_output_dir(tmp_path / "f", overwrite=True)
    with pytest.raises(OutputError, match="cannot write in /proc"):
        check_output_dir("/proc/x", overwrite=True)


def test_the_source_is_always_refused(tmp_path: Path) -> None:
    run = _lm_run(tmp_path)
    for out in (run, run / "sub", run / "ckpt"):
        with pytest.raises(OutputError, match="source"):
            check_output_dir(out, overwrite=True, owned_patterns=CHECKPOINT_FILES, source=run, refuse_nonempty=True)
    # the source inside the output folder, among what --overwrite would remove: refused too
    with pytest.raises(OutputError, match="would remove the source"), OutputFolder(run, "t", source=run / "ckpt") as f:
        f.claim(patterns=("ckpt", "metrics.csv"), overwrite=True)
    assert (run / "ckpt" / "manifest.json").is_file()


def test_claim_then_release_leaves_the_file_system_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "x" / "y" / "run"
    with pytest.raises(RuntimeError), OutputFolder(out, "t") as folder:  # the block fails: the claim is undone
        assert folder.claim(patterns=("metrics.csv", "resolved.toml"), undo=True) == [] and out.is_dir()
        assert folder.lock is not None and folder.lock.held
        (out / "metrics.csv").write_text("step\n")  # what a run that then failed wrote
        raise RuntimeError("the run failed")
    assert not (tmp_path / "x").exists()
    # a folder the user had, with their files: only the run's outputs go, the folder and their files stay
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt), OutputFolder(mine, "t") as folder:
        folder.claim(patterns=("metrics.csv", "resolved.toml"), undo=True)
        (mine / "resolved.toml").write_text("")
        raise KeyboardInterrupt
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # the lock file went too
    # a block that ends well keeps what it wrote, and lets the lock go
    with OutputFolder(mine, "t") as folder:
        folder.claim(patterns=("resolved.toml",), undo=True)
        (mine / "resolved.toml").write_text("")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "resolved.toml"]
    # a run folder with a checkpoint is never released
    run = _lm_run(tmp_path, "done")
    (run / "metrics.csv").rename(run / "metrics.bak")  # claimed as new, then the run wrote its metrics and failed
    with pytest.raises(RuntimeError), OutputFolder(run, "t") as folder:
        folder.claim(patterns=("metrics.csv",), undo=True)
        (run / "metrics.bak").rename(run / "metrics.csv")
        raise RuntimeError("the run failed")
    assert (run / "metrics.csv").is_file() and not folder.undo()


def test_check_output_file(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    assert check_output_file(f, overwrite=False) == f and not f.exists()
    f.write_text("{}")
    with pytest.raises(OutputError, match="already exists.*--overwrite"):
        check_output_file(f, overwrite=False)
    check_output_file(f, overwrite=True)
    assert f.read_text() == "{}"
    with pytest.raises(OutputError, match="does not exist"):
        check_output_file(tmp_path / "no" / "r.json", overwrite=True)
    with pytest.raises(OutputError, match="is a folder"):
        check_output_file(tmp_path, overwrite=True)
    with pytest.raises(OutputError, match="inside the checkpoint folder"):
        check_output_file(tmp_path / "ck" / "model.safetensors", overwrite=True, inside_forbidden=tmp_path / "ck")


# ------------------------------------------------------------------------------------------------- convert
def test_convert_never_overwrites_and_never_writes_into_its_source(tmp_path: Path) -> None:
    base = _lm_run(tmp_path, "base")
    victim = _lm_run(tmp_path, "victim", attention="diff")  # a folder holding a training run ...
    (victim / "notes.txt").write_text("my notes")  # ... and the user's own file
    before = _snapshot(victim)
    r = run_main("convert", "base", "--to", "diff", "--out", "victim", cwd=tmp_path)
    _one_line_error(r, "victim is not empty", "notes.txt", "--overwrite")
    assert _snapshot(victim) == before

    r = run_main("convert", "base", "--to", "diff", "--out", "victim", "--overwrite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (victim / "notes.txt").read_text() == "my notes"  # the user's file stays ...
    assert {"ckpt", "metrics.csv", "resolved.toml"} <= {p.name for p in victim.iterdir()}  # ... so does the run
    assert load_checkpoint(victim / "ckpt").model_config.attention == "diff"
    conv = load_checkpoint(victim)  # the converted model, complete and verified
    assert conv.model_config.attention == "diff" and conv.train_state["converted_from"]["source"] == "base"
    assert not list(victim.glob(".convert-*"))

    base_before = _snapshot(base)
    r = run_main("convert", "base", "--to", "diff", "--out", "base", "--overwrite", cwd=tmp_path)
    _one_line_error(r, "is the source")  # the source itself: refused even with --overwrite
    assert _snapshot(base) == base_before
    from diffattn.cli.main import main

    for out in ("base/ckpt", "base/sub"):  # inside the source: refused too (in-process: the same CLI)
        assert main(["convert", str(base), "--to", "diff", "--out", str(tmp_path / out), "--overwrite"]) == 2
        assert _snapshot(base) == base_before


# --------------------------------------------------------------------------- unwritable outputs fail up front
def test_unwritable_outputs_are_one_line_errors_before_any_work(tmp_path: Path) -> None:
    run = _lm_run(tmp_path, "da", attention="distance")
    before = _snapshot(tmp_path)
    r = run_main("eval", "da", "--out", "/nonexistent/dir/r.json", cwd=tmp_path)
    _one_line_error(r, "/nonexistent/dir", "does not exist")
    assert r.stdout == ""  # nothing was evaluated (the old command ran the whole suite, then a traceback)
    r = run_main("heads", "da", "--plot", "/nonexistent/dir/h.png", cwd=tmp_path)
    _one_line_error(r, "--plot", "/nonexistent/dir")
    assert r.stdout == ""
    r = run_main("train", "--config", "tiny", "--data.path", "corpus.txt", "--out", "/proc/x", cwd=tmp_path)
    _one_line_error(r, "/proc")
    assert not Path("/proc/x").exists() and _snapshot(tmp_path) == before

    # existing output files are replaced only with --overwrite (in-process: the same CLI)
    from diffattn.cli.main import main

    (tmp_path / "r.json").write_text("mine")
    (tmp_path / "h.png").write_text("mine")
    assert main(["eval", str(run), "--what", "ppl", "--batches", "1", "--out", str(tmp_path / "r.json")]) == 2
    assert main(["heads", str(run), "--plot", str(tmp_path / "h.png")]) == 2
    assert (tmp_path / "r.json").read_text() == "mine" and (tmp_path / "h.png").read_text() == "mine"
    assert main(["eval", str(run), "--what", "ppl", "--batches", "1", "--batch-size", "2",
                 "--out", str(tmp_path / "r.json"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["ppl"]["tokens"] == 2 * 16
    assert main(["heads", str(run), "--plot", str(tmp_path / "h.png"), "--overwrite"]) == 0
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_a_failed_train_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text(TEXT)
    # diverges at once (lr 1e30): no checkpoint is ever written, so the folders it made go again
    r = run_main("train", "--config", "tiny", "--data.path", "t.txt", "--out", "new/nested/run",
                     "--no-progress", "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                     "--train.steps", "20", "--train.seq_len", "16", "--train.batch_size", "2",
                     "--train.eval_every", "0", "--train.lr", "1e30", "--train.warmup_steps", "0",
                     "--train.grad_clip", "0", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "non-finite" in r.stderr and not (tmp_path / "new").exists()
    # bad data: refused before the folder is made
    from diffattn.cli.main import main

    assert main(["train", "--config", "tiny", "--data.path", str(tmp_path / "missing.txt"),
                 "--out", str(tmp_path / "r2")]) == 2
    assert not (tmp_path / "r2").exists()


def test_init_from_cannot_write_over_its_source(tmp_path: Path, capsys) -> None:
    from diffattn.cli.main import main

    base = _lm_run(tmp_path, "base")
    before = _snapshot(base)
    for out in (base, base / "ckpt"):
        assert main(["train", "--init-from", str(base / "ckpt"), "--data.path", str(tmp_path / "corpus.txt"),
                     "--out", str(out), "--overwrite"]) == 2
        assert "source" in capsys.readouterr().err
    assert _snapshot(base) == before


# --------------------------------------------------------------------------- eval on every checkpoint it claims
def _classifier_run(tmp_path: Path, monkeypatch) -> tuple[Path, dict]:
    """A tiny classifier trained by `diffattn train --task classify` on relative paths (in-process)."""
    from diffattn.cli.main import main

    rng = random.Random(0)
    paths = {}
    for name, n in (("train.csv", 60), ("test.csv", 20)):
        paths[name] = tmp_path / name
        with open(paths[name], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["label", "text"])
            for i in range(n):
                lab = "pos" if i % 2 else "neg"
                w.writerow([lab, ("good nice " if lab == "pos" else "bad awful ") * rng.randint(1, 3)])
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--task", "classify", "--data.path", "train.csv", "--data.test_path", "test.csv",
                 "--data.val_fraction", "0.25", "--out", "cls", "--no-progress", "--model.d_model", "16",
                 "--model.n_layers", "1", "--model.n_heads", "2", "--model.attention", "diff",
                 "--model.max_seq_len", "32", "--train.steps", "6", "--train.batch_size", "8",
                 "--train.warmup_steps", "0", "--train.eval_every", "0"]) == 0
    return tmp_path / "cls", paths


def test_eval_a_classifier_run(tmp_path: Path, monkeypatch, capsys) -> None:
    out, paths = _classifier_run(tmp_path, monkeypatch)
    capsys.readouterr()
    state = load_checkpoint(out / "ckpt").train_state
    elsewhere = tmp_path / "elsewhere"  # the run recorded test.csv relative to its folder: eval finds it anyway
    elsewhere.mkdir()
    r = run_main("eval", out, "--json", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["classify"]
    assert res["labels"] == ["neg", "pos"]
    val, test = res["splits"]["validation"], res["splits"][f"test ({paths['test.csv']})"]
    assert val["rows"] == 15 and test["rows"] == 20  # the run's own held-out split (25% of 60) and test file
    assert val["accuracy"] == pytest.approx(state["val_accuracy"])  # the very split training scored
    assert val["macro_f1"] == pytest.approx(state["val_macro_f1"])
    assert test["accuracy"] == pytest.approx(state["test_accuracy"])
    # on another file, and as text
    from diffattn.cli.main import main

    assert main(["eval", str(out), "--data", str(paths["test.csv"]), "--out", str(tmp_path / "c.json")]) == 0
    assert "accuracy" in capsys.readouterr().out
    other = json.loads((tmp_path / "c.json").read_text())["classify"]["splits"][str(paths["test.csv"])]
    assert other["rows"] == 20 and other["accuracy"] == pytest.approx(test["accuracy"])


def test_eval_a_comparison_folder(tmp_path: Path, capsys) -> None:
    import argparse

    from diffattn.cli import compare
    from diffattn.cli.main import main

    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    out = tmp_path / "cmp"
    assert compare.run(p.parse_args(["--quick", "--steps", "2", "--samples", "2", "--no-progress",
                                     "--out", str(out)])) == 0
    capsys.readouterr()
    with pytest.raises(CheckpointError, match="comparison folder holding 2 models"):
        resolve_checkpoint_dir(out)  # info, generate, heads: a clear line instead of "manifest.json is missing"
    ppl = ["--what", "ppl", "--batches", "1", "--batch-size", "2", "--json"]
    r = run_main("eval", "cmp", *ppl, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    models = json.loads(r.stdout)["models"]
    assert sorted(models) == ["diff", "standard"]
    assert main(["eval", str(out / "runs" / "diff"), *ppl]) == 0  # one model by its folder ...
    assert json.loads(capsys.readouterr().out) == models["diff"]
    assert main(["eval", str(out), "--model", "standard", *ppl]) == 0  # ... or by name
    assert json.loads(capsys.readouterr().out) == {"models": {"standard": models["standard"]}}
    assert main(["eval", str(out), "--model", "nope"]) == 2
    assert "diff, standard" in capsys.readouterr().err


def test_eval_a_converted_model_names_the_data_it_needs(tmp_path: Path, capsys) -> None:
    from diffattn.cli.main import main

    _lm_run(tmp_path, "base")
    assert main(["convert", str(tmp_path / "base"), "--to", "diff", "--out", str(tmp_path / "conv")]) == 0
    capsys.readouterr()
    r = run_main("eval", "conv", cwd=tmp_path)
    _one_line_error(r, "diffattn convert", "--data FILE")
    ppl = ["--what", "ppl", "--batches", "1", "--batch-size", "2", "--json"]
    assert main(["eval", str(tmp_path / "conv"), "--data.path", str(tmp_path / "corpus.txt"), *ppl]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"]["tokens"] == 2 * 16


def test_eval_help_says_what_works() -> None:
    from diffattn.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]
    text = sub.format_help()
    for needle in ("comparison folder", "converted", "classifier", "--model", "--overwrite", "--data.path"):
        assert needle in text, needle
    helps = {a.dest: a.help for a in sub._actions}
    assert helps["batch_size"] and helps["seed"]  # every option says what it does
    assert all(h for d, h in helps.items() if d != "help")
