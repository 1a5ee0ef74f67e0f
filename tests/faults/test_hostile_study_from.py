"""``study DATA --from SRC`` on a crafted source (issue 52): SRC is checked whole before the plan is written and any
cell starts, as every other reader checks a transformers folder: a config asking for too much memory or of the
wrong kind, a shard index naming a file outside SRC, a weight file linked out of it, an oversized or deeply nested
tokenizer.json. One line, exit 2, nothing written. (Before: the study started, every cell failed, and it ended
after 10 to 64 lines with exit 1, its folder written.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from clirun import run_main
from hostile import llama_folder, one_line_refusal
from test_hostile_tokenizers import bpe_json

pytestmark = pytest.mark.usefixtures("one_thread")

STUDY = ["--variants", "diff", "--steps", "2", "--seq-len", "8", "--batch-size", "2", "--threads", "1", "--seeds",
         "1", "--lrs", "0.003", "--lr-extensions", "0", "--progress-seconds", "600", "--probe-seconds", "0",
         "--poll-seconds", "0.5", "--no-progress", "--val-tokens", "64"]


def _source(tmp: Path, how: str) -> tuple[Path, str]:
    """A transformers Llama folder with a tokenizer, crafted as ``how``: (the folder, what the refusal says)."""
    config = {"layers-huge": {"num_hidden_layers": 10**9}, "heads-zero": {"num_attention_heads": 0},
              "heads-string": {"num_attention_heads": "2"}}.get(how, {})
    src = llama_folder(tmp / "src", **config)
    (src / "tokenizer.json").write_text(json.dumps(bpe_json(20)))
    if how == "index-parent":
        (src / "model.safetensors").rename(tmp / "w.safetensors")
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "../w.safetensors"}}))
        return src, "weight file '../w.safetensors' is not a plain file name inside the folder"
    if how == "weights-link-out":
        (src / "model.safetensors").rename(tmp / "w.safetensors")
        os.symlink(tmp / "w.safetensors", src / "model.safetensors")
        return src, "model.safetensors is a symbolic link out of its folder"
    if how == "tokenizer-huge":
        with open(src / "tokenizer.json", "r+b") as f:
            f.truncate((64 << 20) + 1)
        return src, "tokenizer.json is 67,108,865 bytes"
    if how == "tokenizer-deep":
        (src / "tokenizer.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return src, "tokenizer.json: the JSON nests more than 64 levels deep"
    return src, {"layers-huge": "1,000,000,000 layers", "heads-zero": "num_attention_heads must be a whole number",
                 "heads-string": "num_attention_heads must be a whole number >= 1, got '2'"}[how]


@pytest.mark.parametrize("how", ["layers-huge", "heads-zero", "heads-string", "index-parent", "weights-link-out",
                                 "tokenizer-huge", "tokenizer-deep"])
def test_a_crafted_source_is_refused_before_the_study_starts(tmp_path, how):
    src, said = _source(tmp_path, how)
    (tmp_path / "t.txt").write_text("t12 t3 t45 " * 400)
    out = tmp_path / "study"
    one_line_refusal(run_main("study", tmp_path / "t.txt", "--from", src, *STUDY, "--out", out), f"--from {src}",
                     said)
    assert not out.exists()
