"""`diffattn heads` reads a model as it is used (issue 32): the distances shown and the x-axis of the plot stop at
its context (a 128-token model was drawn to 256), each head's "short"/"long"/"neutral" is measured where its f
values are printed (w=+0.0007 was "long" and w=-0.0004 "neutral" from f at 256), and the plot is readable: the
legend beside the curves, a two-column grid of layers instead of one wide strip."""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from clirun import run_main

from diffattn.checkpoint.format import save_checkpoint
from diffattn.eval.heads import distances_for, format_table, head_table
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerLM


def _state(ws: list[float], vs: list[float]) -> dict:
    return {"body.blocks.0.attn.distance_w": torch.tensor(ws), "body.blocks.0.attn.distance_v": torch.tensor(vs)}


def test_labels_are_measured_at_the_context_and_say_so() -> None:
    assert distances_for(128) == [1, 4, 16, 64, 127] and distances_for(16) == [1, 4, 15]
    rows = head_table(_state([0.0007, -0.0004, -0.01, 0.02], [0.0] * 4), distances_for(128), context=128)
    assert [r["preference"] for r in rows] == ["neutral", "neutral", "short", "long"]
    assert all(r["at"] == 127 for r in rows)
    for r in rows:  # the label agrees with the f printed at the largest distance
        f = r["f"][127]
        assert r["preference"] == ("neutral" if abs(f - 1) <= 0.05 else "long" if f > 1 else "short")
    assert "prefers (|f-1| > 5% at R=127)" in format_table(rows)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_the_command_shows_and_plots_the_distances_the_model_sees(tmp_path: Path) -> None:
    tok = build_tokenizer("char", "abcdefgh ")
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=3, n_heads=4, max_seq_len=32,
                      attention="distance", rope="none")
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", TransformerLM(cfg), tokenizer=tok, train_state={"step": 1},
                    run_config={"task": "lm", "model": cfg.to_dict()})
    r = run_main("heads", tmp_path / "ckpt", "--plot", tmp_path / "heads.png")
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[1]
    assert "f(R=31)" in header and "f(R=64)" not in header and "at R=31" in header
    w, h = _png_size(tmp_path / "heads.png")
    assert w <= 1800 and h >= 600  # three layers: two columns, two rows; not a 2160 × 456 strip
