"""`diffattn export RUN --to hf --out DIR` (issue 23, item 1): a folder transformers loads offline, without
trust_remote_code, as LlamaForCausalLM / DiffLlamaForCausalLM with the run's tokenizer (char, BPE or HF
tokenizer.json), with the same fp32 logits (<= 1e-4) and the same token ids; what no class of transformers
expresses goes to a custom-code folder (tests/interop/test_hf_custom.py); what cannot travel is refused in one
line before anything is written; --out follows the common output guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffattn import ModelConfig, TransformerClassifier, TransformerLM
from diffattn.attention.registry import register, unregister
from diffattn.attention.standard import StandardAttention
from diffattn.checkpoint.format import save_checkpoint
from diffattn.cli.main import main
from diffattn.model.tokenizer import CharTokenizer, HFTokenizer, build_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me! Two  spaces, and new lines.\n" * 8
SAMPLES = ["ROMEO: But soft", "  two  spaces \n\nand new lines", "yonder?!", "a"]


def _model(cfg: ModelConfig, seed: int = 0) -> TransformerLM:
    """A model whose norm gains and λ vectors are pushed away from their init, so a wrong mapping shows."""
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "subln.weight")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif "lambda_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _run(tmp_path: Path, tok, name: str = "run", **model_kw) -> tuple[Path, TransformerLM]:
    """A run folder as `diffattn train` leaves it (ckpt/, metrics.csv)."""
    kw = dict(vocab_size=tok.vocab_size if tok is not None else 40, d_model=32, n_layers=3, n_heads=2,
              max_seq_len=64, attention="diff")
    cfg = ModelConfig(**{**kw, **model_kw})
    model = _model(cfg)
    run = tmp_path / name
    save_checkpoint(run / "ckpt", model, tokenizer=tok, train_state={"step": 7},
                    run_config={"task": "lm", "model": cfg.to_dict()})
    (run / "metrics.csv").write_text("step,train_loss\n7,3.0\n")
    return run, model


def _hf_tokenizer_json(tmp_path: Path) -> HFTokenizer:
    """An HF tokenizer.json with a post-processor that adds a BOS token, as a converted Llama's has."""
    from tokenizers import processors  # only this test builds one

    bpe = build_tokenizer("bpe", TEXT, vocab_size=300).tok
    bpe.add_special_tokens(["<s>"])
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    return HFTokenizer.from_file(path)


def _tokenizer(kind: str, tmp_path: Path):
    if kind == "char":
        return build_tokenizer("char", TEXT)
    if kind == "char_unk":
        return build_tokenizer("char", TEXT, unk=True)
    if kind == "bpe":
        return build_tokenizer("bpe", TEXT, vocab_size=300)
    return _hf_tokenizer_json(tmp_path)


@pytest.mark.parametrize("attention,kind,extra", [
    ("diff", "char", {}),
    ("standard", "char", {"n_heads": 4}),
    ("diff", "bpe", {"rope": "neox", "n_kv_heads": 1, "tie_embeddings": False}),
    ("standard", "hf", {"n_heads": 4, "n_kv_heads": 2}),
    ("diff", "char_unk", {"shared_qk": True}),
])
def test_export_loads_offline_with_the_same_logits_and_ids(tmp_path, monkeypatch, attention, kind, extra):
    tok = _tokenizer(kind, tmp_path)
    run, model = _run(tmp_path, tok, attention=attention, **extra)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "the staging folder was left behind"

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # no trust_remote_code
    assert type(hf).__name__ == ("DiffLlamaForCausalLM" if attention == "diff" else "LlamaForCausalLM")
    ids = torch.randint(0, model.config.vocab_size, (2, 50))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4

    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in SAMPLES + ["é ünseen ✓"] * (kind in ("bpe", "hf", "char_unk")):
        ours = tok.encode(text)
        assert auto(text)["input_ids"] == ours, text
        assert auto.decode(ours) == tok.decode(ours)
    if kind == "hf":  # the post-processor's BOS travels, named (lm-eval's hf model conditions on it: issue 51)
        assert auto("ab")["input_ids"][0] == tok.tok.token_to_id("<s>") == auto.bos_token_id
    else:
        assert auto.bos_token_id is None and auto.eos_token_id is None
    if kind == "char":  # an unseen character is an error on both sides, never a silent id
        with pytest.raises(ValueError):
            tok.encode("✓")
        with pytest.raises(Exception, match="UNK|unk|Missing"):
            auto("✓")


def test_export_check_reports_parity_and_a_save_pretrained_folder_exports(tmp_path, capsys):
    tok = build_tokenizer("char", TEXT)
    model = _model(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_seq_len=32))
    model.save_pretrained(tmp_path / "pre", tokenizer=tok)
    assert main(["export", str(tmp_path / "pre"), "--to", "hf", "--out", str(tmp_path / "hf"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "max |Δlogits| vs the run:" in out and "same ids" in out
    err = float(out.split("run: ")[1].split()[0])
    assert err <= 1e-4


def test_generation_and_tokenizer_configs_name_no_made_up_tokens(tmp_path):
    run, _ = _run(tmp_path, build_tokenizer("char", TEXT))
    assert main(["export", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert gen.get("eos_token_id") is None and cfg["eos_token_id"] is None and cfg["bos_token_id"] is None
    assert cfg["rope_theta"] == 10000.0  # for transformers 4.x, beside rope_parameters
    tcfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tcfg["clean_up_tokenization_spaces"] is False
    assert "bos_token" not in tcfg and "eos_token" not in tcfg


def test_no_line_break_is_made_a_bos_because_decoding_would_drop_it(tmp_path):
    """Issue 51: the line break (what ``--model diffattn`` conditions a text's first token on) is not named BOS or
    EOS in the export, because transformers makes every named token special and a ``skip_special_tokens=True``
    decode drops it. The first half is the premise (if a transformers release stops dropping it, the decision can
    be revisited); the second, that the export's tokenizer keeps every line break."""
    tok = build_tokenizer("char", TEXT)
    text = "ROMEO: But soft\nJULIET: O Romeo\n"
    named = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.to_tokenizers(), bos_token="\n")
    named.save_pretrained(tmp_path / "named")
    named = transformers.AutoTokenizer.from_pretrained(tmp_path / "named")
    assert named.decode(named(text)["input_ids"], skip_special_tokens=True) == text.replace("\n", "")
    run, _ = _run(tmp_path, tok)
    assert main(["export", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize("kw,reasons", [
    ({"attention": "diff_v2"}, ["attention 'diff_v2' has no transformers counterpart"]),
    ({"attention": "distance", "rope": "none"}, ["attention 'distance' has no transformers counterpart",
                                                 "rope='none'"]),
    ({"attention": "diff", "attn_options": {"subln": False, "lambda_init": 0.0}}, ["subln=False", "lambda_init=0.0"]),
])
def test_what_no_transformers_class_expresses_goes_to_a_custom_code_folder(tmp_path, capsys, kw, reasons):
    run, model = _run(tmp_path, build_tokenizer("char", TEXT), **kw)
    from diffattn.interop.hf_export import native_problems

    for reason in reasons:  # why no native class: the custom-code folder's reasons
        assert reason in " ".join(native_problems(model))
    out = tmp_path / "new" / "hf"
    assert main(["export", str(run), "--to", "hf", "--out", str(out), "--check"]) == 0
    assert "-> DiffattnForCausalLM (custom code: load it with trust_remote_code=True)" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DiffattnForCausalLM"]


def test_an_attention_type_registered_outside_diffattn_is_refused(tmp_path, capsys):
    @register("i23_throwaway", label="Throwaway")
    class Throwaway(StandardAttention):  # a test's class: no file of diffattn the folder could carry
        pass

    try:
        run, _ = _run(tmp_path, build_tokenizer("char", TEXT), attention="i23_throwaway", n_heads=4)
        assert main(["export", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "attention 'i23_throwaway' is registered from" in err and "outside the diffattn package" in err
        assert err.count("\n") == 1 and not (tmp_path / "hf").exists()
    finally:
        unregister("i23_throwaway")  # also from the backends' list, or later tests see it


def test_a_classifier_is_refused(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=30, d_model=32, n_layers=1, n_heads=2, attention="standard", max_seq_len=16)
    TransformerClassifier(cfg, num_classes=3).save_pretrained(tmp_path / "cls", tokenizer=CharTokenizer(list("ab")))
    assert main(["export", str(tmp_path / "cls"), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "only language models (TransformerLM)" in capsys.readouterr().err


def test_out_follows_the_output_guard(tmp_path, capsys):
    run, _ = _run(tmp_path, build_tokenizer("char", TEXT))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--to", "hf", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["export", str(run), "--to", "hf", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
    # the run folder, or a folder inside it, is never an output
    assert main(["export", str(run), "--to", "hf", "--out", str(run / "hf"), "--overwrite"]) == 2
    assert "inside the source" in capsys.readouterr().err and not (run / "hf").exists()
    # a run with no tokenizer exports the model alone, and says so
    bare, _ = _run(tmp_path, None, name="bare")
    assert main(["export", str(bare), "--to", "hf", "--out", str(tmp_path / "bare-hf")]) == 0
    assert "has no tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "bare-hf" / "tokenizer.json").exists()
