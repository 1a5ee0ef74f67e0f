"""Head-level selective retrofit (issue 41, DEX's unit): ``ModelConfig.diff_heads`` and ``--retrofit.heads`` /
``--retrofit.top_k_heads``. Exact at s = 0 against the standard source with a head subset (V1 and V2), an
unselected head a standard head on its first map, the config's checks, the entropy pick, the checkpoint round
trip and bad input through the CLI."""

from __future__ import annotations

import math

import pytest
import torch
from clirun import run_main
from test_retrofit import STEPS, _standard, source  # noqa: F401  (the module fixture)

from diffattn.attention.diff import MultiheadDiffAttention
from diffattn.attention.diff_v2 import DiffV2Attention
from diffattn.attention.standard import attention_ref
from diffattn.checkpoint.format import load_checkpoint, save_checkpoint
from diffattn.configs.retrofit import RetrofitConfig
from diffattn.configs.run_config import RunConfig
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.train.diagnostics import attention_diagnostics
from diffattn.train.retrofit import freeze, head_entropy_scores, retrofit_model, set_retrofit

HEADS = "0.1,2.0,2.3"  # layer 1 has none: it stays standard


class Batches:
    """A data source of random ids (what ``top_k_heads`` scores and V1's calibration reads)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def get_batch(self, split, n, gen):
        return torch.randint(0, self.vocab, (n, 20), generator=gen), None


@pytest.mark.parametrize("to", ["diff", "diff_v2"])
def test_head_subset_is_exact_at_s0_and_mixes_layers(to):
    src = _standard()
    rcfg = RetrofitConfig(to=to, steps=4, heads=HEADS)
    model, note = retrofit_model(src, rcfg, source=Batches(src.config.vocab_size))
    assert note["heads"] == ["0.1", "2.0", "2.3"] and note["layers"] == [0, 2]
    assert model.config.diff_heads == [[1], [], [0, 3]]
    assert model.config.layer_attention == [to, "standard", to]
    assert model.blocks[0].attn.head_mask.tolist() == [0, 1, 0, 0] and model.blocks[1].attn.kind == "standard"
    ids = torch.randint(0, src.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = src(ids)
        set_retrofit(model, 0.0)
        delta = float((model(ids) - ref).abs().max())
        assert delta < 1e-4, delta
        if to == "diff":  # the plain V1 layer moves the selected heads only (λ_init, the norm come in)
            set_retrofit(model, 1.0)
            assert float((model(ids) - ref).abs().max()) > 1e-3


def _head_inputs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of ``attn.out_proj`` (B, T, h·width): each head's output side by side."""
    seen = []
    hook = attn.out_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    try:
        attn(x)
    finally:
        hook.remove()
    return seen[-1]


def _randomized(build, reference: bool):
    """(the module ``build()`` makes, in float64 with every parameter ~ N(0, 0.5²) and the fast or reference
    path, an input x (2, 9, 32))."""
    torch.manual_seed(0)
    attn = build().double().eval()
    attn.use_reference = reference
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)
    return attn, torch.randn(2, 9, 32, dtype=torch.double)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_v1_unselected_head_is_a_standard_head_on_its_first_map(reference):
    attn, x = _randomized(lambda: MultiheadDiffAttention(32, 2, depth=3, selected_heads=[1]), reference)
    d = attn.head_dim
    out = _head_inputs(attn, x)
    # head 0 = A1·V (no λ, no norm): standard attention of sub-head 0 over key sub-head 0 and the 2d value head
    q, k, v = attn.project(x)
    want = attention_ref(q[:, 0:1], k[:, 0:1], v[:, 0:1])
    torch.testing.assert_close(out[..., :2 * d], want[:, 0], rtol=0, atol=1e-12)
    with torch.no_grad():  # the second map's query rows: head 0 (sub-head 1) does not read them, head 1 (3) does
        attn.q_proj.weight[d:2 * d].normal_(0, 1.0)
        attn.q_proj.weight[3 * d:4 * d].normal_(0, 1.0)
    moved = _head_inputs(attn, x)
    assert torch.equal(moved[..., :2 * d], out[..., :2 * d])
    assert (moved[..., 2 * d:] - out[..., 2 * d:]).abs().max() > 1e-3


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
def test_v2_unselected_pair_is_a_standard_head_on_its_even_map(reference):
    attn, x = _randomized(lambda: DiffV2Attention(32, 2, num_kv_heads=1, selected_heads=[0]), reference)
    d = attn.head_dim
    out = _head_inputs(attn, x)
    q = attn.q_proj(x).view(2, 9, 4, d).transpose(1, 2)
    k, v = (p(x).view(2, 9, 1, d).transpose(1, 2) for p in (attn.k_proj, attn.v_proj))
    torch.testing.assert_close(out[..., d:], attention_ref(q[:, 2:3], k, v)[:, 0], rtol=0, atol=1e-12)
    with torch.no_grad():  # pair 1's odd query head and its W_λ row: unread; pair 0's: read
        attn.q_proj.weight[3 * d:].normal_(0, 1.0)
        attn.lambda_proj.weight[1].normal_(0, 1.0)
        attn.q_proj.weight[d:2 * d].normal_(0, 1.0)
    moved = _head_inputs(attn, x)
    assert torch.equal(moved[..., d:], out[..., d:]) and (moved[..., :d] - out[..., :d]).abs().max() > 1e-3


def test_diff_heads_is_checked_in_one_line():
    base = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, attention="diff")
    assert ModelConfig(**base, diff_heads=[[1], [0, 1]]).layer_heads(0) == [1]
    mixed = ModelConfig(**base, head_dim=8, layer_attention=["diff", "standard"], diff_heads=[[0], []])
    assert [b.attn.kind for b in TransformerLM(mixed).blocks] == ["diff", "standard"]
    for heads, says in (([[1]], "each of the 2 layers"), ([[2], [0]], "from 0 to 1"), ([[1, 0], [0]], "increasing"),
                        ([[], [0]], "selects no head of a 'diff' layer"), ([[0, 0], [1]], "distinct")):
        with pytest.raises(ValueError, match="diff_heads") as e:
            ModelConfig(**base, diff_heads=heads)
        assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"\[0\] of a 'standard' layer") as e:
        ModelConfig(**base, head_dim=8, layer_attention=["diff", "standard"], diff_heads=[[0], [0]])
    with pytest.raises(ValueError, match=r"'gated' layer, a type that does not select heads \(the types that do: "
                                         r"diff, diff_v2\)"):
        ModelConfig(**{**base, "attention": "gated"}, diff_heads=[[0], [1]])


def test_top_k_heads_are_the_highest_entropy_ones():
    """Heads 0.1 and 2.3 get a zero query projection: every row of theirs is uniform over the keys it sees, the
    most entropy a causal row can have (mean of ln(t + 1)), so they are the two that top_k_heads picks."""
    src = _standard()
    d = src.config.qk_head_dim
    with torch.no_grad():
        for layer, head in ((0, 1), (2, 3)):
            src.blocks[layer].attn.q_proj.weight[head * d:(head + 1) * d] = 0
    ids = [torch.randint(0, src.config.vocab_size, (2, 20))]
    scores = head_entropy_scores(src, ids)
    uniform = sum(math.log(t + 1) for t in range(20)) / 20
    assert scores[0][1] == pytest.approx(uniform, abs=1e-5) and scores[2][3] == pytest.approx(uniform, abs=1e-5)
    assert all(s < uniform - 1e-3 for i, row in enumerate(scores) for j, s in enumerate(row)
               if (i, j) not in ((0, 1), (2, 3)))
    model, note = retrofit_model(src, RetrofitConfig(to="diff", top_k_heads=2, score_batches=2),
                                 source=Batches(src.config.vocab_size))
    assert note["heads"] == ["0.1", "2.3"] and len(note["head_scores"]) == 3 and len(note["head_scores"][0]) == 4
    assert model.config.diff_heads == [[1], [], [3]]


def test_new_parameters_and_diagnostics_of_a_masked_layer():
    model, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", heads=HEADS))
    freeze(model, RetrofitConfig(to="diff", heads=HEADS, train="new"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"body.blocks.{i}.attn.{n}" for i in (0, 2)
                         for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight")}
    attn, d = model.blocks[2].attn, model.blocks[2].attn.head_dim
    with torch.no_grad():  # second maps that differ from the first: head 0's (selected), head 1's (not)
        attn.q_proj.weight[d:2 * d].normal_(0, 1.0)
        attn.q_proj.weight[3 * d:4 * d].normal_(0, 1.0)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    cols = attention_diagnostics(model, ids)
    lam = float(attn.lambda_full().detach())
    assert cols["layer2.lambda"] == pytest.approx(lam, abs=1e-6)
    attn.capture = []
    with torch.no_grad():
        model(ids)
    maps, attn.capture = attn.capture[-1], None
    on = [0, 3]  # layer 2's selected heads: their own map A1 − λ·A2, independently of the column's code
    mass = torch.relu(lam * maps["probs2"][:, on] - maps["probs1"][:, on]).sum(-1).mean()
    assert cols["layer2.neg_mass"] == pytest.approx(float(mass), rel=1e-5) and float(mass) > 1e-3
    assert cols["layer0.neg_mass"] == pytest.approx(0.0, abs=1e-7)  # A1 = A2 there, λ < 1
    assert "layer1.lambda" not in cols


@pytest.mark.parametrize("to", ["diff", "diff_v2"])
def test_a_head_masked_model_round_trips_through_a_checkpoint(tmp_path, to):
    src = _standard()
    model, _ = retrofit_model(src, RetrofitConfig(to=to, heads=HEADS))
    save_checkpoint(tmp_path / "ck", model, run_config=RunConfig.of_model(model.config))
    back = load_checkpoint(tmp_path / "ck").build_model()
    assert back.config.diff_heads == [[1], [], [0, 3]] and back.config.layer_attention == [to, "standard", to]
    ids = torch.randint(0, src.config.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
        later = ids.clone()
        later[0, 9:] = (later[0, 9:] + 1) % src.config.vocab_size
        assert torch.equal(back(later)[:, :9], back(ids)[:, :9])  # no output depends on a later token


def test_retrofit_heads_run_records_them_and_info_shows_them(source, tmp_path):  # noqa: F811
    r = run_main("train", "--init-from", str(source / "src"), "--data.path", str(source / "text.txt"), *STEPS,
                 "--train.steps", "2", "--train.eval_every", "2", "--out", str(tmp_path / "run"),
                 "--retrofit.to", "diff_v2", "--retrofit.steps", "2", "--retrofit.heads", HEADS)
    assert r.returncode == 0, r.stderr
    assert "heads 3 of 12" in r.stderr
    ck = load_checkpoint(tmp_path / "run" / "ckpt")
    assert ck.run_config.retrofit.heads == ["0.1", "2.0", "2.3"] and ck.model_config.diff_heads == [[1], [], [0, 3]]
    r = run_main("info", str(tmp_path / "run"))
    assert r.returncode == 0 and "diff_heads = [[1], [], [0, 3]]" in r.stdout and "heads = ['0.1', '2.0', '2.3']" \
        in r.stdout, r.stdout


@pytest.mark.parametrize("extra, says", [
    (["--retrofit.heads", "9.9"], "heads ['9.9'] do not exist: the model has 3 layers of 4 heads (0.0 to 2.3)"),
    (["--retrofit.heads", "0.1,1.4"], "heads ['1.4'] do not exist"),
    (["--retrofit.heads", "0.x"], "heads must be LAYER.HEAD pairs"),
    (["--retrofit.heads", "0.1,0.1"], "heads must be distinct"),
    (["--retrofit.top_k_heads", "13"], "top_k_heads 13 is more than the model's 12 heads"),
    (["--retrofit.heads", "0.1", "--retrofit.layers", "[0]"], "give one of layers, top_k_layers, heads, top_k_heads"),
    (["--retrofit.top_k_heads", "2", "--retrofit.top_k_layers", "1"], "not top_k_layers and top_k_heads"),
    (["--retrofit.to", "gated", "--retrofit.heads", "0.1"], "--retrofit.to gated does not select heads"),
])
def test_bad_head_input_is_one_line_and_writes_nothing(source, tmp_path, extra, says):  # noqa: F811
    r = run_main("train", "--init-from", str(source / "src"), "--data.path", str(source / "text.txt"), *STEPS,
                 "--train.steps", "4", "--out", str(tmp_path / "out"), "--retrofit.to", "diff", *extra)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_hf_export_takes_a_head_mask_as_custom_code():
    """Every layer converted (not mixed), some heads only: no transformers class has the per-head mask, so the
    export is a custom-code folder (tests/interop/test_hf_custom.py)."""
    from diffattn.interop.hf_export import export_problems, native_problems

    model, _ = retrofit_model(_standard(), RetrofitConfig(to="diff", heads="0.1,1.0,2.3"))
    assert model.config.layer_attention is None and model.config.diff_heads == [[1], [0], [3]]
    assert "for some heads only" in " ".join(native_problems(model)) and not export_problems(model)


def test_v1_norm_gain_is_calibrated_on_the_selected_heads():
    """The per-head norm acts on the selected heads only, so its gain is RMS(o) / (1 − λ_init) over theirs."""
    from diffattn.train.retrofit import _batches

    src = _standard()
    rcfg = RetrofitConfig(to="diff", steps=4, heads=HEADS, score_batches=2)
    data = Batches(src.config.vocab_size)
    model, _ = retrofit_model(src, rcfg, source=data)
    attn = model.blocks[0].attn  # head 1 of 4 selected
    seen = []
    hook = attn.subln.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    set_retrofit(model, 0.0)
    with torch.no_grad():
        for ids in _batches(data, 2, 0):
            model(ids)
    hook.remove()
    sel = torch.stack([o[:, 1].pow(2).mean() for o in seen]).mean().sqrt() / (1 - attn.lambda_init)
    every = torch.stack([o.pow(2).mean() for o in seen]).mean().sqrt() / (1 - attn.lambda_init)
    assert float(attn.subln.weight[0].detach()) == pytest.approx(float(sel), rel=1e-5)
    assert abs(float(sel) - float(every)) > 1e-3 * float(every)  # the test could tell them apart
