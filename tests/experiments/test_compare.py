"""`diffattn compare`: the report end to end on --quick, and clear non-zero exits on bad arguments."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from diffattn.cli import compare
from diffattn.experiments.needle.defaults import BITS
from diffattn.model.config import matched_baseline

PNGS = ("loss_curves.png", "needle_heatmaps.png", "multi_needle.png", "attention_maps.png", "outliers.png",
        "quantization.png", "diagnostics.png")


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diffattn compare")
    compare.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    out = tmp / "report"
    rc = compare.run(_args(["--quick", "--no-progress", "--out", str(out)]))
    return rc, out


def test_quick_report_files(quick_report):
    rc, out = quick_report
    assert rc == 0
    for name in ("report.md", "report.html", "config.json", "command.txt", "results.json", *PNGS):
        assert (out / name).is_file(), name
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(PNGS)  # self-contained
    assert "src='loss_curves.png'" not in html
    md = (out / "report.md").read_text()
    assert all(f"]({name})" in md for name in PNGS)
    assert "DIFF" in md and "Transformer" in md and "QUICK" in md
    # the smoke-run caveat comes before any count or verdict, in the report and in the summary alone
    for text in (md.split("## Summary", 1)[1].split("\n", 1)[1], (out / "summary.md").read_text()):
        first = next(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))
        assert first.startswith("**Smoke run (--quick): not evidence"), first


def test_quick_report_contents(quick_report):
    _, out = quick_report
    res = json.loads((out / "results.json").read_text())
    models = res["models"]
    assert [m["attention"] for m in models] == ["diff", "standard"]
    p_diff, p_base = models[0]["params"], models[1]["params"]
    assert abs(p_diff - p_base) / p_base < 0.01  # the baseline is parameter-matched
    for m in models:
        assert all(0.0 <= g["acc"] <= 1.0 for g in m["needle"]["grid"])
        assert [r["bits"] for r in m["quant"]] == [None, *BITS]
        assert m["outliers"]["attn_logits"]["top1"] >= m["outliers"]["attn_logits"]["median"]
        assert len(m["history"]) >= 1 and m["train_time_s"] > 0
        assert m["diagnostics"] and "layer0.entropy1" in m["diagnostics"][-1]  # plotted from diagnostics.csv
    assert "layer0.lambda" in models[0]["diagnostics"][-1]
    cfg = json.loads((out / "config.json").read_text())
    cmd = (out / "command.txt").read_text().strip()
    assert cmd == cfg["command"] and "--quick" in cmd and "--seed 0" in cmd
    # The recorded command parses back to the same settings.
    again = compare.resolve(_args(cmd.split()[2:]))
    assert {k: again.record()[k] for k in ("steps", "seq_len", "d_model", "seed")} == {
        k: res["settings"][k] for k in ("steps", "seq_len", "d_model", "seed")
    }


def test_unknown_variant_exits_nonzero(tmp_path, capsys):
    rc = compare.run(_args(["--quick", "--variants", "diff_v2,not_a_kind", "--out", str(tmp_path / "r")]))
    assert rc == 2
    err = capsys.readouterr().err
    assert "not_a_kind" in err and "registered" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "ten"], ["--steps", "-3"]])
def test_bad_steps_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        _args(["--quick", *bad])
    assert e.value.code == 2
    assert "--steps must be a positive integer" in capsys.readouterr().err


def test_missing_data_file(tmp_path, capsys):
    from diffattn.cli.main import main

    rc = main(["study", str(tmp_path / "missing.txt"), "--quick", "--out", str(tmp_path / "r")])
    assert rc == 2
    assert "missing.txt" in capsys.readouterr().err


def test_a_previous_report_is_never_overwritten_silently(quick_report, tmp_path, capsys):
    _, out = quick_report
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # the same command again: finished, nothing to do, its report named, exit 0, as compare --data says of a
    # finished experiment (it said "already holds a run ... add --overwrite" and exit 2: issue 25, item 7)
    assert compare.run(_args(["--quick", "--no-progress", "--out", str(out)])) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{out}: this comparison is finished; nothing to do. Its report: {out / 'report.md'} (to run it again from "
        "scratch, add --overwrite)"]
    # other settings: refused, as before
    assert compare.run(_args(["--quick", "--steps", "5", "--no-progress", "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err and "--resume" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    mine = tmp_path / "r"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")  # unrelated files neither block a run nor get removed
    (mine / "report.md").write_text("an old report")
    assert compare.run(_args(["--quick", "--no-progress", "--out", str(mine)])) == 2
    assert compare.run(_args(["--quick", "--no-progress", "--out", str(mine), "--overwrite"])) == 0
    assert (mine / "keep.txt").read_text() == "mine" and (mine / "report.md").read_text() != "an old report"


def test_model_configs_with_variants():
    s = compare.resolve(_args(["--quick", "--variants", "diff_v2"]))
    cfgs = s.model_configs()
    assert [c.attention for c in cfgs] == ["diff", "standard", "diff_v2"]
    assert cfgs[1] == matched_baseline(cfgs[0])
    assert cfgs[2].n_heads == cfgs[1].n_heads  # V2 keeps the baseline's head width


def test_eval_cli_on_compare_checkpoints(quick_report, tmp_path, capsys):
    """`diffattn eval` reads the checkpoints compare wrote (needle task metrics; text cells: test_study)."""
    from diffattn.cli import eval as evaluate

    _, out = quick_report
    p = argparse.ArgumentParser()
    evaluate.add_arguments(p)
    res_file = tmp_path / "eval.json"
    argv = [
        str(out / "runs" / "diff" / "ckpt"),
        "--what",
        "needle,noise,quant",
        "--samples",
        "2",
        "--bits",
        "8,4",
        "--out",
        str(res_file),
    ]
    assert evaluate.run(p.parse_args(argv)) == 0
    res = json.loads(res_file.read_text())
    assert set(res) == {"needle", "noise", "quant", "quant_multi_setting"}
    assert [r["bits"] for r in res["quant"]] == [None, 8, 4]
    capsys.readouterr()
    missing = str(tmp_path / "no.txt")
    assert evaluate.run(p.parse_args([str(out / "runs" / "diff" / "ckpt"), "--data", missing])) == 2
    assert "no.txt" in capsys.readouterr().err


def test_the_verdict_is_printed_and_a_missing_tracker_said_once_last(tmp_path, monkeypatch, capsys):
    """Issue 52: compare printed only the report's path (the verdict was in report.md alone) and its first line was
    a TensorBoard note. Now: the verdict lines, as summary.md has them, then the report; the note once, last."""
    from diffattn.experiments.needle.claims import check_claims
    from diffattn.train import runlog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as when tensorboard is not installed
    monkeypatch.setattr(runlog, "_tb_notice_shown", False)
    out = tmp_path / "r"
    assert compare.run(_args(["--quick", "--steps", "2", "--samples", "2", "--no-progress", "--out", str(out)])) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    claims = check_claims(json.loads((out / "results.json").read_text()))
    reproduced = sum(c.reproduced for c in claims)
    head = next(i for i, ln in enumerate(lines) if ln.startswith("verdict: "))
    assert lines[head].startswith(f"verdict: {reproduced} of the {len(claims)} paper claims checked here reproduced")
    assert lines[head - 1].startswith("smoke run (--quick): not evidence")
    shown = lines[head + 1:head + 1 + len(claims)]
    assert sorted(ln.split(": ", 1)[0].strip() for ln in shown) == sorted(c.verdict for c in claims)
    for c in claims:  # each claim's line, with its numbers as summary.md gives them
        assert any(c.claim in ln and c.fmt(c.diff, c.diff_se) in ln for ln in shown), c.claim
    assert lines[-1].startswith(f"report: {out / 'report.md'}")
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert sum("TensorBoard" in ln for ln in err) == 1, captured.err
    assert err[-1].startswith("note: TensorBoard logging is off (no run folder's tb/)"), captured.err
    assert not list(out.glob("runs/*/tb"))
