"""save_pretrained / load_pretrained: safetensors + config.json (+ tokenizer) folders, local and strict."""

import hashlib
import json
import re
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

import diffattn
from diffattn import ModelConfig, TransformerClassifier, TransformerEncoder, TransformerLM, load_pretrained
from diffattn.attention.registry import ATTENTION
from diffattn.checkpoint.format import load_checkpoint
from diffattn.checkpoint.model_folders import load_pretrained_tokenizer, training_info
from diffattn.cli.train import main as train_main
from diffattn.model.pretrained import PretrainedError
from diffattn.model.tokenizer import CharTokenizer
from diffattn.train.runlog import read_metrics


def cfg(**kw):
    return ModelConfig(**{**dict(vocab_size=30, d_model=32, n_layers=2, n_heads=2, max_seq_len=16), **kw})


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or call the Hub client fails the test."""

    def refuse(*a, **k):
        raise AssertionError("network access attempted")

    import huggingface_hub.hub_mixin as hm

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(hm, "hf_hub_download", refuse)


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_lm_round_trip(attention, tmp_path, no_network):
    torch.manual_seed(0)
    m = TransformerLM(cfg(attention=attention)).eval()
    m.save_pretrained(tmp_path)
    back = load_pretrained(tmp_path)
    assert type(back) is TransformerLM and back.config == m.config and not back.training
    ids = torch.randint(0, 30, (2, 9))
    assert torch.equal(back(ids), m(ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("kw", [dict(shared_qk=True), dict(tie_embeddings=False, bias=True, n_kv_heads=1)])
def test_lm_round_trip_options(kw, tmp_path, no_network):
    torch.manual_seed(1)
    m = TransformerLM(cfg(**kw)).eval()
    m.save_pretrained(tmp_path / "m")
    back = TransformerLM.from_pretrained(tmp_path / "m")
    ids = torch.randint(0, 30, (1, 7))
    assert torch.equal(back(ids), m(ids))
    stored = load_file(tmp_path / "m" / "model.safetensors")
    # tied weights are stored once; the file holds exactly the model's distinct tensors
    assert sum(t.numel() for t in stored.values()) == m.num_params()


def test_classifier_and_encoder_round_trip(tmp_path, no_network):
    torch.manual_seed(2)
    c = TransformerClassifier(cfg(attention="distance", rope="none"), num_classes=3, pooling="first").eval()
    c.save_pretrained(tmp_path / "c")
    back = load_pretrained(tmp_path / "c")
    assert type(back) is TransformerClassifier and back.pooling == "first" and back.head.out_features == 3
    ids, pad = torch.randint(0, 30, (2, 6)), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]).bool()
    assert torch.equal(back(ids, pad), c(ids, pad))
    e = TransformerEncoder(cfg()).eval()
    e.save_pretrained(tmp_path / "e")
    assert torch.equal(load_pretrained(tmp_path / "e")(ids), e(ids))


def test_config_json_and_tokenizer(tmp_path, no_network):
    m = TransformerLM(cfg(vocab_size=5))
    tok = CharTokenizer(list("abcde"))
    m.save_pretrained(tmp_path, tokenizer=tok)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["diffattn_class"] == "TransformerLM" and ModelConfig.from_dict(conf["config"]) == m.config
    back = load_pretrained_tokenizer(tmp_path)
    assert isinstance(back, CharTokenizer) and back.encode("bead") == tok.encode("bead")
    assert "diffattn" in (tmp_path / "README.md").read_text()  # our model card
    # saving again without a tokenizer drops the old one; a user's README stays
    (tmp_path / "README.md").write_text("mine")
    m.save_pretrained(tmp_path)
    assert load_pretrained_tokenizer(tmp_path) is None
    assert (tmp_path / "README.md").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_local_only_and_clear_errors(tmp_path, no_network):
    with pytest.raises(PretrainedError, match=r"not a model folder \(it does not exist: diffattn reads local folders "
                                              "only"):
        load_pretrained(tmp_path / "missing")  # not sent to the Hub as a repo id
    with pytest.raises(PretrainedError, match="is not a folder"):
        TransformerLM.from_pretrained("someone/some-model")
    with pytest.raises(PretrainedError, match="not a model folder .*a model folder holds"):
        load_pretrained(tmp_path)
    TransformerClassifier(cfg(), num_classes=2).save_pretrained(tmp_path / "c")
    with pytest.raises(PretrainedError, match="holds a TransformerClassifier"):
        TransformerLM.from_pretrained(tmp_path / "c")
    with pytest.raises(TypeError, match="local folders only"):
        TransformerLM.from_pretrained(tmp_path / "c", revision="main")


def test_strict_weights(tmp_path, no_network):
    m = TransformerLM(cfg())
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    extra = {**sd, "stray.weight": torch.zeros(2)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(PretrainedError, match="stray.weight"):  # one line, as every folder error (issue 32)
        load_pretrained(tmp_path)
    del sd["body.norm.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(PretrainedError, match="body.norm.weight"):
        load_pretrained(tmp_path)


def test_bad_config_json(tmp_path):
    TransformerLM(cfg()).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["config"]["n_layerz"] = 3
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="unknown field"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PretrainedError, match="not valid JSON"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(PretrainedError, match="not a diffattn config"):
        load_pretrained(tmp_path)


def test_exported_at_top_level():
    assert diffattn.load_pretrained is load_pretrained
    assert hasattr(TransformerLM, "save_pretrained") and hasattr(TransformerClassifier, "from_pretrained")


def _run_card_code(card: str) -> dict:
    """Execute the card's python block (how it says to load the model) and return its variables."""
    code = re.search(r"```python\n(.*?)```", card, re.S)
    assert code, card
    scope: dict = {}
    exec(code.group(1), scope)
    return scope


def test_model_card_of_an_untrained_model(tmp_path, no_network):
    m = TransformerLM(cfg(attention="diff_v2", n_kv_heads=1))
    m.save_pretrained(tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    # the mixin's template said this for a folder that never went near the Hub
    assert "pushed to the Hub" not in card and "More Information Needed" not in card
    assert card.startswith("---\nlibrary_name: diffattn\n")
    assert "- Class: `TransformerLM`, a causal language model" in card
    assert "- Attention: `diff_v2`" in card
    assert "- Shape: 2 layers, d_model 32, 2 heads, 1 KV head, vocabulary 30, max sequence length 16" in card
    assert f"- Parameters: {m.num_params():,} (tied input and output embeddings counted once)" in card
    assert "No training information was given" in card
    assert "load_pretrained_tokenizer" not in card  # no tokenizer was saved
    loaded = _run_card_code(card)["model"]
    assert type(loaded) is TransformerLM and loaded.config == m.config


def test_model_card_counts_in_words(tmp_path):
    """One layer, one head: the card says "1 layer", "1 head", not "1 layers"."""
    TransformerLM(cfg(n_layers=1, n_heads=1)).save_pretrained(tmp_path)
    assert "- Shape: 1 layer, d_model 32, 1 head, vocabulary 30," in (tmp_path / "README.md").read_text()


def test_model_card_from_a_training_run(tmp_path, no_network, one_thread):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    out = tmp_path / "run"
    assert train_main(["--config", "tiny", "--out", str(out), "--data.path", str(text), "--no-progress",
                       "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                       "--model.max_seq_len", "16", "--train.seq_len", "16", "--train.batch_size", "4",
                       "--train.steps", "3", "--train.eval_every", "3", "--train.eval_batches", "1",
                       "--train.log_every", "1", "--train.warmup_steps", "1"]) == 0
    ck = load_checkpoint(out / "ckpt")
    info = training_info(ck)
    # as a user writes it: the run folder (README's example), its ckpt/ (issue 25, item 5: AttributeError on a str)
    assert training_info(str(out)) == training_info(out / "ckpt") == info
    with pytest.raises(TypeError, match="takes a run folder"):
        training_info(3)
    last = read_metrics(out / "metrics.csv")[-1]
    assert info["steps"] == 3 and info["data"] == "corpus.txt"  # its name, not this machine's path (issue 32)
    assert info["final_train_loss"] == pytest.approx(last["train_loss"])

    folder = tmp_path / "hub"
    ck.build_model().save_pretrained(folder, tokenizer=ck.tokenizer, training=info)
    card = (folder / "README.md").read_text()
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    assert "- Data: `corpus.txt`" in card
    assert f"- Data sha256: `{sha}`" in card
    assert "- Steps: 3\n" in card
    assert f"- Final training loss: {last['train_loss']:.4f}" in card
    assert f"- Final validation loss: {last['val_loss']:.4f}" in card
    assert "No training information" not in card
    loaded = _run_card_code(card)
    assert type(loaded["model"]) is TransformerLM
    assert loaded["tokenizer"].encode("fox") == ck.tokenizer.encode("fox")

    # saving again replaces a card we wrote (a user's own README.md is kept: test_config_json_and_tokenizer)
    ck.build_model().save_pretrained(folder, training={**info, "steps": 7})
    card = (folder / "README.md").read_text()
    assert "- Steps: 7\n" in card and "load_pretrained_tokenizer" not in card


def test_training_info_keys_are_checked(tmp_path):
    with pytest.raises(TypeError, match="unknown key.*'loss'"):
        TransformerLM(cfg()).save_pretrained(tmp_path, training={"loss": 1.0})
    assert not (tmp_path / "config.json").exists()  # checked before anything is written
