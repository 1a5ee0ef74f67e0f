"""Retrofit options from the command line (issue 52): each absurd or wrong-typed ``--retrofit.*`` value is one line,
exit 2, before any model is built or any batch drawn, and names what it asks; a list of 10⁵ layer indices is shown
cut, not printed whole (it was: a 600 kB line), and ``score_batches`` 10⁹ is refused (it drew the batches for ever)."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirun import run_main
from faultinject import tiny_run

import diffattn.train.retrofit as retrofit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a standard model's run folder, the config, the corpus): one layer of 2 heads."""
    tmp = tmp_path_factory.mktemp("retrofit")
    cfg, corpus = tiny_run(tmp)
    src = tmp / "src"
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", src, "--model.attention", "standard",
                 "--model.n_heads", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    retro = tmp / "retro.toml"  # no [model]: --init-from gives it
    retro.write_text(cfg.read_text()[cfg.read_text().index("[train]"):])
    return src, retro, corpus


CASES = {
    "steps-negative": (["--retrofit.steps", "-1"], "steps must be a whole number >= 0, got -1"),
    "steps-string": (["--retrofit.steps", "abc"], "--retrofit.steps: expected an int, got 'abc'"),
    "steps-huge": (["--retrofit.steps", str(10**12)], "the schedule (1000000000000 steps) is longer than the run"),
    "layer-missing": (["--retrofit.layers", "[99]"], "layers [99] do not exist: the model has 1 layers"),
    "layer-negative": (["--retrofit.layers", "[-1]"], "layers must list distinct 0-based layer indices, got [-1]"),
    "layers-many": (["--retrofit.layers", "[" + ",".join(map(str, range(1, 100_001))) + "]"],
                    "... (100,000 items) do not exist"),
    "layers-string": (["--retrofit.layers", "'0'"], "--retrofit.layers: expected a list"),
    "head-missing": (["--retrofit.heads", "0.9"], "heads ['0.9'] do not exist: the model has 1 layers of 2 heads"),
    "head-layer-missing": (["--retrofit.heads", "9.0"], "heads ['9.0'] do not exist"),
    "heads-junk": (["--retrofit.heads", "x\x1b[2J"], "heads must be LAYER.HEAD pairs of 0-based indices"),
    "top-k-heads-huge": (["--retrofit.top_k_heads", str(10**9)], "top_k_heads 1000000000 is more than the model's 2"),
    "top-k-layers-huge": (["--retrofit.top_k_layers", str(10**9)], "top_k_layers 1000000000 is more than the model"),
    "score-batches-huge": (["--retrofit.top_k_layers", "1", "--retrofit.score_batches", str(10**9)],
                           "score_batches must be a whole number from 1 to 1,024, got 1000000000"),
    "lambda-nan": (["--retrofit.lambda_init", "nan"], "lambda_init (the target λ_init) must be in [0, 1), got nan"),
    "target-escape": (["--retrofit.to", "\x1b[2Jx"], "--retrofit.to must be one of"),
    "shape": (["--retrofit.shape", "[1]"], "shape must be linear or cosine"),
    "onto-itself": (["--retrofit.to", "standard"], "a retrofit converts a standard model to another type"),
}


@pytest.fixture
def drawn(monkeypatch) -> list[int]:
    """The batches a retrofit draws to score or calibrate: a refusal drew none."""
    seen: list[int] = []
    real = retrofit._batches
    monkeypatch.setattr(retrofit, "_batches", lambda source, n, seed: seen.append(n) or real(source, n, seed))
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_retrofit_option_of_the_wrong_kind_is_one_line_before_anything_is_built(source, tmp_path, drawn, case):
    src, cfg, corpus = source
    extra, said = CASES[case]
    out = tmp_path / "out"
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", out, "--init-from", src,
                 "--retrofit.to", "diff", "--retrofit.steps", "2", "--no-progress", *extra)
    err = r.stderr.strip()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(err.splitlines()) == 1 and len(err) < 400 and not any(ord(c) < 32 for c in err), err
    assert said in err, (said, err)
    assert drawn == [] and not (out / "ckpt").exists() and not (out / "resolved.toml").exists()
