"""Reads outside the folder given and writes into a folder a running command holds (issue 39): a run's best/ that
is a link elsewhere is refused by every reader, as train --resume refuses it; a comparison folder whose runs/<model>
or cells/<cell> is a link elsewhere is refused, before anything outside is opened; export and convert hold their
--out as train holds its folder, so neither writes into a running train's folder. One line, exit 2, each."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from clirun import run_main
from hostile import copy_run, one_line_refusal, sha256, train_tiny, tree

import diffattn.checkpoint.verify as verify
from diffattn.system.run_lock import LOCK_NAME, RunLock

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = train_tiny(tmp_path_factory.mktemp("reads"))
    assert (out / "best").is_dir()  # the 4-step run evaluates twice: its best checkpoint is there
    return out


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """Every file a verifier hashes: nothing outside the folder given may be among them."""
    seen: list[str] = []
    real = verify.file_sha256
    monkeypatch.setattr(verify, "file_sha256", lambda p: seen.append(str(p)) or real(p))
    return seen


def _best_elsewhere(run: Path, tmp: Path) -> tuple[Path, Path]:
    """A copy of ``run`` whose best/ is a link to a checkpoint outside it: (the run, the outside checkpoint)."""
    folder = copy_run(run, tmp / "r")
    outside = tmp / "outside-best"
    (folder / "best").rename(outside)
    os.symlink(outside, folder / "best")
    return folder, outside


@pytest.mark.parametrize("command", [["eval", "--checkpoint", "best", "--what", "ppl", "--batches", "1"],
                                     ["eval", "--what", "ppl", "--batches", "1"],  # its note read best/ (main)
                                     ["export", "--checkpoint", "best", "--to", "hf", "--out", "EXPORTED"],
                                     # its note read best/: a traceback, exit 1 (issue 52)
                                     ["export", "--to", "hf", "--out", "EXPORTED"]],
                         ids=["eval-best", "eval-note", "export-best", "export-note"])
def test_a_best_checkpoint_linked_elsewhere_is_refused_by_every_reader(run, tmp_path, hashed, command):
    folder, outside = _best_elsewhere(run, tmp_path)
    args = [str(tmp_path / "exported") if a == "EXPORTED" else a for a in command]
    r = run_main(args[0], folder, *args[1:])
    one_line_refusal(r, "best is a symbolic link out of its folder")
    assert not any(p.startswith(str(outside)) for p in hashed) and not (tmp_path / "exported").exists()
    resume = run_main("train", "--out", folder, "--resume", "--no-progress")  # the rule train --resume follows
    one_line_refusal(resume, "best is a symbolic link")


def _comparison(run: Path, tmp: Path, sub: str) -> tuple[Path, Path]:
    """A comparison folder (compare's runs/ or a study's cells/) holding one model and a link to one elsewhere."""
    folder = tmp / "cmp"
    (folder / sub).mkdir(parents=True)
    (folder / ("results.json" if sub == "runs" else "study.json")).write_text("{}")
    copy_run(run, folder / sub / "good")
    evil = copy_run(run, tmp / "evil")
    os.symlink(evil, folder / sub / "evil")
    return folder, evil


@pytest.mark.parametrize("sub", ["runs", "cells"])
def test_a_model_folder_linked_out_of_a_comparison_is_refused(run, tmp_path, hashed, sub):
    folder, evil = _comparison(run, tmp_path, sub)
    r = run_main("eval", folder, "--what", "ppl", "--batches", "1")  # main: "evaluating evil", exit 0
    one_line_refusal(r, f"{sub}/evil is a symbolic link out of its folder")
    assert "evaluating" not in r.stderr and not any(p.startswith(str(evil)) for p in hashed)
    one_line_refusal(run_main("info", folder), "symbolic link out of its folder")
    shutil.rmtree(folder / sub)  # the whole runs/ (cells/) linked elsewhere: refused the same way
    os.symlink(evil.parent, folder / sub)
    one_line_refusal(run_main("eval", folder, "--what", "ppl"), f"{sub} is a symbolic link out of its folder")


@pytest.mark.parametrize("command", [["export", "RUN", "--to", "hf"], ["export", "RUN", "--to", "vllm"],
                                     ["convert", "RUN", "--to", "dint"]], ids=["export-hf", "export-vllm", "convert"])
def test_a_writer_never_writes_into_a_folder_a_running_train_holds(run, tmp_path, command):
    """main: both wrote while the lock was held; afterwards info showed "training state: none recorded"."""
    held = copy_run(run, tmp_path / "training")
    source = run if command[0] == "export" else _standard_run(tmp_path)
    before = tree(held)
    with RunLock(held, "diffattn train"):  # as the running train holds it
        r = run_main(*[source if a == "RUN" else a for a in command], "--out", held, "--overwrite")
        one_line_refusal(r, "is in use by diffattn train", "nothing was changed")
        assert tree(held) == {**before, LOCK_NAME: tree(held)[LOCK_NAME]}
    assert tree(held) == before
    assert run_main("info", held).returncode == 0 and "training state: none" not in run_main("info", held).stdout


def _standard_run(tmp: Path) -> Path:
    """A standard-attention checkpoint for convert (its source must be one)."""
    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.configs.run_config import RunConfig
    from diffattn.model.config import ModelConfig
    from diffattn.model.transformer import TransformerLM

    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, attention="standard", max_seq_len=16)
    save_checkpoint(tmp / "std", TransformerLM(cfg), run_config=RunConfig.of_model(cfg))
    return tmp / "std"


def test_an_export_holds_its_out_while_it_writes_and_lets_it_go(run, tmp_path, monkeypatch):
    """The lock is taken (a train started meanwhile is refused) and released: nothing of it is left."""
    import diffattn.interop.hf_export as hf_export

    out = tmp_path / "exp"
    out.mkdir()
    seen: list[str] = []
    real = hf_export.export_hf

    def export_hf(*a, **kw):
        try:
            RunLock(out, "a train").acquire()
        except ValueError as e:  # FolderInUse: held by the export
            seen.append(str(e))
        return real(*a, **kw)

    monkeypatch.setattr(hf_export, "export_hf", export_hf)
    assert run_main("export", run, "--to", "hf", "--out", out).returncode == 0
    assert seen and "in use by diffattn export" in seen[0]
    assert not (out / LOCK_NAME).exists() and json.loads((out / "config.json").read_text())["architectures"]
    assert sha256(out / "model.safetensors")
