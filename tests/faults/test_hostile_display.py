"""Output that could drive a terminal or a page (issue 39): every string read from a file is escaped where it is
printed (info's history, the eval and export notes, generate's text from a crafted tokenizer) or written into
Markdown (the model cards of export --to hf and --to vllm)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from clirun import run_main
from hostile import copy_run, edit_json, one_line_refusal, train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")

OSC = "\x1b]0;owned\x07"  # sets the terminal's title
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # what may not reach a terminal


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_tiny(tmp_path_factory.mktemp("display"))


def test_info_refuses_a_history_that_is_not_records_and_escapes_what_records_hold(run, tmp_path):
    """main: info printed history[-1] raw; an OSC title sequence reached the terminal."""
    folder = copy_run(run, tmp_path / "r")
    for older in folder.glob("ckpt-step-*"):  # no older checkpoint to fall back to
        shutil.rmtree(older)
    edit_json(folder / "ckpt", "config.json", lambda c: c["train_state"].update(history=[OSC]))
    err = one_line_refusal(run_main("info", folder), "train_state.history must be a list of objects")
    assert "\\x1b]0;owned\\x07" in err
    edit_json(folder / "ckpt", "config.json", lambda c: c["train_state"].update(
        history=[{"step": 4, OSC: "\u202eevil", "note": OSC}], best=None))
    r = run_main("info", folder)
    assert r.returncode == 0 and not RAW.search(r.stdout + r.stderr)
    assert "last metrics: " in r.stdout and "owned" in r.stdout


def test_the_best_checkpoint_note_is_escaped_in_eval_and_export(run, tmp_path):
    """main: the eval and export notes printed the best metric's name raw."""
    folder = copy_run(run, tmp_path / "r")
    edit_json(folder / "best", "config.json", lambda c: c["train_state"].update(
        best={"metric": f"val_loss{OSC}\u202e", "value": 1.5, "step": 3}))
    r = run_main("eval", folder, "--what", "ppl", "--batches", "1")
    assert r.returncode == 0, r.stderr
    note = next(line for line in r.stderr.splitlines() if line.startswith("note: this is the run's last"))
    assert "\\x1b]0;owned\\x07" in note and "\\u202e" in note and not RAW.search(r.stdout + r.stderr)
    r = run_main("export", folder, "--to", "hf", "--out", tmp_path / "exported")
    assert r.returncode == 0, r.stderr
    assert "\\x1b]0;owned" in r.stderr and not RAW.search(r.stdout + r.stderr)


def test_generate_shows_a_crafted_tokenizers_text_escaped(run, tmp_path):
    """main: a char tokenizer of ESC, BEL and U+202E printed them raw."""
    folder = copy_run(run, tmp_path / "r")

    def crafted(c: dict) -> None:
        n = len(c["tokenizer"]["chars"])
        controls = [chr(i) for i in (*range(1, 9), *range(11, 32), *range(0x7f, 0xa0), *range(0x202a, 0x202f))]
        c["tokenizer"]["chars"] = "t" + "".join(controls[:n - 1])  # every other id decodes to a control character

    for ck in [folder / "ckpt", *folder.glob("ckpt-step-*")]:
        edit_json(ck, "config.json", crafted)
    r = run_main("generate", folder, "--prompt", "t", "--max-new-tokens", "40", "--seed", "0")
    assert r.returncode == 0, r.stderr
    assert not RAW.search(r.stdout.rstrip("\n")) and re.search(r"\\x1b|\\x07|\\u202e|\\u206[6-9]", r.stdout)


EVIL_NAME = "[x](javascript:alert(1))<img src=x onerror=alert(2)>`"


@pytest.mark.parametrize("to", ["hf", "vllm"])
def test_a_model_card_shows_the_source_as_text(run, tmp_path, to):
    """main: export wrote the source and step into README.md unescaped (<img onerror>, javascript: links)."""
    folder = copy_run(run, tmp_path / EVIL_NAME)
    r = run_main("export", folder, "--to", to, "--out", tmp_path / "exported")
    assert r.returncode == 0, r.stderr
    card = (tmp_path / "exported" / "README.md").read_text()
    source = next(line for line in card.splitlines() if "exported by `diffattn export" in line)
    assert f" from `` {folder} `` (step 4)" in source  # code: its own backticks cannot end the span
    rest = card.replace(f"`` {folder} ``", "")
    assert "<img" not in rest and "](javascript" not in rest
