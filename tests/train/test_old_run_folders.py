"""Run folders written before the typed run config (issue 21) still resume.

``old_runs/`` holds two runs written by the code of commit 2b58e76 (``diffattn train --config tiny ...
--train.steps 4``, a tiny model): ``lm`` on ``corpus.txt`` (its config records the data by an absolute path and
fingerprint, as the old code did) and ``synth``, a synthetic task whose parameter ``n_pairs`` sits among the
``[data]`` keys (the old layout; the typed config keeps it in ``data.params``). Their ``run_config`` dicts have
the old layout: ``classify = {}``, the data section as given."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from diffattn.checkpoint.format import load_checkpoint
from diffattn.cli.main import main
from diffattn.configs.run_config import RunConfig
from diffattn.train.runlog import read_metrics

OLD = Path(__file__).parent / "old_runs"


def _copy(tmp_path: Path, name: str) -> Path:
    shutil.copytree(OLD / name, tmp_path / name)
    return tmp_path / name


def test_an_old_lm_run_resumes_on_its_data(tmp_path: Path, capsys) -> None:
    run = _copy(tmp_path, "lm")
    old = json.loads((run / "ckpt" / "config.json").read_text())["run_config"]
    corpus = shutil.copy(OLD / "corpus.txt", tmp_path / "corpus.txt")
    # the data it recorded (/tmp/oldrun/corpus.txt, where it was made) is passed again from here
    assert main(["train", "--out", str(run), "--resume", "--train.steps", "6", "--data.path", str(corpus),
                 "--no-progress", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "resuming from step 4 of 6" in err and "done: step 6" in err
    ck = load_checkpoint(run / "ckpt")
    assert ck.train_state["step"] == 6
    assert [r["step"] for r in read_metrics(run / "metrics.csv")] == [2, 4, 6]  # log_every 10: evaluations and the end
    new = ck.run_config  # read back typed
    assert new.model == RunConfig.from_dict(old).model and new.data.fingerprint["path"] == str(Path(corpus).resolve())


def test_an_old_synthetic_run_keeps_its_task_parameters(tmp_path: Path, capsys) -> None:
    run = _copy(tmp_path, "synth")
    old = json.loads((run / "ckpt" / "config.json").read_text())["run_config"]
    assert old["data"]["n_pairs"] == 2 and old["classify"] == {}  # the old layout
    assert RunConfig.from_dict(old).data.params == {"n_pairs": 2}
    assert main(["train", "--out", str(run), "--resume", "--train.steps", "6", "--no-progress", "--threads",
                 "1"]) == 0
    assert "done: step 6" in capsys.readouterr().err
    ck = load_checkpoint(run / "ckpt")
    assert ck.train_state["step"] == 6 and ck.run_config.data.params == {"n_pairs": 2}
    assert ck.run_config.model == RunConfig.from_dict(old).model


def test_a_run_config_reads_back_typed_from_every_folder(tmp_path: Path) -> None:
    """A checkpoint's run config is the typed RunConfig, the same value as the dict it recorded (old layout
    included), and it writes back the same layout; a model no run trained records only its model."""
    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.checkpoint.model_folders import open_model_folder
    from diffattn.model.transformer import TransformerLM

    for name in ("lm", "synth"):
        old = json.loads((OLD / name / "ckpt" / "config.json").read_text())["run_config"]
        ck = load_checkpoint(OLD / name / "ckpt", tensors=False)
        assert isinstance(ck.run_config, RunConfig) and ck.run_config == RunConfig.from_dict(old)
        assert ck.model_config is ck.run_config.model and ck.task == "lm"
        assert RunConfig.from_dict(ck.run_config.to_dict()) == ck.run_config
    model = TransformerLM(load_checkpoint(OLD / "lm" / "ckpt", tensors=False).model_config)
    save_checkpoint(tmp_path / "converted", model, run_config=RunConfig.of_model(model.config))
    ck = open_model_folder(tmp_path / "converted")
    assert json.loads((tmp_path / "converted" / "config.json").read_text())["run_config"].keys() == {"task", "model"}
    assert ck.run_config.recorded == {"model"} and ck.run_config.model == model.config
