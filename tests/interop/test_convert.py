"""`diffattn convert`: exactness against tiny random transformers Llamas, the saddle check, the split init, the
λ warm-up knob, DiffLlama export refusals, and convert -> train --init-from -> generate/eval/info via the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from clirun import run_main

transformers = pytest.importorskip("transformers")

from diffattn.interop.convert import convert, created_tensors  # noqa: E402
from diffattn.interop.hf import read_hf_folder, to_hf  # noqa: E402
from diffattn.model.tokenizer import HFTokenizer, tokenizer_from_dict  # noqa: E402
from diffattn.model.transformer import TransformerLM, set_lambda_scale  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXT = (
    "The old lighthouse keeper climbed the stairs every evening to light the lamp. Ships passing in the night "
    "trusted the beam to guide them past the rocks. One winter the storm lasted for a week, and the keeper did "
    "not sleep. When the sky finally cleared, the village thanked him with bread, fish and a warm coat. "
    "He smiled, said that the sea had been kind, and went back up the stairs to clean the glass.\n"
) * 3
VOCAB = 128


def _tokenizer() -> HFTokenizer:
    """A small sentencepiece-style BPE tokenizer.json with an added BOS, built with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>"],
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return HFTokenizer(tok)


def _llama(folder: Path, kv: int = 4, tied: bool = True, head_dim: int | None = None, seed: int = 0,
           with_tokenizer: bool = False):
    """A tiny random LlamaForCausalLM saved to ``folder``; weights drawn wide enough that attention is far
    from uniform (the default init std of 0.02 would make every map nearly flat and the test weak)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=kv, head_dim=head_dim,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    hf.save_pretrained(folder)
    if with_tokenizer:
        transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer().tok).save_pretrained(folder)
    return hf


CASES = {"mha_tied": dict(kv=4, tied=True), "gqa_untied": dict(kv=2, tied=False),
         "mqa_tied": dict(kv=1, tied=True), "gqa_head_dim": dict(kv=2, tied=False, head_dim=16)}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    out = {}
    for name, kw in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (_llama(folder, **kw), folder)
    return out


@pytest.mark.parametrize("to", ["diff", "diff_v2"])
@pytest.mark.parametrize("rope", ["neox", "interleaved"])
@pytest.mark.parametrize("case", list(CASES))
def test_exact_conversion_matches_transformers(llamas, case, rope, to, one_thread):
    hf, folder = llamas[case]
    ids = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        src = read_hf_folder(folder, rope=rope)
        model = convert(src, to)
        err = (model(ids) - ref).abs().max().item()
    assert model.config.attention == to and model.config.rope == rope
    assert model.config.tie_embeddings == CASES[case]["tied"]
    assert err < 1e-4, f"{case}/{rope}/{to}: max |Δlogits| = {err:.3g}"
    if to == "diff":
        assert all(b.attn.lambda_full().item() == 0.0 for b in model.blocks)  # exactly, not approximately
        assert model.config.head_dim == hf.config.head_dim and not model.config.options.subln


def _lm_loss(model: TransformerLM, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _text_ids() -> torch.Tensor:
    ids = _tokenizer().encode(TEXT)
    return torch.tensor(ids[: 2 * 48]).view(2, 48)


def _grads(model: TransformerLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _lm_loss(model, ids).backward()
    return {k: v.detach().clone() for k, v in created_tensors(model, grads=True).items()}


@pytest.mark.parametrize("to", ["diff", "diff_v2"])
def test_no_created_tensor_sits_at_a_zero_gradient_saddle(llamas, to, one_thread):
    """After one AdamW step on real text, every block of parameters that conversion created (sub-head copies,
    value halves, out-projection halves, λ vectors; V2: odd query heads, W_λ) has a non-zero gradient."""
    model = convert(read_hf_folder(llamas["gqa_untied"][1]), to).train()
    ids = _text_ids()
    g0 = _grads(model, ids)
    if to == "diff":  # why the check is after a step: ∂L/∂(Q2, K2) ∝ λ = 0 at conversion, ∂L/∂λ is not
        assert all(g0[f"layer{i}.{n}"].abs().max() == 0 for i in range(2) for n in ("q2", "k2"))
        assert all(g0[f"layer{i}.lambda_q1"].abs().max() > 0 for i in range(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    g1 = _grads(model, ids)
    zero = [k for k, g in g1.items() if not g.abs().max() > 0]
    assert not zero, f"zero gradient after one step: {zero}"
    assert len(g1) == 2 * (12 if to == "diff" else 4)


def test_zero_lambda_vectors_would_be_a_saddle(llamas, one_thread):
    """The reason λq/λk are copies of non-zero vectors: with all four at 0, λ's gradient vanishes."""
    model = convert(read_hf_folder(llamas["mha_tied"][1]), "diff").train()
    with torch.no_grad():
        for b in model.blocks:
            for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(b.attn, n).zero_()
    g = _grads(model, _text_ids())
    assert all(g[f"layer{i}.{n}"].abs().max() == 0 for i in range(2) for n in ("lambda_q1", "lambda_k2"))


@pytest.mark.parametrize("noise", [0.5, 0.0])
def test_value_halves_separate_only_with_symmetry_breaking(llamas, noise, one_thread):
    model = convert(read_hf_folder(llamas["mha_tied"][1]), "diff", break_symmetry=noise).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _text_ids()
    for _ in range(3):
        opt.zero_grad()
        _lm_loss(model, ids).backward()
        opt.step()
    v = created_tensors(model)
    gap = max((v[f"layer{i}.v_half1"] - v[f"layer{i}.v_half2"]).abs().max().item() for i in range(2))
    if noise:
        assert gap > 1e-5
    else:  # ½W_o | ½W_o: both halves get identical gradients, so AdamW keeps them equal forever
        assert gap == 0.0


def test_split_init_is_parameter_matched_not_exact(llamas, one_thread):
    hf, folder = llamas["gqa_untied"]
    src = read_hf_folder(folder)
    model = convert(src, "diff", init="split")
    cfg, d = model.config, src.config.qk_head_dim
    opts = cfg.options
    assert (cfg.n_heads, cfg.kv_heads, cfg.qk_head_dim, opts.subln, opts.lambda_init) == (2, 1, d, True, None)
    assert model.num_params() == src.num_params() + cfg.n_layers * 6 * d  # λ vectors (4d) + norm gains (2d)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        out = model(ids)
        assert torch.isfinite(out).all()
        assert (out - hf(ids).logits).abs().max() > 1e-2  # documented: not function-preserving
    with pytest.raises(ValueError, match="split is not defined for --to diff_v2: it is not parameter-matched"):
        convert(src, "diff_v2", init="split")
    with pytest.raises(ValueError, match="even"):
        convert(read_hf_folder(llamas["mqa_tied"][1]), "diff", init="split")
    with pytest.raises(ValueError, match="standard attention"):
        convert(model, "diff")


@pytest.mark.parametrize("to", ["diff", "diff_v2"])
def test_lambda_scale_switches_the_negative_map_off(llamas, to, one_thread):
    """At scale 0 the second map has no effect (perturbing its query rows changes nothing); at 1 it does."""
    model = convert(read_hf_folder(llamas["gqa_untied"][1]), to)
    with torch.no_grad():
        for b in model.blocks:  # make λ ≠ 0 (V1) and the odd/Q2 query rows differ from their partners
            if to == "diff":
                b.attn.lambda_q2.add_(0.5)
            b.attn.q_proj.weight.view(-1, 2, model.config.qk_head_dim, 32)[:, 1].normal_()
    ids = torch.randint(0, VOCAB, (2, 24))
    ref = convert(read_hf_folder(llamas["gqa_untied"][1]), "diff")
    with torch.no_grad():
        assert (model(ids) - ref(ids)).abs().max() > 1e-3
        assert set_lambda_scale(model, 0.0) == model.config.n_layers
        if to == "diff":  # V1: λ·0 = 0 -> back to the source function
            assert (model(ids) - ref(ids)).abs().max() < 1e-4
        else:  # V2: out = attn_even only, whatever the odd heads hold
            before = model(ids)
            for b in model.blocks:
                b.attn.q_proj.weight.view(-1, 2, model.config.qk_head_dim, 32)[:, 1].normal_()
            assert (model(ids) - before).abs().max() == 0
    with pytest.raises(ValueError, match="lambda scale"):
        set_lambda_scale(model, 1.5)


def test_lambda_warmup_in_the_training_loop(llamas, one_thread):
    from diffattn.configs.run_config import TrainConfig
    from diffattn.data.lm import TokenWindows
    from diffattn.train.loop import train

    src = read_hf_folder(llamas["gqa_untied"][1])
    ids = torch.tensor(_tokenizer().encode(TEXT))
    source = TokenWindows(ids, 16, VOCAB, val_fraction=0.2)
    tcfg = TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=0, eval_every=0, log_every=1,
                       lambda_warmup_steps=4, lr=1e-3)
    model = convert(src, "diff").train()
    res = train(model, source, tcfg, progress=False)
    x, y = source.get_batch("train", 2, torch.Generator().manual_seed(tcfg.seed))
    with torch.no_grad():
        src_loss = F.cross_entropy(src(x).flatten(0, 1), y.flatten()).item()
    assert abs(res.history[0]["train_loss"] - src_loss) < 1e-5  # step 0: the source's function
    assert all(float(b.attn.lambda_scale) == 0.25 for b in model.blocks)  # last step index 1: 1/4
    res = train(model, source, TrainConfig(**{**tcfg.__dict__, "steps": 5}), progress=False)
    assert all(float(b.attn.lambda_scale) == 1.0 for b in model.blocks)  # step index 4: reached 1
    with pytest.raises(ValueError, match="lambda_warmup_steps"):
        TrainConfig(lambda_warmup_steps=-1)


def test_to_hf_says_what_difflama_cannot_express(llamas, one_thread):
    hf, folder = llamas["gqa_head_dim"]
    exact = convert(read_hf_folder(folder), "diff")
    with pytest.raises(ValueError, match=r"lambda_init=0\.0.*subln=False"):
        to_hf(exact)
    with pytest.raises(ValueError, match="diff_v2"):
        to_hf(convert(read_hf_folder(folder), "diff_v2"))
    split = convert(read_hf_folder(folder), "diff", init="split")  # paper settings, head_dim 16 != 32/(2·2)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        err = (to_hf(split, attn_implementation="eager")(ids).logits - split(ids)).abs().max().item()
    assert err < 1e-4


def test_hf_tokenizer_round_trips():
    tok = _tokenizer()
    back = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert back.kind == "hf" and back.encode(TEXT) == tok.encode(TEXT) and back.encode(TEXT)[0] == 1  # BOS kept
    assert back.decode(back.encode("the sea")[1:]) == "the sea"


def test_convert_then_finetune_generate_eval_info_through_the_cli(tmp_path, capsys, monkeypatch, one_thread):
    """convert, train --init-from, generate, eval, info: each through ``main(argv)``, as the program runs it."""
    from diffattn.checkpoint.format import load_checkpoint
    from diffattn.cli.main import main

    src = tmp_path / "llama"
    _llama(src, kv=2, tied=False, with_tokenizer=True)  # model vocab 128, tokenizer 100: a padded table
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    r = run_main("convert", str(src), "--to", "diff", "--out", "conv", "--check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split("max |Δlogits| vs source:")[1].split()[0]) < 1e-4
    r = run_main("train", "--init-from", "conv", "--data.path", "text.txt", "--out", "ft", "--no-progress",
             "--train.steps", "4", "--train.seq_len", "32", "--train.batch_size", "2", "--train.eval_every", "2",
             "--train.eval_batches", "1", "--train.lambda_warmup_steps", "2", "--train.warmup_steps", "0",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ck = load_checkpoint(tmp_path / "ft" / "ckpt")
    assert ck.tokenizer.kind == "hf" and ck.train_state["step"] == 4
    assert ck.tokenizer.encode(TEXT) == HFTokenizer.from_file(src / "tokenizer.json").encode(TEXT)
    diag = (tmp_path / "ft" / "diagnostics.csv").read_text().splitlines()
    assert diag[0].startswith("step,layer0.lambda,layer0.neg_mass") and len(diag) == 3

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "ft", "--prompt", "The sea", "--max-new-tokens", "20", "--temperature", "2",
                 "--seed", "0"]) == 0  # temperature 2 on a random model: ids past the tokenizer would appear
    assert main(["eval", "ft/ckpt", "--what", "ppl", "--batches", "1", "--batch-size", "2"]) == 0
    assert main(["info", "conv"]) == 0
    assert "converted_from" in capsys.readouterr().out
    assert main(["convert", "missing", "--to", "diff", "--out", "x"]) == 2
    assert "error: missing: not a model folder (it does not exist" in capsys.readouterr().err
    assert main(["train", "--init-from", "conv", "--data.path", "text.txt", "--model.d_model", "64"]) == 2
    assert "model overrides" in capsys.readouterr().err
