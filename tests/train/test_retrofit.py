"""Retrofit (issue 41): the schedule's values, step 0 equal to the exact conversion, the end equal to the plain
target type, resume mid-schedule bitwise equal to an unbroken run, selective (mixed-type) models saved, loaded,
generated from and causal, diagnostics.csv climbing as scheduled, the parameters that train, and bad input."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from clirun import run_main

from diffattn.checkpoint.format import load_checkpoint, save_checkpoint
from diffattn.configs.retrofit import RetrofitConfig, retrofit_targets
from diffattn.configs.run_config import RunConfig
from diffattn.interop.convert import convert
from diffattn.model.config import ModelConfig
from diffattn.model.tokenizer import CharTokenizer
from diffattn.model.transformer import TransformerLM
from diffattn.train.diagnostics import read_diagnostics
from diffattn.train.retrofit import entropy_scores, freeze, retrofit_model, set_retrofit

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
        "resolved rather to die than to famish? All: Resolved. resolved.\n") * 8
STEPS = ["--train.batch_size", "2", "--train.seq_len", "24", "--train.warmup_steps", "0", "--train.eval_batches",
         "1", "--train.log_every", "1", "--train.deterministic", "--no-progress"]


def _standard(n_layers: int = 3, seed: int = 0) -> TransformerLM:
    """A tiny standard model with weights wide enough that attention is far from uniform."""
    tok = CharTokenizer(sorted(set(TEXT)))
    cfg = ModelConfig(attention="standard", vocab_size=tok.vocab_size, d_model=32, n_layers=n_layers, n_heads=4,
                      n_kv_heads=2, max_seq_len=64, rope="neox")
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A standard checkpoint with a char tokenizer and its text: the folder a retrofit starts from."""
    root = tmp_path_factory.mktemp("retrofit")
    model = _standard()
    save_checkpoint(root / "src", model, run_config=RunConfig.of_model(model.config),
                    tokenizer=CharTokenizer(sorted(set(TEXT))))
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return root


def test_schedule_values():
    lin = RetrofitConfig(to="diff", steps=4)
    assert [lin.schedule(s) for s in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    cos = RetrofitConfig(to="diff", steps=4, shape="cosine")
    assert cos.schedule(0) == 0.0 and cos.schedule(4) == 1.0
    assert math.isclose(cos.schedule(1), 0.5 * (1 - math.cos(math.pi / 4))) and math.isclose(cos.schedule(2), 0.5)
    assert RetrofitConfig(to="diff", steps=0).schedule(0) == 1.0  # no annealing: the target at once
    assert {"diff", "diff_v2", "gated", "grouped_diff"} <= set(retrofit_targets())


@pytest.mark.parametrize("to", ["diff", "diff_v2", "gated"])
def test_step_zero_is_the_exact_conversion_and_the_end_the_plain_type(to):
    src = _standard()
    ids = torch.randint(0, src.config.vocab_size, (2, 20))
    model, note = retrofit_model(src, RetrofitConfig(to=to, steps=10))
    assert note["layers"] == [0, 1, 2]
    with torch.no_grad():
        ref, conv = src(ids), convert(src, to)(ids)
        assert set_retrofit(model, 0.0) == 3
        start = model(ids)
        assert (start - ref).abs().max() < 1e-4 and (start - conv).abs().max() < 1e-4
        set_retrofit(model, 0.5)
        mid = model(ids)
        set_retrofit(model, 1.0)
        end = model(ids)
        plain = TransformerLM(model.config)
        plain.load_state_dict(model.state_dict())  # the plain type: nothing of the schedule in its weights
        assert torch.equal(plain(ids), end)
    if to == "diff":  # V1 changes the function as λ_init and the norm come in; V2 and gated only once trained
        assert (mid - start).abs().max() > 1e-3 and (end - mid).abs().max() > 1e-3
        assert model.config.options.subln and model.config.options.lambda_init is None


def test_v1_lambda_climbs_to_the_target():
    model, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", steps=4, lambda_init=0.6))
    attn = model.blocks[2].attn
    for s in (0.0, 0.25, 1.0):
        set_retrofit(model, s)
        # the λ vectors are equal: the learned part is 0
        assert math.isclose(float(attn.lambda_full().detach()), 0.6 * s, abs_tol=1e-7)


def test_selective_layers_mix_types_and_stay_causal(tmp_path):
    src = _standard()
    model, note = retrofit_model(src, RetrofitConfig(to="diff", layers=[1]))
    assert model.config.layer_attention == ["standard", "diff", "standard"] and model.config.mixed
    assert [b.attn.kind for b in model.blocks] == ["standard", "diff", "standard"]
    assert torch.equal(model.blocks[0].attn.q_proj.weight, src.blocks[0].attn.q_proj.weight)
    ids = torch.randint(0, src.config.vocab_size, (1, 16))
    with torch.no_grad():
        set_retrofit(model, 0.0)
        assert (model(ids) - src(ids)).abs().max() < 1e-4
        set_retrofit(model, 1.0)
        full = model(ids)
        changed = ids.clone()
        changed[0, 10:] = (changed[0, 10:] + 1) % src.config.vocab_size
        assert torch.equal(model(changed)[:, :10], full[:, :10])  # no output depends on a later token
    save_checkpoint(tmp_path / "ck", model, run_config=RunConfig.of_model(model.config))
    back = load_checkpoint(tmp_path / "ck").build_model()
    assert back.config.layer_attention == model.config.layer_attention
    with torch.no_grad():
        assert torch.equal(back(ids), full)
    from diffattn.model.generate import generate

    a = generate(model, ids[0, :5], max_new_tokens=6, temperature=0.0)
    assert generate(back, ids[0, :5], max_new_tokens=6, temperature=0.0) == a
    seq = torch.tensor([ids[0, :5].tolist() + a])
    with torch.no_grad():  # the cached decode equals the full forward on what it generated
        greedy = model(seq[:, :-1])[0, 4:].argmax(-1)
    assert greedy.tolist() == a


def test_top_k_layers_are_the_highest_entropy_ones():
    src = _standard(n_layers=4)
    ids = [torch.randint(0, src.config.vocab_size, (2, 20)) for _ in range(2)]
    scores = entropy_scores(src, ids)
    assert len(scores) == 4 and all(0 < s < math.log(20) for s in scores)

    class Batches:
        def get_batch(self, split, n, gen):
            return torch.randint(0, src.config.vocab_size, (n, 20), generator=gen), None

    model, note = retrofit_model(src, RetrofitConfig(to="diff", top_k_layers=2, score_batches=2), source=Batches())
    top = sorted(sorted(range(4), key=lambda i: -note["scores"][i])[:2])
    assert note["layers"] == top and [t == "diff" for t in model.config.layer_attention] == [i in top
                                                                                             for i in range(4)]


def test_which_parameters_train():
    model, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", layers=[0, 2]))
    freeze(model, RetrofitConfig(to="diff", layers=[0, 2], train="new"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"body.blocks.{i}.attn.{n}" for i in (0, 2)
                         for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight")}
    freeze(model, RetrofitConfig(to="diff", train="attention"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".attn." in n for n in trainable) and "body.blocks.1.attn.q_proj.weight" in trainable


def test_retrofit_run_diagnostics_info_and_exact_resume(source, tmp_path):
    """train --init-from SRC --retrofit.to diff: λ and the schedule factor climb in diagnostics.csv; the run
    records its [retrofit] section (info shows it); a run resumed mid-schedule ends bitwise equal to an
    unbroken one."""
    args = ["train", "--init-from", str(source / "src"), "--data.path", str(source / "text.txt"), *STEPS,
            "--train.steps", "6", "--train.eval_every", "2", "--train.ckpt_every", "3", "--train.keep_checkpoints", "5",
            "--retrofit.to", "diff",
            "--retrofit.steps", "4", "--retrofit.lambda_init", "0.5", "--retrofit.layers", "[0,2]"]
    r = run_main(*args, "--out", str(tmp_path / "full"))
    assert r.returncode == 0, r.stderr
    rows = read_diagnostics(tmp_path / "full" / "diagnostics.csv")
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert [r["retrofit_s"] for r in rows] == [0.5, 1.0, 1.0]
    lam = [r["layer2.lambda"] for r in rows]
    assert abs(lam[0] - 0.25) < 0.05 and abs(lam[1] - 0.5) < 0.05 and "layer1.lambda" not in rows[0]
    assert all(r["layer0.neg_mass"] >= 0 for r in rows)
    ck = load_checkpoint(tmp_path / "full" / "ckpt")
    assert ck.run_config.retrofit == RetrofitConfig(to="diff", steps=4, lambda_init=0.5, layers=[0, 2])
    assert ck.model_config.layer_attention == ["diff", "standard", "diff"]
    r = run_main("info", str(tmp_path / "full"))
    assert r.returncode == 0 and "[retrofit]" in r.stdout and "lambda_init = 0.5" in r.stdout

    # resume at step 3 (s = 0.75) from the checkpoint the unbroken run kept there
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "full", broken, ignore=shutil.ignore_patterns("*.lock", "ckpt"))
    (broken / "ckpt-step-3").rename(broken / "ckpt")
    mid = load_checkpoint(broken / "ckpt")
    assert mid.train_state["step"] == 3
    assert float(mid.build_model().blocks[0].attn.retrofit_s) == 0.75  # loaded as it trained at step 3
    r = run_main("train", "--out", str(broken), "--resume", "--no-progress", "--retrofit.steps", "5")
    assert r.returncode == 2 and "cannot resume with other --retrofit" in r.stderr, r.stderr
    r = run_main("train", "--out", str(broken), "--resume", "--no-progress")
    assert r.returncode == 0, r.stderr
    a, b = ck.state_dict, load_checkpoint(broken / "ckpt").state_dict
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, says", [
    (["--retrofit.steps", "9"], "longer than the run"),
    (["--retrofit.layers", "[1,7]"], "layers [7] do not exist"),
    (["--retrofit.lambda_init", "1.0"], "must be in [0, 1)"),
    (["--retrofit.to", "standard"], "--retrofit.to standard"),
    (["--retrofit.top_k_layers", "9"], "more than the model's 3 layers"),
])
def test_bad_input_is_one_line_and_writes_nothing(source, tmp_path, extra, says):
    args = ["train", "--init-from", str(source / "src"), "--data.path", str(source / "text.txt"), *STEPS,
            "--train.steps", "4", "--out", str(tmp_path / "out"), "--retrofit.to", "diff", "--retrofit.steps", "2"]
    r = run_main(*args, *extra)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_retrofit_onto_itself_or_without_a_source_is_refused(source, tmp_path):
    conv = tmp_path / "conv"
    model = convert(load_checkpoint(source / "src").build_model(), "diff")
    save_checkpoint(conv, model, run_config=RunConfig.of_model(model.config), tokenizer=CharTokenizer(sorted(set(
        TEXT))))
    r = run_main("train", "--init-from", str(conv), "--data.path", str(source / "text.txt"), *STEPS, "--out",
                 str(tmp_path / "out"), "--retrofit.to", "diff")
    assert r.returncode == 2 and "onto itself" in r.stderr and not (tmp_path / "out").exists(), r.stderr
    r = run_main("train", "--config", "tiny", "--data.path", str(source / "text.txt"), "--out", str(tmp_path / "o2"),
                 "--retrofit.to", "diff")
    assert r.returncode == 2 and "--init-from" in r.stderr and not (tmp_path / "o2").exists(), r.stderr


def test_exports_refuse_a_mid_schedule_model_and_transformers_mixed_layers_take_custom_code():
    from diffattn.interop.hf_export import export_problems, native_problems
    from diffattn.interop.vllm.served import model_problems

    mixed, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", layers=[1]))
    assert "mix attention types" in " ".join(native_problems(mixed)) and not export_problems(mixed)
    assert not model_problems(mixed, cpu=False)  # vLLM serves each layer as its type (tests/serve)
    whole, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", steps=4))
    assert not model_problems(whole, cpu=False)
    set_retrofit(whole, 0.5)
    assert "middle of its retrofit schedule" in " ".join(export_problems(whole))
    assert "middle of its retrofit schedule" in " ".join(model_problems(whole, cpu=False))


@pytest.mark.parametrize("to, column", [("diff_v2", "sigma"), ("gated", "gate")])
def test_diagnostics_show_the_annealed_weight(to, column):
    from diffattn.train.diagnostics import attention_diagnostics

    model, _ = retrofit_model(_standard(), RetrofitConfig(to=to, steps=4))
    with torch.no_grad():
        for blk in model.blocks:  # a W_λ / W_θ that has learned something: σ(x·W) is no longer ½
            getattr(blk.attn, "lambda_proj" if to == "diff_v2" else "gate_proj").weight.normal_(0, 1.0)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    cols = {}
    for s in (0.0, 0.5, 1.0):
        set_retrofit(model, s)
        cols[s] = attention_diagnostics(model, ids)[f"layer0.{column}"]
    assert cols[0.0] == pytest.approx(0.5, abs=1e-6)  # the conversion's constant ½, whatever W is
    assert cols[0.5] == pytest.approx(0.5 * 0.5 + 0.5 * cols[1.0], abs=1e-5) and abs(cols[1.0] - 0.5) > 1e-3


def test_v1_norm_gain_is_calibrated_to_the_source_scale():
    """With batches, the per-head norm's gain starts at RMS(o) / (1 − λ_init): blending the norm in then moves
    the function less than with a gain of 1."""
    src = _standard()

    class Batches:
        def get_batch(self, split, n, gen):
            return torch.randint(0, src.config.vocab_size, (n, 20), generator=gen), None

    rcfg = RetrofitConfig(to="diff", steps=4)
    cal, _ = retrofit_model(src, rcfg, source=Batches())
    raw, _ = retrofit_model(src, rcfg)
    gains = [float(b.attn.subln.weight[0]) for b in cal.blocks]
    assert all(float(b.attn.subln.weight[0]) == 1.0 for b in raw.blocks) and all(g != 1.0 for g in gains)
    assert torch.equal(cal.blocks[0].attn.subln.weight, torch.full_like(cal.blocks[0].attn.subln.weight, gains[0]))
    ids = torch.randint(0, src.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = src(ids)
        set_retrofit(cal, 0.25)
        set_retrofit(raw, 0.25)
        assert (cal(ids) - ref).abs().mean() < (raw(ids) - ref).abs().mean()
