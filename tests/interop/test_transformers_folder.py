"""The transformers Llama folder a user converted from is read wherever a model folder is read (issue 32): through
load_pretrained (interop/hf.read_hf_folder), so `info`, `generate` and `eval` take it, and the source's
perplexity can be put beside the converted model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clirun import run_main

transformers = pytest.importorskip("transformers")

from diffattn import load_pretrained, load_pretrained_tokenizer  # noqa: E402
from diffattn.checkpoint.model_folders import is_pretrained_folder, transformers_folder  # noqa: E402
from diffattn.model.tokenizer import build_tokenizer  # noqa: E402

TEXT = "the old keeper climbed the stairs every evening to light the lamp for the ships at sea. " * 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, object]:
    """A tiny random LlamaForCausalLM (GQA, untied) saved by transformers, with a tokenizer.json beside it."""
    folder = tmp_path_factory.mktemp("models") / "llama"
    tok = build_tokenizer("bpe", TEXT, 300)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(folder)
    tok.tok.save(str(folder / "tokenizer.json"))
    (folder.parent / "text.txt").write_text(TEXT)
    return folder, hf


def test_load_pretrained_reads_a_transformers_llama_folder(llama, one_thread) -> None:
    folder, hf = llama
    assert transformers_folder(folder) and is_pretrained_folder(folder)
    model = load_pretrained(folder)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4
    assert load_pretrained_tokenizer(folder).encode(TEXT[:40]) == build_tokenizer("bpe", TEXT, 300).encode(TEXT[:40])


def test_info_generate_and_eval_read_it_beside_its_conversion(llama, one_thread) -> None:
    folder, _ = llama
    here = folder.parent
    r = run_main("convert", folder, "--to", "diff", "--out", here / "conv", cwd=here)
    assert r.returncode == 0, r.stderr
    r = run_main("info", folder)
    assert r.returncode == 0, r.stderr
    assert "attention = 'standard'" in r.stdout and "tokenizer: HFTokenizer" in r.stdout
    texts = [run_main("generate", m, "--prompt", "the old", "--max-new-tokens", "12", "--temperature", "0")
             for m in (folder, here / "conv")]
    assert all(t.returncode == 0 for t in texts), [t.stderr for t in texts]
    assert texts[0].stdout == texts[1].stdout  # the conversion computes the source's function
    losses = []
    for m in (folder, here / "conv"):
        r = run_main("eval", m, "--data", here / "text.txt", "--what", "ppl", "--seq-len", "32", "--json")
        assert r.returncode == 0, r.stderr
        ppl = json.loads(r.stdout)["ppl"]
        assert ppl["seq_len"] == 32 and ppl["tokens"] == 8 * 16 * 32
        losses.append(ppl["loss"])
    assert abs(losses[0] - losses[1]) < 1e-4


def test_a_transformers_folder_it_cannot_read_is_one_line(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    for cmd in (["info", tmp_path], ["eval", tmp_path, "--data", __file__], ["generate", tmp_path, "--prompt", "a"]):
        r = run_main(*cmd)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "a transformers folder diffattn cannot read" in r.stderr and "Traceback" not in r.stderr
