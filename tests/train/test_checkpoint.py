"""Checkpoints: round trip (tied and untied weights, optimizer, RNG), corruption detection, atomic replacement
under a simulated crash, and the ``info`` command."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

import diffattn.checkpoint.format as C
import diffattn.cli.info as info_cli
from diffattn.checkpoint.format import CheckpointError, load_checkpoint, save_checkpoint
from diffattn.model.config import ModelConfig
from diffattn.model.parts import param_counts
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerClassifier, TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="diff")
    base.update(kw)
    return ModelConfig(**base)


def _trained(cfg: ModelConfig) -> tuple[TransformerLM, torch.optim.AdamW]:
    model = TransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randint(0, cfg.vocab_size, (2, 8))).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(path: Path, model: TransformerLM, opt=None, step: int = 7) -> None:
    save_checkpoint(path, model, run_config={"task": "lm", "model": model.config.to_dict()},
                    tokenizer=build_tokenizer("char", "abc"), optimizer=opt,
                    train_state={"step": step, "tokens_seen": 123},
                    rng={"data": torch.Generator().get_state()})


@pytest.mark.parametrize("tie", [True, False])
def test_round_trip(tmp_path: Path, tie: bool) -> None:
    model, opt = _trained(_cfg(tie_embeddings=tie))
    _save(tmp_path / "ck", model, opt)
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.train_state == {"step": 7, "tokens_seen": 123}
    assert ck.tokenizer.decode(ck.tokenizer.encode("cab")) == "cab"
    assert ck.model_config == model.config
    assert bool(ck.tied) == tie  # the tied lm_head is stored once and re-created on load
    rebuilt = ck.build_model()
    if tie:
        assert rebuilt.lm_head.weight is rebuilt.body.tok_emb.weight
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    x = torch.randint(0, 40, (2, 8))
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)
    # optimizer state: the saved one loads into a fresh optimizer and equals the original exactly
    opt2 = torch.optim.AdamW(rebuilt.parameters(), lr=1e-2)
    opt2.load_state_dict(ck.optimizer_state)
    for s1, s2 in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1[k], s2[k])
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert torch.equal(ck.rng["data"], torch.Generator().get_state())


def test_classifier_checkpoint(tmp_path: Path) -> None:
    cfg = _cfg(causal=False)
    model = TransformerClassifier(cfg, num_classes=3, pooling="first")
    run_config = {"task": "classify", "model": model.config.to_dict(), "classify": {"num_classes": 3,
                                                                                      "pooling": "first"}}
    save_checkpoint(tmp_path / "ck", model, run_config=run_config)
    rebuilt = load_checkpoint(tmp_path / "ck").build_model()
    assert isinstance(rebuilt, TransformerClassifier) and rebuilt.pooling == "first"
    x = torch.randint(0, 40, (2, 8))
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-5])


def _delete(p: Path) -> None:
    p.unlink()


FILES = ["model.safetensors", "optimizer.safetensors", "optimizer.json", "config.json", "rng.safetensors"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("damage", [_flip, _truncate, _delete])
def test_corruption_is_detected_and_named(tmp_path: Path, name: str, damage) -> None:
    model, opt = _trained(_cfg())
    _save(tmp_path / "ck", model, opt)
    damage(tmp_path / "ck" / name)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path / "ck")


def test_missing_or_broken_manifest(tmp_path: Path) -> None:
    model, _ = _trained(_cfg())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    _save(tmp_path / "ck", model)
    (tmp_path / "ck" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_checkpoint(tmp_path / "ck")
    assert issubclass(CheckpointError, ValueError)


def test_crash_during_replace_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model, opt = _trained(_cfg())
    path = tmp_path / "ck"
    _save(path, model, opt, step=1)
    real_replace = os.replace

    def failing_replace(src, dst):  # the final rename of the new checkpoint into place fails
        if ".tmp-" in str(src):
            raise OSError("simulated crash while renaming")
        return real_replace(src, dst)

    monkeypatch.setattr(C.os, "replace", failing_replace)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(OSError, match="simulated crash"):
        _save(path, model, opt, step=2)
    monkeypatch.setattr(C.os, "replace", real_replace)
    ck = load_checkpoint(path)  # the old checkpoint is back in place, intact
    assert ck.train_state["step"] == 1
    assert not torch.equal(ck.state_dict["body.tok_emb.weight"], model.body.tok_emb.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or aside dirs left over


def test_crash_while_writing_files_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model, opt = _trained(_cfg())
    path = tmp_path / "ck"
    _save(path, model, opt, step=1)
    real_write = C.write_tensors
    calls = []

    def dying_write(filename, *args, **kw):  # dies after the weights file is written
        calls.append(filename)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_write(filename, *args, **kw)

    monkeypatch.setattr(C, "write_tensors", dying_write)
    with pytest.raises(KeyboardInterrupt):
        _save(path, model, opt, step=2)
    assert load_checkpoint(path).train_state["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_crash_between_renames_falls_back_to_moved_aside_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A process killed after moving the old checkpoint aside but before renaming the new one in: the old one
    is complete and is what load_checkpoint returns."""
    model, opt = _trained(_cfg())
    path = tmp_path / "ck"
    _save(path, model, opt, step=1)
    real_replace = os.replace
    n = []

    def die_after_first(src, dst):
        n.append(src)
        if len(n) >= 2:
            raise SystemExit("killed")  # both the rename-in and the restore die: the process is gone
        return real_replace(src, dst)

    monkeypatch.setattr(C.os, "replace", die_after_first)
    with pytest.raises(SystemExit):
        _save(path, model, opt, step=2)
    monkeypatch.setattr(C.os, "replace", real_replace)
    assert not path.exists()
    with pytest.warns(UserWarning, match="previous checkpoint"):
        ck = load_checkpoint(path)
    assert ck.train_state["step"] == 1


def test_rng_must_be_uint8_and_config_must_build(tmp_path: Path) -> None:
    model, _ = _trained(_cfg())
    with pytest.raises(ValueError, match="uint8"):
        save_checkpoint(tmp_path / "a", model, run_config={}, rng={"x": torch.zeros(3)})
    bad = model.config.to_dict() | {"n_heads": 3}
    with pytest.raises(ValueError, match="n_heads"):
        save_checkpoint(tmp_path / "b", model, run_config={"model": bad})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_info_counts_and_prints(tmp_path: Path, capsys) -> None:
    cfg = _cfg()
    model, opt = _trained(cfg)
    _save(tmp_path / "ckpt", model, opt)
    ck = load_checkpoint(tmp_path / "ckpt")
    counts = param_counts(ck.state_dict, ck.tied)
    assert counts["total"] == model.num_params()  # the tied head counted once
    head_dim = cfg.d_model // cfg.n_heads // 2
    assert counts["lambda"] == 4 * head_dim * cfg.n_layers
    assert counts["embeddings"] == cfg.vocab_size * cfg.d_model and counts["lm_head"] == 0
    assert counts["norms"] == cfg.d_model * (2 * cfg.n_layers + 1) + 2 * head_dim * cfg.n_layers
    p = argparse.ArgumentParser()
    info_cli.add_arguments(p)
    assert info_cli.run(p.parse_args([str(tmp_path)])) == 0  # a run dir with ckpt/ inside works too
    out = capsys.readouterr().out
    assert "lambda" in out and f"{model.num_params():,}" in out and "tokens_seen = 123" in out
    assert info_cli.run(p.parse_args([str(tmp_path / "ckpt"), "--json"])) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"]["total"] == model.num_params() and info["train_state"]["step"] == 7
    _flip(tmp_path / "ckpt" / "model.safetensors")
    assert info_cli.run(p.parse_args([str(tmp_path / "ckpt")])) == 2
    assert "model.safetensors" in capsys.readouterr().err
