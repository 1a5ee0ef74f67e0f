"""Every command reads a family's folder and its conversion (issue 40): a tiny random Qwen2 (q/k/v biases, GQA,
tied, a window on its last layer) saved by transformers with a tokenizer.json goes through ``convert --to standard
--check`` (against transformers' own model), ``info``, ``generate``, ``eval``, ``train --init-from`` and ``export
--to hf`` (its own class back); bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from clirun import run_main
from hfsave import nudged, save_hf

transformers = pytest.importorskip("transformers")

from diffattn.checkpoint.model_folders import load_pretrained  # noqa: E402
from diffattn.model.tokenizer import build_tokenizer  # noqa: E402

TEXT = "the old keeper climbed the stairs every evening to light the lamp for the ships at sea. " * 30


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("families_cli") / "qwen"
    tok = build_tokenizer("bpe", TEXT, 300)
    cfg = transformers.Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=True, use_sliding_window=True,
                                   sliding_window=6, max_window_layers=1)
    torch.manual_seed(0)
    save_hf(nudged(transformers.Qwen2ForCausalLM(cfg).eval(), 0.1), folder, tok)
    (folder.parent / "text.txt").write_text(TEXT)
    return folder


def test_every_command_reads_the_family_and_its_conversion(qwen, one_thread) -> None:
    here = qwen.parent
    r = run_main("convert", qwen, "--to", "standard", "--out", here / "std", "--check", cwd=here)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "vs transformers (Qwen2ForCausalLM, fp32):" in x)
    assert float(line.rsplit(":", 1)[1]) < 1e-4
    r = run_main("info", here / "std")
    assert r.returncode == 0 and "family = 'qwen2'" in r.stdout and "window_layers = [1]" in r.stdout, r.stderr
    texts = []
    for m in (qwen, here / "std"):
        r = run_main("generate", m, "--prompt", "the old", "--max-new-tokens", "10", "--temperature", "0")
        assert r.returncode == 0, r.stderr
        texts.append(r.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("the old")
    r = run_main("eval", qwen, "--data", here / "text.txt", "--what", "ppl", "--batches", "1", "--batch-size", "2",
                 "--seq-len", "32")
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr
    r = run_main("train", "--init-from", qwen, "--data.path", here / "text.txt", "--out", here / "ft",
                 "--train.steps", "2", "--train.batch_size", "2", "--train.seq_len", "16", "--train.eval_every", "2",
                 "--no-progress", cwd=here)
    assert r.returncode == 0, r.stderr
    r = run_main("export", here / "ft", "--to", "hf", "--out", here / "hf", "--check")
    assert r.returncode == 0 and "(Qwen2ForCausalLM, fp32)" in r.stdout, r.stderr
    assert float(r.stdout.split("max |Δlogits| vs the run:")[1].split()[0]) < 1e-4
    assert json.loads((here / "hf" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def _broken(qwen: Path, name: str, edit) -> Path:
    folder = qwen.parent / name
    shutil.copytree(qwen, folder)
    edit(folder)
    return folder


def _set(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


@pytest.mark.parametrize("name, edit, said", [
    ("contradicts", _set(model_type="llama"), "self_attn.k_proj.bias (and 5 more), which the config's model"),
    ("wider", _set(hidden_size=48), "has shape"),
    ("window0", _set(sliding_window=0), "sliding_window must be a positive whole number, got 0"),
    ("window_huge", _set(sliding_window=10**12), "sliding_window must be a whole number of tokens from 1"),
    ("theta", _set(rope_parameters={"rope_type": "default", "rope_theta": -5.0}), "rope_theta=-5.0 must be"),
    ("scalar", _set(model_type="gemma3_text", query_pre_attn_scalar=-4), "query_pre_attn_scalar"),
    ("yarn", _set(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_type='yarn'"),
    ("family", _set(model_type="gpt2"), "cannot read a transformers config of model_type 'gpt2'"),
    ("no_tokenizer", lambda f: ((f / "tokenizer.json").rename(f / "tokenizer.json.bak"),
                                (f / "tokenizer_config.json").write_text("{}")), "but no tokenizer.json"),
])
def test_bad_input_is_one_line_and_nothing_is_written(qwen, name, edit, said) -> None:
    folder = _broken(qwen, name, edit)
    for to in ("standard", "diff"):
        out = qwen.parent / f"out-{name}-{to}"
        r = run_main("convert", folder, "--to", to, "--out", out)
        assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, (to, r.stderr)
        assert not out.exists()


@pytest.mark.parametrize("to", ["diff", "diff_v2", "gated"])
def test_every_command_reads_a_differential_conversion_of_the_family(qwen, to, one_thread) -> None:
    """convert --check (the source and transformers), info, generate (the source's text), eval, load_pretrained,
    train --init-from; export --to hf writes it as custom code (no transformers class has it) that reads back
    the same (--check)."""
    here = qwen.parent
    out = here / f"conv-{to}"
    r = run_main("convert", qwen, "--to", to, "--out", out, "--check", cwd=here)
    assert r.returncode == 0, r.stderr
    errs = [float(x.rsplit(":", 1)[1]) for x in r.stdout.splitlines() if "max |Δlogits| vs" in x]
    assert len(errs) == 2 and max(errs) < 1e-4, r.stdout
    r = run_main("info", out)
    assert r.returncode == 0 and f"attention = {to!r}" in r.stdout and "qkv_bias = True" in r.stdout, r.stdout
    texts = []
    for m in (qwen, out):
        r = run_main("generate", m, "--prompt", "the old", "--max-new-tokens", "10", "--temperature", "0")
        assert r.returncode == 0, r.stderr
        texts.append(r.stdout)
    assert texts[0] == texts[1]
    r = run_main("eval", out, "--data", here / "text.txt", "--what", "ppl", "--batches", "1", "--batch-size", "2",
                 "--seq-len", "32")
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr
    model, src = load_pretrained(out), load_pretrained(qwen)
    ids = torch.randint(0, src.config.vocab_size, (1, 20))
    with torch.no_grad():
        assert (model(ids) - src(ids)).abs().max() < 1e-4
    assert model.config.attention == to and model.config.window_layers == [1]
    r = run_main("train", "--init-from", out, "--data.path", here / "text.txt", "--out", here / f"ft-{to}",
                 "--train.steps", "2", "--train.batch_size", "2", "--train.seq_len", "16", "--train.eval_every", "2",
                 "--no-progress", cwd=here)
    assert r.returncode == 0, r.stderr
    tuned = load_pretrained(here / f"ft-{to}")
    assert tuned.config.attention == to and tuned.config.qkv_bias is True
    r = run_main("export", here / f"ft-{to}", "--to", "hf", "--out", here / f"hf-{to}", "--check")
    assert r.returncode == 0 and f"{to} -> DiffattnForCausalLM (custom code" in r.stderr, r.stderr
    assert "(DiffattnForCausalLM, fp32)" in r.stdout and "same ids" in r.stdout, r.stdout


def test_a_conversion_that_cannot_be_exact_is_one_line(qwen) -> None:
    """GDA on 4 heads over 2 KV heads: its noise heads (one per 3) cannot be formed; nothing is written."""
    out = qwen.parent / "gda"
    r = run_main("convert", qwen, "--to", "grouped_diff", "--out", out)
    assert r.returncode == 2 and "--to grouped_diff turns the 4 source heads into signal heads" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not out.exists()


def test_vllm_export_of_a_family_model_reads_back_exactly(qwen) -> None:
    """Biases, a window: the vLLM folder holds them (served by the recipes; tests/serve runs vLLM on them)."""
    out = qwen.parent / "vllm"
    r = run_main("export", qwen, "--to", "vllm", "--out", out, "--check")
    assert r.returncode == 0 and "max |Δlogits| vs the run" in r.stdout, r.stderr
    cfg = json.loads((out / "config.json").read_text())["config"]
    assert cfg["family"] == "qwen2" and cfg["qkv_bias"] is True and cfg["sliding_window"] is not None
