"""V1's ``lambda_init``, ``subln`` and ``lambda_std`` are its typed options (``attn_options``, DiffOptions); a
config from before, which had them as top-level ModelConfig fields (a checkpoint's config.json, a TOML file,
``--model.subln``), still reads, as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffattn.checkpoint.format import load_checkpoint, save_checkpoint
from diffattn.configs.fields import ConfigError
from diffattn.configs.run_config import RunConfig, load_run_config
from diffattn.model.config import MOVED_TO_OPTIONS, ModelConfig, migrate_fields
from diffattn.model.transformer import TransformerLM

NEW = {"lambda_init": 0.3, "subln": False, "lambda_std": 0.05}


def _cfg(attention: str = "diff", **options) -> ModelConfig:
    return ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention=attention,
                       attn_options=options)


def _old_layout(cfg: ModelConfig) -> dict:
    """``cfg`` as the code before wrote it: every moved option a top-level field (its default when not set)."""
    d = cfg.to_dict()
    opts = dict(d.pop("attn_options"))
    d.update({k: opts.pop(k, default) for k, default in MOVED_TO_OPTIONS.items()})
    return {**d, "attn_options": opts}


def _built(cfg: ModelConfig) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("attention", ["diff", "grouped_diff", "diff_distance"])
def test_an_old_config_builds_the_same_model_bit_for_bit(attention):
    new = _cfg(attention, **NEW)
    old = _old_layout(new)
    assert old["subln"] is False and old["attn_options"] == {}  # really the old spelling
    again = ModelConfig.from_dict(old)
    assert again == new and again.options.subln is False and again.options.lambda_init == 0.3
    a, b = _built(new), _built(again)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any("subln" in k for k in sa)  # subln=False took effect: no per-head norm
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_an_old_config_at_the_defaults_sets_no_option():
    """An old config wrote every field: the ones at their defaults say nothing and leave attn_options empty."""
    old = _old_layout(_cfg())
    assert {k: old[k] for k in MOVED_TO_OPTIONS} == MOVED_TO_OPTIONS
    assert ModelConfig.from_dict(old) == _cfg() and ModelConfig.from_dict(old).attn_options == {}


def test_an_old_checkpoint_loads_as_the_same_model(tmp_path: Path):
    new = _cfg(**NEW)
    model = _built(new)
    save_checkpoint(tmp_path / "ckpt", model, run_config={"task": "lm", "model": _old_layout(new)})
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())["run_config"]["model"]
    assert written["subln"] is False and written["lambda_init"] == 0.3  # on disk: the old layout
    ck = load_checkpoint(tmp_path / "ckpt")
    assert ck.run_config.model == new
    back = ck.build_model().eval()
    ids = torch.randint(0, 40, (1, 10))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_the_new_spelling_round_trips_through_a_checkpoint(tmp_path: Path):
    new = _cfg(**NEW, qk_norm=True)
    model = _built(new)
    save_checkpoint(tmp_path / "ckpt", model, run_config=RunConfig.of_model(new))
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())["run_config"]["model"]
    assert written["attn_options"] == {**NEW, "qk_norm": True} and not set(MOVED_TO_OPTIONS) & set(written)
    ck = load_checkpoint(tmp_path / "ckpt")
    assert ck.run_config.model == new
    sd = ck.build_model().state_dict()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_old_toml_and_command_line_spellings_are_the_options(tmp_path: Path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nattention = 'diff'\nsubln = false\nlambda_init = 0.25\n")
    assert load_run_config(toml).model.attn_options == {"subln": False, "lambda_init": 0.25}
    cli = load_run_config(toml, ["--model.subln", "true", "--model.lambda_std", "0.2"])
    assert cli.model.attn_options == {"subln": True, "lambda_init": 0.25, "lambda_std": 0.2}  # the line wins
    with pytest.raises(ConfigError, match="lambda_init must be in"):
        load_run_config(toml, ["--model.lambda_init", "1.5"])


def test_an_old_field_and_its_option_that_disagree_are_refused():
    with pytest.raises(ValueError, match=r"subln=False .* attn_options.subln=True disagree"):
        migrate_fields({"subln": False, "attn_options": {"subln": True}})
    assert migrate_fields({"subln": False, "attn_options": {"subln": False}}) == {"attn_options": {"subln": False}}
    assert migrate_fields({"d_model": 8}) == {"d_model": 8}
