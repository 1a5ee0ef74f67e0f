"""Folders a hostile or careless user hands diffattn (issue 32): a tiny trained run to copy and edit, a tiny
transformers Llama folder written by hand (no transformers import), and the checks every refusal must pass."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from clirun import run_main
from faultinject import tiny_run
from safetensors.torch import save_file

from diffattn.checkpoint.format import MANIFEST
from diffattn.checkpoint.model_folders import load_pretrained
from diffattn.interop.hf import _export_state_dict
from diffattn.model.config import ModelConfig
from diffattn.model.pretrained import PretrainedError
from diffattn.model.transformer import TransformerLM


def train_tiny(tmp: Path) -> Path:
    """A finished 4-step run (d_model 16, one layer) in ``tmp/run``."""
    cfg, corpus = tiny_run(tmp)
    out = tmp / "run"
    r = run_main("train", "--config", cfg, "--data.path", corpus, "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(ckpt: Path, change: Any) -> None:
    m = json.loads((ckpt / MANIFEST).read_text())
    change(m["files"])
    (ckpt / MANIFEST).write_text(json.dumps(m))


def resign(ckpt: Path, name: str) -> None:
    """Record the file ``name`` as it is now in the checkpoint's manifest (as a crafted folder would)."""
    edit_manifest(ckpt, lambda f: f[name].update(sha256=sha256(ckpt / name), bytes=(ckpt / name).stat().st_size))


def edit_json(ckpt: Path, name: str, change: Any) -> None:
    """``change(obj)`` on the checkpoint's JSON file ``name``, then re-signed: only what the change asks is wrong."""
    obj = json.loads((ckpt / name).read_text())
    change(obj)
    (ckpt / name).write_text(json.dumps(obj))
    resign(ckpt, name)


def set_config(ckpt: Path, **model: Any) -> None:
    """Change the checkpoint's model config and re-sign config.json in the manifest (as a crafted folder
    would): only what the config asks for is wrong."""
    edit_json(ckpt, "config.json", lambda cfg: cfg["run_config"]["model"].update(model))


def llama_folder(folder: Path, **config: Any) -> Path:
    """A transformers Llama folder (config.json + model.safetensors) written without transformers: a standard
    model's weights under Llama's names, and the config keys diffattn reads (``config`` overrides them)."""
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, attention="standard", rope="neox",
                      max_seq_len=32)
    model = TransformerLM(cfg)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in _export_state_dict(model).items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 40, "hidden_size": 32, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
        "tie_word_embeddings": True, "rms_norm_eps": cfg.norm_eps, **config}))
    return folder


def as_hub_cache(folder: Path, cache: Path, subdir: str = "") -> Path:
    """``folder`` laid out as huggingface_hub caches a download: ``models--o--m/blobs/<sha256>`` holding each
    file once, and ``snapshots/<rev>/[subdir/]<name>`` a relative link to its blob. -> the snapshot folder."""
    repo = cache / "models--someone--tiny"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / ("0" * 40)
    target = snap / subdir if subdir else snap
    target.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = repo / "blobs" / sha256(f)
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, target), target / f.name)
    return snap


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): what it is, its size and its bytes' sha256."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = ("file", sha256(p))
        else:
            out[rel] = ("dir",)
    return out


def one_line_refusal(r: Any, *needles: str) -> str:
    """The refusal's stderr line (exit 2, one line, no traceback, no raw control character), checked to name
    each of ``needles``."""
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, r.stderr
    assert not any(ord(c) < 32 for c in err), err
    for n in needles:
        assert n in err, (n, err)
    return err


ENTRY_POINTS = ("info", "eval", "generate", "resume", "load_pretrained", "export", "convert")


def run_entry(point: str, folder: Path, tmp: Path) -> Any:
    """One of :data:`ENTRY_POINTS`, every reader of a model folder, on ``folder``; -> returncode and stderr
    (``load_pretrained``: 2 and its error when it raises PretrainedError)."""
    if point == "load_pretrained":
        class Ran:
            returncode, stderr = 0, ""
        try:
            load_pretrained(folder)
        except PretrainedError as e:
            Ran.returncode, Ran.stderr = 2, f"error: {e}"
        return Ran
    return run_main(*{
        "info": ["info", folder], "eval": ["eval", folder, "--what", "ppl", "--batches", "1"],
        "generate": ["generate", folder, "--prompt", "the", "--max-new-tokens", "2"],
        "resume": ["train", "--out", folder, "--resume", "--no-progress"],
        "export": ["export", folder, "--to", "hf", "--out", tmp / "exported"],
        "convert": ["convert", folder, "--to", "diff", "--out", tmp / "converted"]}[point])
