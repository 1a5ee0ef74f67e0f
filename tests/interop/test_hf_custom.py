"""`diffattn export RUN --to hf` for every model diffattn makes (issue 51, item 1): the native classes where
transformers has one (standard, V1), a custom-code folder for the rest (every other type in the registry, mixed
layers, head-selected retrofits) that ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``
loads offline, without diffattn, with the same fp32 logits (<= 1e-5) and greedy tokens as diffattn's own
``generate``, its KV cache mapped onto transformers' ``generate``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffattn import ModelConfig, TransformerLM
from diffattn.attention.registry import ATTENTION
from diffattn.checkpoint.format import save_checkpoint
from diffattn.cli.main import main
from diffattn.interop.hf_export import export_hf, native_problems
from diffattn.interop.hf_snapshot import rewrite
from diffattn.model.generate import generate, generate_batch
from diffattn.model.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5
NATIVE = {"standard": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}
SELECTING = sorted(t for t, cls in ATTENTION.items() if cls.selects_heads)


def _model(seed: int = 0, **kw) -> TransformerLM:
    """A tiny model whose random weights are large enough (init_std) that greedy decoding varies its tokens."""
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, init_std=0.3)
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()


def _load(folder: Path):
    with _quiet():
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, local_files_only=True, dtype=torch.float32).eval()


class _quiet:
    def __enter__(self):
        self.was = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()

    def __exit__(self, *exc):
        if self.was:
            transformers.utils.logging.enable_progress_bar()


def _same_as_diffattn(model: TransformerLM, hf) -> float:
    """Max |Δ| of fp32 logits on random ids; asserts greedy generate gives diffattn's tokens (its own cache)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=g)
    with torch.no_grad():
        err = (model(ids) - hf(ids).logits).abs().max().item()
    prompt = ids[:1, :6]
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    ours = generate(model, prompt[0].tolist(), 12, temperature=0)
    assert theirs == ours, (theirs, ours)
    assert len(set(ours)) > 1  # a test that could not tell a wrong cache position apart would prove nothing
    return err


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_every_type_loads_offline_and_computes_what_diffattn_computes(tmp_path, monkeypatch, attention):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _model(attention=attention, rope="neox" if attention == "standard" else "interleaved")
    export_hf(model, None, tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = _load(tmp_path / "hf")
    native = NATIVE.get(attention)
    assert type(hf).__name__ == (native or "DiffattnForCausalLM")
    assert ("auto_map" in raw) == (native is None)  # the native classes need no remote code
    err = _same_as_diffattn(model, hf)
    print(f"{attention}: {type(hf).__name__} max |Δlogits| {err:.3g}")
    assert err <= TOL


@pytest.mark.parametrize("attention", SELECTING)
def test_a_mixed_head_selected_retrofit_loads_and_computes_what_diffattn_computes(tmp_path, attention):
    model = _model(n_layers=3, n_heads=4, head_dim=8, layer_attention=[attention, "standard", attention],
                   diff_heads=[[0, 2], [], [3]])
    assert native_problems(model)
    export_hf(model, None, tmp_path / "hf")
    hf = _load(tmp_path / "hf")
    assert type(hf).__name__ == "DiffattnForCausalLM"
    err = _same_as_diffattn(model, hf)
    print(f"mixed {attention}/standard, heads [[0, 2], [], [3]]: max |Δlogits| {err:.3g}")
    assert err <= TOL


def test_left_padded_batch_generates_what_each_prompt_generates_alone(tmp_path):
    model = _model(attention="diff_v2")
    export_hf(model, None, tmp_path / "hf")
    hf = _load(tmp_path / "hf")
    prompts = [[5, 9, 13, 2, 7, 30], [11, 3, 8]]
    ids = torch.tensor([prompts[0], [0, 0, 0, *prompts[1]]])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 6:]
    assert out.tolist() == generate_batch(model, prompts, 8, temperature=0)
    assert out[1].tolist() == generate(model, prompts[1], 8, temperature=0)


def test_the_folder_needs_no_diffattn(tmp_path):
    """Loaded and run in a process where `import diffattn` fails: the code travels with the weights."""
    model = _model(n_layers=3, n_heads=4, head_dim=8, layer_attention=["diff_v2", "standard", "diff_v2"],
                   diff_heads=[[0, 2], [], [3]])
    export_hf(model, None, tmp_path / "hf")
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.save(model(ids).detach(), tmp_path / "want.pt")  # our own tensors, read back by this test only
    torch.save(ids, tmp_path / "ids.pt")
    script = f"""
import sys, importlib.abc
class NoDiffattn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "diffattn" or name.startswith("diffattn."):
            raise ImportError("diffattn is not installed here")
sys.meta_path.insert(0, NoDiffattn())
import torch, transformers
hf = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, trust_remote_code=True)
ids, want = torch.load({str(tmp_path / 'ids.pt')!r}), torch.load({str(tmp_path / 'want.pt')!r})
with torch.no_grad():
    err = (hf(ids).logits - want).abs().max().item()
assert "diffattn" not in sys.modules
print(type(hf).__name__, err)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    name, err = res.stdout.split()[-2:]
    assert name == "DiffattnForCausalLM" and float(err) <= TOL


def test_the_snapshot_is_diffattn_own_code_with_relative_imports(tmp_path):
    model = _model(attention="dint")
    export_hf(model, None, tmp_path / "hf")
    files = {p.name: p.read_text() for p in (tmp_path / "hf").glob("*.py")}
    assert {"modeling_diffattn.py", "configuration_diffattn.py", "diffattn_attention_dint.py"} <= set(files)
    assert not any(n.startswith("diffattn_attention_") and n[19:-3] in ("sink", "fox", "alibi") for n in files)
    for name, text in files.items():  # no absolute import of diffattn is left, at any depth
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("diffattn"), (name, node.module)
    import diffattn.attention.dint as dint  # the same code: our file, its imports rewritten and nothing else

    assert files["diffattn_attention_dint.py"] == rewrite(Path(dint.__file__).read_text())
    assert "from .diffattn_attention_dint import DINTAttention  # registers 'dint'" in files["modeling_diffattn.py"]


def test_cli_exports_and_checks_a_custom_code_folder_with_its_tokenizer(tmp_path, capsys):
    text = "ROMEO: But soft, what light through yonder window breaks?\n" * 4
    tok = build_tokenizer("char", text)
    model = _model(vocab_size=tok.vocab_size, attention="fox")
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt", model, tokenizer=tok, train_state={"step": 3},
                    run_config={"task": "lm", "model": model.config.to_dict()})
    assert main(["export", str(run), "--to", "hf", "--out", str(tmp_path / "hf"), "--check"]) == 0
    out, err = capsys.readouterr()
    assert "fox -> DiffattnForCausalLM (custom code: load it with trust_remote_code=True)" in err
    assert "max |Δlogits| vs the run" in out and "same ids" in out
    assert "trust_remote_code=True" in (tmp_path / "hf" / "README.md").read_text()
    # a standard export over it with --overwrite leaves none of the custom code behind
    std = _model(vocab_size=tok.vocab_size, attention="standard")
    save_checkpoint(tmp_path / "std" / "ckpt", std, tokenizer=tok, train_state={"step": 3},
                    run_config={"task": "lm", "model": std.config.to_dict()})
    assert main(["export", str(tmp_path / "std"), "--to", "hf", "--out", str(tmp_path / "hf"), "--overwrite"]) == 0
    assert not list((tmp_path / "hf").glob("*.py"))


@pytest.mark.parametrize("attention", ["fox", "dint"])  # caches with a buffer of their own besides K and V
def test_beam_search_on_our_cache_is_beam_search_without_it(tmp_path, attention):
    model = _model(attention=attention)
    export_hf(model, None, tmp_path / "hf")
    hf = _load(tmp_path / "hf")
    ids = torch.tensor([[44, 29, 39, 14, 56]])  # beams swap rows here: a cache left unordered gives other beams
    kw = dict(max_new_tokens=10, do_sample=False, num_beams=4, num_return_sequences=4, pad_token_id=0)
    cached = hf.generate(ids, **kw)
    assert torch.equal(cached, hf.generate(ids, use_cache=False, **kw))
    assert len({tuple(r) for r in cached.tolist()}) == 4
