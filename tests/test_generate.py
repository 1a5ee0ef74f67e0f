"""generate(): cached decoding == full recompute, sampling filters, reproducibility, streaming, the CLI."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from diffattn.attention.registry import ATTENTION
from diffattn.cli.generate import add_arguments, run
from diffattn.model import tokenizer as T
from diffattn.model.config import ModelConfig
from diffattn.model.generate import StreamDecoder, filter_logits, generate, generate_batch, sample_next
from diffattn.model.transformer import TransformerLM
from diffattn.system.untrusted import printable_text

PROMPT = [3, 1, 4, 1, 5]


def tiny_lm(attention: str = "standard", gqa: bool = False, vocab_size: int = 50, max_seq_len: int = 24,
            seed: int = 0) -> TransformerLM:
    """A tiny random LM. init_std 0.3 (not 0.02) so the greedy continuation depends on the context instead of
    repeating one token, which would make cache-vs-recompute comparisons nearly vacuous."""
    torch.manual_seed(seed)
    n_heads = 2 if ATTENTION[attention].head_split == 2 else 4
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=n_heads,
                      n_kv_heads=n_heads // 2 if gqa else None, attention=attention, max_seq_len=max_seq_len,
                      init_std=0.3)
    return TransformerLM(cfg)


# --------------------------------------------------------------------------------------------- cache oracle
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_greedy_cached_equals_recompute(attention, gqa):
    n_new = 24 - len(PROMPT)  # fill the context exactly: the last step uses the last cache slot
    # the first of a few random models whose greedy continuation is context-dependent (more than 3 distinct
    # tokens), so the comparison means something; a tiny random model sometimes falls into a short cycle
    for seed in range(5):
        model = tiny_lm(attention, gqa, seed=seed)
        full = generate(model, PROMPT, n_new, temperature=0, use_cache=False)
        if len(set(full)) > 3:
            break
    assert len(set(full)) > 3, "no context-dependent continuation in 5 random models"
    cached = generate(model, PROMPT, n_new, temperature=0)
    assert len(cached) == n_new
    assert cached == full
    # and the oracle itself is right: each greedy token is the argmax of one plain forward over the sequence
    seq = torch.tensor([PROMPT + cached])
    with torch.no_grad():
        logits = model(seq)
    assert logits[0, len(PROMPT) - 1:-1].argmax(-1).tolist() == cached


def test_generate_restores_state_and_accepts_tensors():
    model = tiny_lm()
    model.train()
    a = generate(model, torch.tensor([PROMPT]), 6, temperature=0)
    assert model.training and all(b.attn.cache is None for b in model.blocks)
    assert generate(model, torch.tensor(PROMPT), 6, temperature=0) == a
    assert generate(model, PROMPT, 0) == []


# --------------------------------------------------------------------------------------------- past the context
def sliding_reference(model, prompt, n_new, keep):
    """Greedy decoding written from the rule alone: the window starts on the last L prompt tokens; when it
    holds L tokens and must grow, it restarts on the last ``keep``; each token is the argmax of one plain
    forward (no cache, positions 0..) over the window."""
    ctx = model.config.max_seq_len
    seq, start = list(prompt), max(0, len(prompt) - ctx)
    with torch.no_grad():
        for _ in range(n_new):
            if len(seq) - start > ctx:
                start = len(seq) - keep
            seq.append(int(model(torch.tensor([seq[start:]]))[0, -1].argmax()))
    return seq[len(prompt):]


def nanogpt_crop(model, prompt, n_new):
    """nanoGPT's generate: every step feeds the last max_seq_len tokens."""
    ctx = model.config.max_seq_len
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            seq.append(int(model(torch.tensor([seq[-ctx:]]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_generates_three_times_the_context(attention, one_thread):
    model = tiny_lm(attention, max_seq_len=16)
    n_new = 3 * 16  # prompt + new = 53 tokens: the window restarts 5 times (every 16 - 8 + 1 = 9 tokens)
    cached = generate(model, PROMPT, n_new, temperature=0)
    assert len(cached) == n_new
    assert cached == generate(model, PROMPT, n_new, temperature=0, use_cache=False)
    assert cached == sliding_reference(model, PROMPT, n_new, keep=8)
    assert len(set(cached[16:])) > 3  # still context-dependent after the restarts
    # window_keep = context: nanoGPT's crop exactly, through the cache
    assert generate(model, PROMPT, n_new, temperature=0, window_keep=16) == nanogpt_crop(model, PROMPT, n_new)


def test_sliding_window_details(one_thread):
    model = tiny_lm("diff", max_seq_len=16)
    # keep = 1: the window restarts on the last token alone
    assert generate(model, PROMPT, 40, temperature=0, window_keep=1) == sliding_reference(model, PROMPT, 40, 1)
    # a prompt longer than the context: the window starts on its last 16 tokens
    long_prompt = [(7 * i) % 50 for i in range(40)]
    out = generate(model, long_prompt, 20, temperature=0, window_keep=5)
    assert out == sliding_reference(model, long_prompt, 20, 5)
    assert generate(model, long_prompt[-16:], 1, temperature=0) == out[:1]
    # sampling draws the same numbers with or without the cache, past the context too
    a = generate(model, PROMPT, 40, temperature=1.2, top_k=8, seed=3)
    assert a == generate(model, PROMPT, 40, temperature=1.2, top_k=8, seed=3, use_cache=False)
    # the first new token never depends on the sliding
    assert generate(model, PROMPT, 40, temperature=0)[:11] == generate(model, PROMPT, 11, temperature=0)


# --------------------------------------------------------------------------------------------- sampling
def test_top_k_1_equals_greedy():
    model = tiny_lm("diff")
    greedy = generate(model, PROMPT, 12, temperature=0)
    for seed in (0, 1):
        assert generate(model, PROMPT, 12, temperature=1.3, top_k=1, seed=seed) == greedy


def test_top_p_keeps_smallest_set_with_mass_at_least_p():
    # probabilities that are exact binary fractions, in shuffled order, so the cut-offs are exact
    probs = torch.tensor([0.0625, 0.5, 0.0625, 0.125, 0.25])
    logits = probs.log()
    by_rank = [1, 4, 3]  # indices of 0.5, 0.25, 0.125

    def kept(p):
        return set(torch.nonzero(torch.isfinite(filter_logits(logits, top_p=p))).flatten().tolist())

    assert kept(0.3) == {by_rank[0]}  # 0.5 alone already has mass >= 0.3
    assert kept(0.5) == {by_rank[0]}  # mass exactly p is enough
    assert kept(0.75) == set(by_rank[:2])  # 0.5 + 0.25 = 0.75 >= 0.75
    assert kept(0.76) == set(by_rank[:3])  # needs 0.125 too
    k = kept(0.9)  # 0.875 < 0.9 <= 0.9375: exactly one of the two tied 0.0625s joins
    assert len(k) == 4 and set(by_rank[:3]) <= k
    assert kept(1.0) == set(range(5))
    # kept logits are untouched, so the renormalised distribution is p_i / (mass of the nucleus)
    z = filter_logits(logits, top_p=0.76)
    renorm = torch.softmax(z, -1)
    for i in by_rank[:3]:
        assert math.isclose(renorm[i].item(), probs[i].item() / 0.875, rel_tol=1e-6)


def test_top_p_batched_rows_and_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    z = filter_logits(logits, top_k=2)
    assert torch.isfinite(z).tolist() == [[False, False, True, True], [True, True, False, False]]
    assert torch.equal(z[torch.isfinite(z)], torch.tensor([2.0, 3.0, 3.0, 2.0]))
    # top-p on each row independently; p tiny keeps only the argmax
    z = filter_logits(logits, top_p=1e-6)
    assert torch.isfinite(z).sum(-1).tolist() == [1, 1] and z.argmax(-1).tolist() == [3, 0]


def test_sample_next_only_draws_from_the_nucleus():
    probs = torch.tensor([0.0625, 0.5, 0.0625, 0.125, 0.25])
    g = torch.Generator().manual_seed(0)
    draws = [sample_next(probs.log(), 1.0, None, 0.75, g) for _ in range(300)]
    assert set(draws) == {1, 4}
    # renormalised: P(1) = 0.5 / 0.75 = 2/3; 300 draws put the count within ~5 sd of 200
    assert abs(draws.count(1) - 200) < 5 * math.sqrt(300 * (2 / 3) * (1 / 3))
    assert sample_next(probs.log(), 0.0, None, None, None) == 1


def test_seeded_sampling_is_reproducible():
    model = tiny_lm("diff_v2")
    a = generate(model, PROMPT, 15, temperature=1.5, seed=123)
    assert generate(model, PROMPT, 15, temperature=1.5, seed=123) == a
    assert generate(model, PROMPT, 15, temperature=1.5, seed=123, use_cache=False) == a
    assert generate(model, PROMPT, 15, temperature=1.5, seed=124) != a
    assert generate(model, PROMPT, 15, temperature=1.5, top_k=5, top_p=0.9, seed=7) == \
        generate(model, PROMPT, 15, temperature=1.5, top_k=5, top_p=0.9, seed=7)


def test_stop_ids_and_on_token():
    model = tiny_lm()
    full = generate(model, PROMPT, 15, temperature=0)
    stop = full[4]
    first = full.index(stop)
    seen = []
    out = generate(model, PROMPT, 15, temperature=0, stop_ids=[stop], on_token=seen.append)
    assert out == full[:first + 1] and seen == out


def test_generate_errors():
    model = tiny_lm(max_seq_len=24)
    with pytest.raises(ValueError, match=r"window_keep must be an int in \[1, max_seq_len = 24\], got 25"):
        generate(model, PROMPT, 30, window_keep=25)
    with pytest.raises(ValueError, match="window_keep must be"):
        generate(model, PROMPT, 30, window_keep=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="token id 50 is out of range"):
        generate(model, [1, 50], 3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, PROMPT, 3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        generate(model, PROMPT, 3, top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        generate(model, PROMPT, 3, top_p=1.5)


# --------------------------------------------------------------------------------------------- streaming
STREAM_TEXT = "añb 日本 🙂 ok é🚀x\n" * 4


def test_stream_decoder_reassembles_multibyte_characters():
    tok = T.build_tokenizer("bpe", STREAM_TEXT, vocab_size=262)  # few merges: multi-byte chars stay split
    ids = tok.encode(STREAM_TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # precondition: some tokens are partial characters
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == STREAM_TEXT
    assert not any("\ufffd" in p for p in pieces)


# --------------------------------------------------------------------------------------------- CLI
def _save(tmp_path, tok, attention="diff"):
    ck = pytest.importorskip("diffattn.checkpoint.format")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, attention=attention,
                      max_seq_len=64, init_std=0.3)
    model = TransformerLM(cfg)
    path = tmp_path / "run" / "ckpt"
    ck.save_checkpoint(path, model, run_config={"task": "lm", "model": cfg.to_dict()}, tokenizer=tok)
    return path, model


def _cli(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(argv))


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_cli_streams_the_decoded_continuation(tmp_path, capsys, kind):
    tok = T.build_tokenizer(kind, STREAM_TEXT, vocab_size=262 if kind == "bpe" else None)
    path, model = _save(tmp_path, tok, attention="diff" if kind == "bpe" else "standard")
    prompt = "añb 日"
    expected = generate(model, tok.encode(prompt), 16, temperature=0)
    # the run directory resolves to its ckpt/ subfolder
    greedy = ["--prompt", prompt, "--max-new-tokens", "16", "--temperature", "0"]
    assert _cli([str(path.parent), *greedy]) == 0
    out = capsys.readouterr().out
    assert out == printable_text(prompt + tok.decode(expected)) + "\n"  # control characters shown escaped
    assert _cli([str(path), *greedy, "--no-cache"]) == 0
    assert capsys.readouterr().out == out
    args = [str(path), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "10",
            "--top-p", "0.95", "--seed", "5"]
    assert _cli(args) == 0
    first = capsys.readouterr().out
    assert _cli(args) == 0
    assert capsys.readouterr().out == first


def test_cli_errors(tmp_path, capsys):
    tok = T.build_tokenizer("char", STREAM_TEXT)
    path, _ = _save(tmp_path, tok, attention="standard")
    assert _cli([str(tmp_path / "nothing"), "--prompt", "a"]) == 2
    assert "error:" in capsys.readouterr().err
    assert _cli([str(path), "--prompt", "a", "--window-keep", "65"]) == 2
    res = capsys.readouterr()
    assert "--window-keep must be in [1, 64]" in res.err and res.out == ""
    assert _cli([str(path), "--prompt", "Z"]) == 2  # not in the char vocabulary
    assert "'Z' (U+005A) at position 0" in capsys.readouterr().err
    assert _cli([str(path), "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_cli_default_length_on_the_tiny_config_slides_the_window(tmp_path, capsys, one_thread):
    """The README command `diffattn generate runs/tiny --prompt ... --max-new-tokens 200` on the packaged tiny
    config (context 128), and the command's default length (also 200), through a real subprocess."""
    from clirun import run_main

    from diffattn.checkpoint.format import save_checkpoint
    from diffattn.configs.run_config import load_run_config

    cfg = load_run_config("tiny")
    tok = T.build_tokenizer("char", STREAM_TEXT)
    cfg = cfg.resolve_model(tok.vocab_size)
    mcfg = cfg.model
    assert mcfg.max_seq_len == 128
    torch.manual_seed(0)
    run = tmp_path / "runs" / "tiny"
    save_checkpoint(run / "ckpt", TransformerLM(mcfg), run_config=cfg.to_dict(), tokenizer=tok)
    res = run_main("generate", run, "--prompt", "ok", "--max-new-tokens", "200", "--temperature", "0.8",
                       "--top-k", "20", "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout) == len("ok") + 200 + 1 and res.stdout.startswith("ok")  # char tokenizer: 1 char/token
    assert "the window slides, keeping the last 64 tokens" in res.stderr
    assert _cli([str(run / "ckpt"), "--prompt", "ok", "--temperature", "0"]) == 0  # the default length
    assert len(capsys.readouterr().out) == len("ok") + 200 + 1


# --------------------------------------------------------------------------------------------- batched (issue 23)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_generate_batch_rows_equal_one_prompt_at_a_time(attention, gqa, one_thread):
    """Left-padded prompts of different lengths, one prefill and one decode step per token for all rows: each
    row's greedy continuation is the one generate() gives that prompt alone (padding masked, positions shifted,
    neither visible), and a row that meets its stop rule ends there while the others go on."""
    model = tiny_lm(attention, gqa)
    prompts = [PROMPT, [7, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1], [11]]
    rows = generate_batch(model, prompts, 10)
    for p, row in zip(prompts, rows):
        assert row == generate(model, p, 10, temperature=0)
    assert len({tuple(r) for r in rows}) > 1
    # row 1 stops after its third token; the others still get all ten
    stopped = generate_batch(model, prompts, 10, should_stop=lambda i, ids: i == 1 and len(ids) == 3)
    assert stopped[1] == rows[1][:3] and [len(r) for r in stopped] == [10, 3, 10, 10]
    assert all(b.attn.cache is None for b in model.blocks)


def test_generate_batch_samples_reproducibly_and_checks_its_input():
    model = tiny_lm()
    draw = lambda: generate_batch(model, [PROMPT, [1]], 6, temperature=1.0, top_k=5,  # noqa: E731
                                  generator=torch.Generator().manual_seed(3))
    assert draw() == draw()
    with pytest.raises(ValueError, match="exceed the context"):
        generate_batch(model, [PROMPT], 24)
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, [PROMPT, []], 2)
