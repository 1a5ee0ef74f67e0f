"""`diffattn study DATA`: the study's own command (issue 21, item 5); `compare --data DATA`, its older spelling,
is refused in one line that points to it (issue 50, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffattn.cli.main import main

TEXT = "It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon. " * 40
SMALL = ["--quick", "--steps", "2", "--seq-len", "16", "--d-model", "16", "--batch-size", "2", "--threads", "1",
         "--seeds", "1", "--lrs", "0.003", "--lr-extensions", "0", "--progress-seconds", "600",
         "--probe-seconds", "0", "--poll-seconds", "0.5", "--no-progress"]


def test_study_runs_and_compare_data_points_to_it(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "study"
    n = torch.get_num_threads()
    try:
        assert main(["study", str(corpus), *SMALL, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert (out / "report.md").is_file() and "diffattn compare" not in err
        plan = json.loads((out / "study.json").read_text())["plan"]
        assert plan["command"].startswith(f"diffattn study {corpus} ")  # the command that resumes it
        cells = sorted(p.name for p in (out / "cells").iterdir())
        assert len(cells) == 2  # DIFF and its baseline, one LR, one seed
        # the older spelling: one line pointing to `study`, exit 2, the folder untouched (its options, which compare
        # does not have, do not hide the pointer behind an "unrecognized arguments")
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(SystemExit) as e:
            main(["compare", "--data", str(corpus), *SMALL, "--out", str(out)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "compare --data is gone" in err[0] and "diffattn study DATA" in err[0], err
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
        assert sorted(p.name for p in (out / "cells").iterdir()) == cells
        assert main(["study", *SMALL, "--out", str(tmp_path / "none")]) == 2
        assert "give the data to study: diffattn study DATA" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)


def test_a_cell_json_of_an_older_version_is_the_same_config(tmp_path: Path) -> None:
    """A cell's folder is resumed when its cell.json holds the same run config by value: written by an older
    version (every data key spelt out, a train field it did not know yet), it still matches; another LR does not."""
    from diffattn.experiments.study.cell import _same_config, cell_config
    from diffattn.experiments.study.spec import StudySpec

    spec = StudySpec.from_dict(dict(data=str(tmp_path / "c.txt"), d_model=16, n_layers=1, heads=[2], lrs=[1e-3],
                               seeds=[0],
                     seq_len=16, batch_size=2, steps=2))
    arm = spec.arms()[0]
    run = cell_config(spec, arm, 1e-3, 0, 40)
    old = run.to_dict()
    old["data"] = {"path": spec.data.path, "tokenizer": "char", "val_fraction": 0.1}  # as the older code wrote it
    del old["train"]["tracker"], old["classify"]  # fields it did not have
    f = tmp_path / "cell.json"
    f.write_text(json.dumps(old))
    assert _same_config(f, run)
    assert not _same_config(f, cell_config(spec, arm, 2e-3, 0, 40))
    f.write_text("{not json")
    assert not _same_config(f, run)


def test_a_quick_study_probes_briefly_and_an_explicit_probe_wins() -> None:
    """--quick ignores the budget, so its timing probe only sizes the printed estimate: 0.5 s an arm, not 5."""
    import argparse

    from diffattn.cli import study
    from diffattn.experiments.study.request import study_run

    p = argparse.ArgumentParser()
    study.add_arguments(p)
    seconds = {(q, given): study_run(vars(p.parse_args(["t.txt", *(["--quick"] if q else []),
                                                      *(["--probe-seconds", given] if given else [])]))).probe_s()
               for q in (False, True) for given in ("", "2")}
    assert seconds == {(False, ""): 5.0, (True, ""): 0.5, (False, "2"): 2.0, (True, "2"): 2.0}
