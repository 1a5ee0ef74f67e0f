"""What diffattn writes for others to read (issue 32): names from files are shown as text, never as markup or
terminal control (the study's report.md and report.html, error lines); files and folders get the modes the
umask gives (0644 / 0755 under umask 022), not mkstemp's 0600 / mkdtemp's 0700; the model card records the
data file's name and sha256, not this machine's absolute path."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from clirun import run_main
from hostile import llama_folder, train_tiny

from diffattn.checkpoint.model_folders import load_pretrained, load_pretrained_tokenizer, training_info
from diffattn.experiments import document
from diffattn.system.atomic_files import printable

pytestmark = pytest.mark.usefixtures("one_thread")

EVIL = "<img src=x onerror=alert(2)>"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]
            if not p.is_symlink()}


def _shared(root: Path, skip: tuple[str, ...] = ()) -> None:
    """Every file 0644 and folder 0755 (umask 022)."""
    bad = {k: m for k, m in _modes(root).items() if not k.startswith(skip)
           and m != ("0o755" if (root / k).is_dir() else "0o644")}
    assert not bad, bad


def test_printable_escapes_every_control_character():
    assert printable("a\x1b[2Jb\nc\td\x7f\x9b\u202eé") == "a\\x1b[2Jb\\nc\\td\\x7f\\x9b\\u202eé"
    assert printable(printable("\x1b")) == "\\x1b"  # idempotent: escaped once, wherever it is printed


def test_a_data_file_named_as_html_lands_as_text_in_the_study_report(tmp_path, monkeypatch):
    """main wrote the name raw into report.md (report.html was escaped)."""
    import math

    from diffattn.experiments.experiment_folder import cell_name
    from diffattn.experiments.findings.report import write_report
    from diffattn.experiments.study.budget import make_plan
    from diffattn.experiments.study.collect import collect
    from diffattn.experiments.study.spec import StudySpec
    from diffattn.experiments.study.workers import worker_main

    corpus = tmp_path / f"{EVIL}`x`\x1b[2J.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)

    def run_cell(out, spec, arm, lr, seed, source, tokenizer, d_model=None, **show):  # trains nothing
        loss = 2.0 + 0.1 * math.log(lr / 1e-3) ** 2 + 0.01 * seed + (0.05 if arm.name == "diff" else 0)
        hist = [{"step": s, "tokens_seen": s * 32, "train_loss": loss + 1 / s, "val_loss": loss + 1 / s}
                for s in range(1, spec.train.steps + 1)]
        r = {"cell": cell_name(arm.name, lr, seed), "arm": arm.name, "attention": arm.attention,
             "n_heads": arm.n_heads, "d_model": spec.model.d_model, "lr": lr, "seed": seed, "steps": spec.train.steps,
             "step": spec.train.steps, "params": 100, "non_embedding_params": 80, "val_loss": loss, "diverged": None,
             "history": hist}
        f = out / "cells" / r["cell"] / "result.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(r))
        return r

    out = tmp_path / "study"
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[5e-4, 1e-3, 2e-3],
                               seeds=[0, 1],
                     seq_len=16, batch_size=2, steps=4, lr_extensions=0))
    spec, plan = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1,
                           command=f"diffattn study '{corpus}' --out {out}", probe_s=0)
    monkeypatch.setattr("diffattn.experiments.study.workers.run_cell", run_cell)
    assert worker_main(out, None, 1, poll_s=0.1)
    write_report(collect(out, spec, plan), out)
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    prose = md.split("```")[::2]  # inside a code block the name is literal text, shown as it is
    assert EVIL not in "".join(prose) and EVIL not in page and "\x1b" not in md + page
    assert f"```\ndiffattn study '{printable(corpus)}'" in md
    assert "# Does DIFF help on \\<img src\\=x onerror\\=alert\\(2\\)\\>\\`x\\`\\\\x1b\\[2J\\.txt?" in md
    assert "&lt;img src=x onerror=alert(2)&gt;`x`\\x1b[2J.txt" in page


def test_names_in_markdown_tables_lists_and_code():
    blocks = [("table", ["arm"], [[document.name("a|b*c")]]), ("list", [document.name("[x](javascript:y)")]),
              ("p", "run " + document.code("diffattn study 'a``b'"))]
    md = document.to_markdown(blocks)
    assert "| a\\|b\\*c |" in md and "- \\[x\\]\\(javascript\\:y\\)" in md
    assert "``` diffattn study 'a``b' ```" in md  # more backticks than the name holds: it cannot end the span


def test_checkpoints_models_and_conversions_are_written_for_others_to_read(tmp_path, umask_022):
    """main: ckpt/ and ckpt-step-N/ 0700, rng.safetensors 0600, save_pretrained's model.safetensors 0600."""
    run = train_tiny(tmp_path)
    assert (run / "ckpt-step-2").is_dir()
    _shared(run)
    pre = tmp_path / "pre"
    load_pretrained(run).save_pretrained(pre, tokenizer=load_pretrained_tokenizer(run))
    _shared(pre)
    assert run_main("convert", llama_folder(tmp_path / "llama"), "--to", "diff", "--out", tmp_path / "conv"
                    ).returncode == 0
    _shared(tmp_path / "conv")
    assert run_main("convert", llama_folder(tmp_path / "llama2"), "--to", "diff", "--out", tmp_path / "hub",
                    "--format", "hub").returncode == 0
    _shared(tmp_path / "hub")


def test_a_study_cell_is_written_for_others_to_read(tmp_path, umask_022):
    from diffattn.experiments.study.budget import make_plan
    from diffattn.experiments.study.cell import load_data, run_cell
    from diffattn.experiments.study.spec import StudySpec

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "study"
    spec = StudySpec.from_dict(dict(data=str(corpus), d_model=16, n_layers=1, heads=[2], lrs=[1e-3], seeds=[0],
                               seq_len=16,
                     batch_size=2, steps=2))
    spec, _ = make_plan(out, spec, budget_minutes=None, jobs=1, threads=1, command="diffattn x", probe_s=0)
    source, tok = load_data(out, spec)
    run_cell(out, spec, spec.arms()[0], 1e-3, 0, source, tok)
    _shared(out / "cells")


def test_the_model_card_names_the_data_not_this_machines_path(tmp_path):
    run = train_tiny(tmp_path)
    corpus = tmp_path / "corpus.txt"
    info = training_info(run)
    assert info["data"] == "corpus.txt" and info["checkpoint"] == "run/ckpt"
    assert info["data_sha256"] == {"corpus.txt": hashlib.sha256(corpus.read_bytes()).hexdigest()}
    load_pretrained(run).save_pretrained(tmp_path / "pre", training=info)
    card = (tmp_path / "pre" / "README.md").read_text()
    assert "- Data: `corpus.txt`" in card and str(tmp_path) not in card.split("## Loading")[0]
