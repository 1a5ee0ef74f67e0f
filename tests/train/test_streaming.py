"""Checkpoints stream: the safetensors files are written and read one tensor at a time (and are ordinary
safetensors files), a save adds no copy of the model or optimizer state to memory, and a resume reads each
tensor straight into the live model and optimizer."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffattn.checkpoint.format import load_checkpoint, save_checkpoint
from diffattn.checkpoint.tensor_files import Reader, TensorFileError, write
from diffattn.configs.run_config import TrainConfig
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.optim import make_optimizer
from diffattn.train.run_state import named_optimizer_state, stream_optimizer_state, stream_weights

TENSORS = {"w": torch.randn(5, 3), "half": torch.randn(4).to(torch.bfloat16), "ids": torch.arange(7),
           "mask": torch.tensor([True, False, True]), "bytes": torch.arange(6, dtype=torch.uint8),
           "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6).t()}


def test_written_files_are_safetensors_files_and_read_back(tmp_path: Path):
    digest = write(tmp_path / "a.safetensors", list(TENSORS.items()), {"format": "pt"})
    import hashlib

    assert digest == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    theirs = load_file(tmp_path / "a.safetensors")
    assert set(theirs) == set(TENSORS)
    for k, v in TENSORS.items():
        assert theirs[k].dtype == v.dtype and torch.equal(theirs[k], v), k
    save_file({k: v.contiguous() for k, v in TENSORS.items()}, tmp_path / "b.safetensors")
    for name in ("a", "b"):
        with Reader(tmp_path / f"{name}.safetensors") as r:
            for k, v in TENSORS.items():
                assert torch.equal(r.read(k), v), (name, k)
            out = torch.empty(5, 3)
            assert r.read("w", out=out) is out and torch.equal(out, TENSORS["w"])
            with pytest.raises(ValueError, match="cannot read"):
                r.read("w", out=torch.empty(3, 5))


def test_a_damaged_file_is_a_clear_error(tmp_path: Path):
    f = tmp_path / "a.safetensors"
    write(f, [("w", torch.randn(64))])
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(TensorFileError, match=r"not a valid safetensors file \(.*not fully covered\)"):
        Reader(f)  # the safetensors library's rules (issue 39): its own message
    f.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(TensorFileError, match="header too large"):
        Reader(f)


def _trained(seed: int = 0, vocab: int = 64):
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_seq_len=16))
    opt = make_optimizer(model, TrainConfig(lr=1e-2))
    for _ in range(2):
        model(torch.randint(0, vocab, (2, 16))).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_streamed_resume_restores_weights_and_optimizer_exactly(tmp_path: Path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, run_config={"model": model.config.to_dict()},
                    optimizer=named_optimizer_state(model, opt))
    ck = load_checkpoint(tmp_path / "ck", stream=True)
    assert ck.streamed and not ck.state_dict and ck.optimizer_state is None
    fresh, fresh_opt = _trained(seed=1)
    stream_weights(fresh, ck)
    stream_optimizer_state(fresh, fresh_opt, ck)
    assert fresh.lm_head.weight is fresh.body.tok_emb.weight
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), fresh.parameters()):
        sa, sb = opt.state[p], fresh_opt.state[q]
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert fresh_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    # the checkpoint is also what a full (non-streamed) load reads: the same layout as before
    full = load_checkpoint(tmp_path / "ck")
    assert set(full.optimizer_state["state"]) == {n for n, _ in model.named_parameters()}


def test_a_streamed_resume_refuses_weights_of_another_model(tmp_path: Path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, run_config={"model": model.config.to_dict()},
                    optimizer=named_optimizer_state(model, opt))
    other, _ = _trained(vocab=65)
    with pytest.raises(ValueError, match=r"body.tok_emb.weight has shape \[64, 32\] in the checkpoint"):
        stream_weights(other, load_checkpoint(tmp_path / "ck", stream=True))


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _peak_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _rss_mb() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


@pytest.mark.skipif(not sys.platform.startswith("linux") or _glibc() is None, reason="Linux /proc and glibc")
def test_save_and_resume_hold_no_second_copy_of_the_state(tmp_path: Path):
    """~90 MB of weights and AdamW state: the peak resident memory of a save and of a streamed resume exceed
    what is resident before (the save) or after (the resume) by far less than one copy of the weights."""
    _glibc().mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed tensors go back to the OS, so RSS tracks live memory
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=4, max_seq_len=16)
    model = TransformerLM(cfg)
    opt = make_optimizer(model, TrainConfig())
    model(torch.randint(0, 4096, (1, 16))).logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    assert weights_mb > 20
    before = _rss_mb()
    _reset_peak()
    save_checkpoint(tmp_path / "ck", model, run_config={"model": cfg.to_dict()},
                    optimizer=named_optimizer_state(model, opt))
    save_extra = _peak_mb() - before
    del model, opt
    torch.manual_seed(1)
    fresh = TransformerLM(cfg)
    fresh_opt = make_optimizer(fresh, TrainConfig())
    ck = load_checkpoint(tmp_path / "ck", stream=True)
    _reset_peak()
    stream_weights(fresh, ck)
    stream_optimizer_state(fresh, fresh_opt, ck)
    load_extra = _peak_mb() - _rss_mb()
    assert save_extra < 0.25 * weights_mb, (save_extra, weights_mb)
    assert load_extra < 0.25 * weights_mb, (load_extra, weights_mb)
