"""Transformers folders from elsewhere (issue 52): a family config.json whose fields are of the wrong kind or absurd
is refused in one line, exit 2, before any model is built or any weight file opened (a zero head count ended in a
ZeroDivisionError traceback, a head_dim of 0 was taken as "not given", tie_word_embeddings "yes" as true); a shard
index whose weight_map names a file outside the folder (``../``, an absolute path, a link out) is refused before
any weight file is opened, by every reader of such a folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hostile import llama_folder, one_line_refusal, run_entry

import diffattn.checkpoint.hf_folder as hf_folder
import diffattn.model.blocks as blocks

pytestmark = pytest.mark.usefixtures("one_thread")

POINTS = ["info", "convert", "generate", "eval"]  # every command that reads a transformers folder


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Every weight file opened and every block built: a refusal before either leaves this empty."""
    seen: list[str] = []
    real_reader, real_block = hf_folder.Reader, blocks.Block.__init__

    def reader(path, *a, **kw):
        seen.append(str(path))
        return real_reader(path, *a, **kw)

    def block(self, cfg, layer_idx):
        seen.append(f"block {layer_idx}")
        real_block(self, cfg, layer_idx)

    monkeypatch.setattr(hf_folder, "Reader", reader)
    monkeypatch.setattr(blocks.Block, "__init__", block)
    return seen


# ------------------------------------------------------------------------------------------ family config fields

FIELDS = {  # config.json override -> what the one line says
    "heads-zero": ({"num_attention_heads": 0}, "num_attention_heads must be a whole number >= 1, got 0"),
    "heads-negative": ({"num_attention_heads": -2}, "num_attention_heads must be a whole number >= 1, got -2"),
    "heads-string": ({"num_attention_heads": "2"}, "num_attention_heads must be a whole number >= 1, got '2'"),
    "hidden-string": ({"hidden_size": "32"}, "hidden_size must be a whole number >= 1, got '32'"),
    "hidden-nan": ({"hidden_size": float("nan")}, "hidden_size must be a whole number >= 1, got nan"),
    "layers-float": ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a whole number >= 1, got 1.5"),
    "layers-list": ({"num_hidden_layers": [1]}, "num_hidden_layers must be a whole number >= 1, got [1]"),
    "vocab-bool": ({"vocab_size": True}, "vocab_size must be a whole number >= 1, got True"),
    "kv-negative": ({"num_key_value_heads": -1}, "num_key_value_heads must be a whole number >= 1, got -1"),
    "head-dim-zero": ({"head_dim": 0}, "head_dim must be a whole number >= 1, got 0"),
    "ffn-null": ({"intermediate_size": None}, "lacks ['intermediate_size']"),
    "tie-string": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'"),
    "eps-string": ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite number, got 'x'"),
    "escape": ({"num_hidden_layers": "\x1b[2J\u202e"}, "got '\\x1b[2J\\u202e'"),
    # absurd sizes: the memory check refuses them, before the model is built
    "layers-huge": ({"num_hidden_layers": 10**9}, "1,000,000,000 layers"),
    "hidden-huge": ({"hidden_size": 10**9}, "d_model 1,000,000,000"),
    "ffn-huge": ({"intermediate_size": 10**12}, "needs"),
    "head-dim-huge": ({"head_dim": 10**9}, "needs"),
}


@pytest.mark.parametrize("case", sorted(FIELDS))
@pytest.mark.parametrize("point", POINTS)
def test_a_family_config_field_of_the_wrong_kind_is_refused_before_anything_is_built(tmp_path, opened, point, case):
    change, said = FIELDS[case]
    folder = llama_folder(tmp_path / "llama", **change)
    opened.clear()  # the folder's own model, built to write it
    one_line_refusal(run_entry(point, folder, tmp_path), said)
    assert len([o for o in opened if o.startswith("block")]) <= 1, opened  # the memory check counts one block
    assert not [o for o in opened if not o.startswith("block")], opened
    assert not (tmp_path / "converted").exists()


# ------------------------------------------------------------------------------------------ shard index files


def _sharded(tmp: Path, entry: str | None = None) -> Path:
    """A transformers folder whose weights lie in one shard named by ``model.safetensors.index.json``; ``entry``:
    the name the index gives instead (the shard moved to ``tmp/outside.safetensors``)."""
    folder = llama_folder(tmp / "llama")
    shard = "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(folder / shard)
    if entry is not None:
        (folder / shard).rename(tmp / "outside.safetensors")
    reader = hf_folder.Reader(tmp / "outside.safetensors" if entry else folder / shard)
    weights = dict.fromkeys(reader.entries, entry or shard)
    reader.close()
    (folder / hf_folder.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    return folder


def test_a_sharded_folder_within_itself_reads(tmp_path, opened):
    folder = _sharded(tmp_path)
    opened.clear()
    assert run_entry("info", folder, tmp_path).returncode == 0
    assert [Path(o).name for o in opened if not o.startswith("block")] == ["model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("how", ["parent", "absolute", "link-out", "index-link-out"])
@pytest.mark.parametrize("point", POINTS)
def test_a_shard_index_naming_a_file_outside_is_refused_before_anything_is_opened(tmp_path, opened, point, how):
    outside = tmp_path / "outside.safetensors"
    if how == "parent":
        folder = _sharded(tmp_path, "../outside.safetensors")
        said = "weight file '../outside.safetensors' is not a plain file name"
    elif how == "absolute":
        folder = _sharded(tmp_path, str(outside))
        said = f"weight file '{outside}' is not a plain file name"
    elif how == "link-out":  # a plain name, but a link to a file outside the folder
        folder = _sharded(tmp_path, "shard.safetensors")
        os.symlink(outside, folder / "shard.safetensors")
        said = "shard.safetensors is a symbolic link out of its folder"
    else:  # the index itself a link to one outside (that names the folder's own shard)
        folder = _sharded(tmp_path)
        (folder / hf_folder.INDEX).rename(tmp_path / "index.json")
        os.symlink(tmp_path / "index.json", folder / hf_folder.INDEX)
        said = "model.safetensors.index.json is a symbolic link out of its folder"
    opened.clear()
    one_line_refusal(run_entry(point, folder, tmp_path), said)
    assert not [o for o in opened if not o.startswith("block")], opened
    assert not (tmp_path / "converted").exists()
