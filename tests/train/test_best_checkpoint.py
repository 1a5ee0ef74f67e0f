"""A run keeps its best checkpoint (issue 32): a classifier scored 0.7805 validation accuracy at step 300 and 0.6098
at step 600, and only the last checkpoints were kept. Now ``RUN/best`` holds the best evaluation's weights (a
language model by validation loss, a classifier by validation accuracy), written atomically beside the last ones;
``eval``/``export --checkpoint best`` read it, ``--checkpoint last`` (the default) says where it is, and a resume
continues from the last checkpoint and goes on comparing against the best it recorded.

The evaluations here are scripted (a task whose ``evaluate`` returns given figures), so which step is best does
not depend on how a few steps of training happen to go."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clirun import run_main
from safetensors.torch import load_file

from diffattn.checkpoint.best import BEST, record_best
from diffattn.checkpoint.format import load_checkpoint
from diffattn.checkpoint.output_guard import clean_leftovers
from diffattn.checkpoint.run_folder import best_note, pick_checkpoint
from diffattn.configs.run_config import DataConfig, RunConfig, TrainConfig
from diffattn.data.lm import make_source
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.classify import ClassifyTask, prepare_data
from diffattn.train.loop import train
from diffattn.train.task import LMTask

TEXT = "a quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 40
pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedLM(LMTask):
    """Next-token training as usual; the validation loss at step s is ``losses[s]``."""

    def __init__(self, source, losses: dict[int, float]) -> None:
        super().__init__(source, diagnostics=False)
        self.losses = losses

    def evaluate(self, model, tcfg, *, step, final, device, dist, autocast):
        return {"val_loss": self.losses[step]}


class ScriptedClassifier(ClassifyTask):
    def __init__(self, data, accuracy: dict[int, float]) -> None:
        super().__init__(data)
        self.accuracy = accuracy

    def evaluate(self, model, tcfg, *, step, final, device, dist, autocast):
        return {"val_loss": 1.0 - 0.1 * step, "val_accuracy": self.accuracy[step], "val_macro_f1": 0.5,
                "test_accuracy": None, "test_macro_f1": None}


def test_which_evaluation_is_best() -> None:
    state: dict = {}
    assert record_best("lm", {"val_loss": 2.0}, state, 1) and state["best"] == {"metric": "val_loss", "value": 2.0,
                                                                               "step": 1}
    assert not record_best("lm", {"val_loss": 2.0}, state, 2)  # a tie keeps the earlier one
    assert record_best("lm", {"val_loss": 1.5}, state, 3) and state["best"]["step"] == 3
    state = {}
    assert record_best("classify", {"val_accuracy": 0.78, "val_loss": 0.9}, state, 3)
    assert not record_best("classify", {"val_accuracy": 0.61, "val_loss": 0.5}, state, 6)  # accuracy decides
    assert not record_best("lm", {"val_loss": float("nan")}, {}, 1)


def _lm_run(out: Path, losses: dict[int, float], steps: int, resume: bool = False) -> TransformerLM:
    (out.parent / "text.txt").write_text(TEXT)
    data = {"path": str(out.parent / "text.txt"), "tokenizer": "char"}
    source, tok = make_source(data, 16)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    tcfg = TrainConfig(steps=steps, batch_size=2, seq_len=16, eval_every=1, eval_batches=1, warmup_steps=0,
                       keep_checkpoints=10, tracker="none", log_every=1)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    run = RunConfig(task="lm", model=cfg, train=tcfg, data=DataConfig(**data))
    train(model, ScriptedLM(source, losses), run, out_dir=out, progress=False, tokenizer=tok,
          resume=resume, quiet=True)
    return model


def test_a_language_model_keeps_its_lowest_validation_loss_and_a_resume_remembers_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    losses = {1: 3.0, 2: 2.0, 3: 2.5, 4: 2.2, 5: 1.9}
    _lm_run(run, losses, steps=4)
    best = load_checkpoint(run / BEST)
    assert best.train_state["step"] == 2 and best.train_state["best"] == {"metric": "val_loss", "value": 2.0,
                                                                         "step": 2}
    assert best.optimizer_state is None  # weights to read, not a resume point
    step2 = load_file(run / "ckpt-step-2" / "model.safetensors")
    assert all(torch.equal(t, step2[k]) for k, t in load_file(run / BEST / "model.safetensors").items())
    assert load_checkpoint(run / "ckpt").train_state["step"] == 4  # the last checkpoints are as before
    assert pick_checkpoint(run, "best") == pick_checkpoint(run / "ckpt", "best") == run / BEST
    assert pick_checkpoint(run, "last") == run
    assert "its best, val loss 2.0000 at step 2, is in" in best_note(run / "ckpt", 4)
    assert best_note(run / BEST, 2) is None

    _lm_run(run, losses, steps=5, resume=True)  # 1.9 at step 5 beats the recorded best
    assert load_checkpoint(run / BEST).train_state["best"]["step"] == 5
    assert best_note(run, 5) is None  # the last one is the best: nothing to say


def test_a_resume_that_does_not_improve_keeps_the_best(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _lm_run(run, {1: 3.0, 2: 2.0}, steps=2)
    before = load_file(run / BEST / "model.safetensors")
    _lm_run(run, {1: 3.0, 2: 2.0, 3: 2.5, 4: 2.1}, steps=4, resume=True)
    after = load_checkpoint(run / BEST)
    assert after.train_state["best"]["step"] == 2
    assert all(torch.equal(t, before[k]) for k, t in load_file(run / BEST / "model.safetensors").items())


def test_a_classifier_keeps_its_highest_validation_accuracy_and_eval_export_choose(tmp_path: Path, capsys) -> None:
    rows = "".join(f"{'pos' if i % 2 else 'neg'},{'good fine' if i % 2 else 'bad awful'} {i}\n" for i in range(60))
    (tmp_path / "train.csv").write_text("label,text\n" + rows)
    dc = DataConfig(path=str(tmp_path / "train.csv"))
    data = prepare_data(dc, 24)
    cfg = ModelConfig(vocab_size=data.tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=24,
                      causal=False, attention="standard")
    tcfg = TrainConfig(steps=3, batch_size=4, seq_len=24, eval_every=1, warmup_steps=0, keep_checkpoints=5,
                       tracker="none")
    from diffattn.configs.run_config import ClassifyConfig
    from diffattn.model.transformer import TransformerClassifier

    torch.manual_seed(0)
    model = TransformerClassifier(cfg, num_classes=2)
    run = RunConfig(task="classify", model=cfg, train=tcfg, data=dc,
                    classify=ClassifyConfig(num_classes=2, labels=list(data.labels)))
    train(model, ScriptedClassifier(data, {1: 0.5, 2: 0.7805, 3: 0.6098}), run, out_dir=tmp_path / "cls",
          progress=False, tokenizer=data.tokenizer)
    err = capsys.readouterr().err
    at3 = next(ln for ln in err.splitlines() if ln.startswith("eval at step 3:"))
    assert "val accuracy 0.6098" in at3 and at3.endswith("; best val accuracy 0.7805 at step 2")
    assert load_checkpoint(tmp_path / "cls" / BEST).train_state["step"] == 2

    last = run_main("eval", tmp_path / "cls")
    best = run_main("eval", tmp_path / "cls", "--checkpoint", "best")
    assert last.returncode == best.returncode == 0, last.stderr + best.stderr
    assert "its best, val accuracy 0.7805 at step 2, is in" in last.stderr and "--checkpoint best" in last.stderr
    assert "its best" not in best.stderr and str(tmp_path / "cls" / BEST) in best.stdout
    r = run_main("eval", tmp_path / "cls" / "ckpt-step-2", "--checkpoint", "best")
    assert r.returncode == 0 and str(tmp_path / "cls" / BEST) in r.stdout  # from any checkpoint of the run


def test_export_reads_the_best_checkpoint_and_a_run_without_one_says_so(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from diffattn.interop.hf import read_hf_folder

    run = tmp_path / "run"
    _lm_run(run, {1: 3.0, 2: 2.0, 3: 2.5}, steps=3)
    r = run_main("export", run, "--to", "hf", "--out", tmp_path / "hf", "--checkpoint", "best")
    assert r.returncode == 0, r.stderr
    ours = load_checkpoint(run / BEST).build_model()
    ids = torch.randint(0, ours.config.vocab_size, (1, 12))
    with torch.no_grad():
        assert (read_hf_folder(tmp_path / "hf")(ids) - ours(ids)).abs().max() < 1e-4
    r = run_main("export", run, "--to", "hf", "--out", tmp_path / "hf-last")
    assert r.returncode == 0 and "its best, val loss 2.0000 at step 2" in r.stderr
    (tmp_path / "plain").mkdir()
    import shutil

    shutil.copytree(run / "ckpt", tmp_path / "plain" / "ckpt")
    r = run_main("eval", tmp_path / "plain", "--checkpoint", "best")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no best checkpoint" in r.stderr


def test_overwrite_removes_it_and_a_best_a_killed_save_moved_aside_is_put_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _lm_run(run, {1: 3.0, 2: 2.0}, steps=2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    moved = run / f".{BEST}.old-{int(dead.stdout)}"
    (run / BEST).rename(moved)  # what a save killed between its two renames leaves
    notes = clean_leftovers(run)
    assert (run / BEST).is_dir() and not moved.exists() and any("put back as best/" in n for n in notes)
    r = run_main("train", "--config", "tiny", "--data.path", tmp_path / "text.txt", "--out", run, "--overwrite",
                 "--model.d_model", "16", "--model.n_layers", "1", "--model.n_heads", "2", "--train.steps", "1",
                 "--train.eval_every", "0", "--train.seq_len", "16", "--train.batch_size", "2",
                 "--train.tracker", "none", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert not (run / BEST).exists()  # the earlier run's best went with the rest of it
