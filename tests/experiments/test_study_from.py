"""`diffattn study DATA --from SRC` (issue 41): the retrofit study on a tiny random Llama and Qwen2 saved by
transformers with a tokenizer.json. Every cell starts from SRC (the standard arm SRC itself, every other arm its
exact conversion: the first step's loss is SRC's on the same batch, for every arm), the report carries the
retrofit verdict, a second run reuses everything, and bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from hfsave import nudged, save_hf

transformers = pytest.importorskip("transformers")

from diffattn.cli import study  # noqa: E402
from diffattn.experiments.study.cell import load_data  # noqa: E402
from diffattn.experiments.study.source import source_model  # noqa: E402
from diffattn.experiments.study.spec import read_spec  # noqa: E402
from diffattn.model.tokenizer import build_tokenizer  # noqa: E402
from diffattn.train.loss import cross_entropy  # noqa: E402
from diffattn.train.runlog import read_metrics  # noqa: E402

TEXT = "the old keeper climbed the stairs every evening to light the lamp for the ships at sea. " * 40
TINY = ["--steps", "3", "--seq-len", "16", "--batch-size", "2", "--lrs", "1e-3", "--lr-extensions", "0",
        "--threads", "1", "--probe-seconds", "0", "--progress-seconds", "600", "--poll-seconds", "0.2",
        "--val-tokens", "256", "--no-progress"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def _save(folder: Path, cfg, tok) -> Path:
    torch.manual_seed(0)
    return save_hf(nudged(transformers.AutoModelForCausalLM.from_config(cfg).eval(), 0.1), folder, tok)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("from")
    tok = build_tokenizer("bpe", TEXT, 300)
    shape = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    (root / "text.txt").write_text(TEXT)
    return {"text": root / "text.txt",
            "llama": _save(root / "llama", transformers.LlamaConfig(**shape, tie_word_embeddings=False), tok),
            # 6 heads over 2 KV heads: grouped_diff's 3:1 recipe needs 3 to divide them
            "qwen2": _save(root / "qwen2", transformers.Qwen2Config(**{**shape, "hidden_size": 48,
                                                                        "num_attention_heads": 6},
                                                                     tie_word_embeddings=True), tok)}


def _starts(out: Path) -> list[str]:
    return [ln.split()[3] for ln in (out / "events.log").read_text().splitlines() if ln.split()[2] == "start"]


@pytest.fixture(scope="module")
def llama_study(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "out"
    argv = [sources["text"], "--from", sources["llama"], "--variants", "diff,diff_v2", "--seeds", "2", *TINY,
            "--out", out]
    n = torch.get_num_threads()
    try:
        rc1 = study.run(_args(argv))
        starts1 = _starts(out)
        measures1 = {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()}
        rc2 = study.run(_args(argv))  # resumed: a finished study is reused whole
    finally:
        torch.set_num_threads(n)
    return out, rc1, rc2, starts1, measures1


def test_every_arm_starts_from_the_source(llama_study, sources) -> None:
    out, rc1, *_ = llama_study
    assert rc1 == 0
    spec, _ = read_spec(out)
    assert [a.name for a in spec.arms()] == ["standard", "diff", "diff_v2"]
    assert spec.model.d_model == 32 and spec.model.n_layers == 2  # the shape is SRC's, not the study's default
    source, _ = load_data(out, spec)
    src = source_model(str(sources["llama"]))
    for seed in (0, 1):
        first = {}
        for arm in ("standard", "diff", "diff_v2"):
            cell = out / "cells" / f"{arm}-lr0.001-s{seed}"
            run = json.loads((cell / "cell.json").read_text())
            assert run["model"]["attention"] == ("standard" if arm == "standard" else arm)
            first[arm] = read_metrics(cell / "metrics.csv")[0]
            assert first[arm]["step"] == 1
        # the loop's first batch (its generator seeded with the cell's seed) scored by SRC itself
        gen = torch.Generator().manual_seed(seed)
        x, y = source.get_batch("train", 2, gen)
        with torch.no_grad():
            ref = float(cross_entropy(src(x), y)) / y.numel()
        for arm, row in first.items():
            assert row["train_loss"] == pytest.approx(ref, abs=2e-5), arm


def test_report_has_the_retrofit_verdict(llama_study) -> None:
    out, *_ = llama_study
    res = json.loads((out / "results.json").read_text())
    r = res["retrofit"]
    assert {x["arm"] for x in r["step0"]["arms"]} == {"standard", "diff", "diff_v2"}
    assert all(x["abs_diff"] < 1e-4 for x in r["step0"]["arms"])
    assert [v["arm"] for v in r["verdicts"]] == ["diff", "diff_v2"]
    assert all(v["word"].split()[0] in ("better", "equal", "worse") for v in r["verdicts"])
    rows = r["measures"]["rows"]
    assert [x["model"] for x in rows] == ["SRC (before training)"] + [a for a in ("standard", "diff", "diff_v2")
                                                                      for _ in (0, 1)]
    assert all(x["attn_logits"]["top1"] > 0 and len(x["quant"]) == 3 for x in rows)
    md = (out / "report.md").read_text()
    assert "## The retrofit verdict" in md and "after retrofitting" in md and "Not measured:" in md
    assert md.startswith("# Does retrofitting llama help on")


def test_a_second_run_reuses_every_cell_and_measure(llama_study) -> None:
    out, _, rc2, starts1, measures1 = llama_study
    assert rc2 == 0
    assert _starts(out) == starts1  # no cell started again
    assert {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()} == measures1


def test_qwen2_source_with_gated_and_grouped_diff(sources, tmp_path, one_thread) -> None:
    out = tmp_path / "q"
    rc = study.run(_args([sources["text"], "--from", sources["qwen2"], "--variants", "gated,grouped_diff",
                          "--seeds", "1", *TINY, "--out", out]))
    assert rc == 0
    r = json.loads((out / "results.json").read_text())["retrofit"]
    assert [x["arm"] for x in r["step0"]["arms"]] == ["standard", "gated", "grouped_diff"]
    assert all(x["abs_diff"] < 1e-4 for x in r["step0"]["arms"])


def _bad_family(f: Path) -> None:
    f.mkdir()
    (f / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))


def _not_causal(f: Path) -> None:
    f.mkdir()
    (f / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForSequenceClass"
                                                                                        "ification"]}))


@pytest.mark.parametrize("make,extra,needle", [
    (None, [], "not found"),
    (_bad_family, [], "gpt_neox"),
    (_not_causal, [], "causal LM"),
    ("llama", ["--variants", "standard"], "names only standard"),
    ("llama", ["--d-model", "64"], "--d-model 64 (SRC has 32)"),
    ("llama", ["--n-layers", "2", "--n-heads", "8"], "--n-heads 8 (SRC has 4)"),
    ("llama", ["--tokenizer", "bpe"], "--tokenizer does not apply"),
    ("llama", ["--variants", "diff+nosubln"], "variant options"),
    ("llama", ["--variants", "nosuchtype"], "unknown attention variant"),
    ("llama", ["--seq-len", "128"], "exceeds SRC's context"),
    ("llama", ["--retrofit-steps", "10"], "must fit in the cells' 3 steps"),
])
def test_bad_input_is_one_line_and_writes_nothing(sources, tmp_path, capsys, make, extra, needle) -> None:
    src = tmp_path / "src"
    if isinstance(make, str):
        src = sources[make]
    elif make is not None:
        make(src)
    out = tmp_path / "out"
    argv = [sources["text"], "--from", src, *TINY, "--out", out, *extra]
    rc = study.run(_args(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_retrofit_schedule_anneals_and_resumes(sources, tmp_path, one_thread) -> None:
    """--retrofit-steps: each converted arm is a `train --retrofit.*` run from SRC itself (the model converted in
    memory, its schedule factor climbing to 1 in diagnostics.csv), step 0 still SRC's loss; a cell whose result
    was lost is read back from its checkpoint (the retrofitted model it recorded) with the same loss."""
    out = tmp_path / "r"
    argv = [sources["text"], "--from", sources["llama"], "--variants", "diff,diff_v2", "--seeds", "1",
            "--retrofit-steps", "2", *TINY, "--out", out]
    assert study.run(_args(argv)) == 0
    res = json.loads((out / "results.json").read_text())["retrofit"]
    assert res["retrofit_steps"] == 2 and all(x["abs_diff"] < 1e-4 for x in res["step0"]["arms"])
    for arm in ("diff", "diff_v2"):
        cell = out / "cells" / f"{arm}-lr0.001-s0"
        run = json.loads((cell / "cell.json").read_text())
        assert run["model"]["attention"] == "standard" and run["retrofit"]["to"] == arm
        assert json.loads((cell / "ckpt" / "config.json").read_text())["run_config"]["model"]["attention"] == arm
        s = [float(r["retrofit_s"]) for r in read_metrics(cell / "diagnostics.csv")]
        assert s == [0.5, 1.0, 1.0]
    cell = out / "cells" / "diff-lr0.001-s0"
    before = json.loads((cell / "result.json").read_text())["val_loss"]
    (cell / "result.json").unlink()
    assert study.run(_args(argv)) == 0
    assert json.loads((cell / "result.json").read_text())["val_loss"] == pytest.approx(before, abs=1e-6)
    assert "over 2 steps" in (out / "report.md").read_text()
