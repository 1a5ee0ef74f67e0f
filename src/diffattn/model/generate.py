"""Sample text from a checkpoint with the static KV cache (`diffattn generate CKPT --prompt "..."`).

``generate(model, prompt_ids, max_new_tokens, ...)`` works with any :class:`~diffattn.model.transformer.TransformerLM`
(every attention type in the registry): it prefills the prompt into the KV cache, then feeds one token per
step. ``use_cache=False`` recomputes the full forward at every step: the oracle the cached path is tested
against.

Sampling, per step, on the last position's logits z (V,):
  temperature 0     greedy: argmax z (top-k / top-p are then irrelevant)
  temperature τ > 0 z / τ, then top-k (keep the k largest logits), then top-p (nucleus: keep the smallest
                    set of most probable tokens whose probability mass is >= p), renormalise, draw from a
                    torch.Generator seeded with ``seed`` (reproducible) or from OS entropy when seed is None.
Past the context (sliding window, like nanoGPT's crop). The model attends to a window ``seq[start:]`` of the
sequence (prompt + generated tokens) of at most L = ``config.max_seq_len`` tokens, always at positions
0..len-1, so RoPE positions stay inside the table and the cache never overflows:
  * a prompt longer than L starts with the window on its last L tokens (start = len(prompt) − L);
  * when the window holds L tokens and one more must be appended, it restarts on the last ``window_keep``
    tokens (default L // 2): start = len(seq) − window_keep. With the cache, the cache is reset and those
    tokens are prefilled again at positions 0..window_keep−1; then decoding continues one token per step.
The next token is always drawn from the logits of the model run on exactly ``seq[start:]``; ``use_cache=False``
computes just that with a full forward at every step, so the cached and uncached paths are the same function
(tested token for token). ``window_keep = L`` is nanoGPT's crop exactly (every step sees the last L tokens,
at the price of re-prefilling L tokens per step once the context is full); a smaller ``window_keep`` re-prefills
only every L − window_keep + 1 steps, and the first tokens after a restart see a shorter context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to -inf every logit outside the top-k and then outside the nucleus of mass top_p.

    logits: (..., V) (already divided by the temperature). Returns a new tensor of the same shape.
    top-k keeps exactly k entries (torch.topk breaks ties). top-p sorts the probabilities
    p_(1) >= p_(2) >= ... and keeps entry i iff the mass strictly before it, sum_{j<i} p_(j), is < top_p:
    the smallest prefix with mass >= top_p (the most probable token is always kept).
    """
    out = logits.clone()
    v = out.shape[-1]
    if top_k is not None and top_k < v:
        kth = torch.topk(out, top_k, dim=-1)
        keep = torch.zeros_like(out, dtype=torch.bool).scatter_(-1, kth.indices, True)
        out = out.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(out.float(), dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        out = out.masked_fill(~keep, float("-inf"))
    return out


def sample_next(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> int:
    """Pick the next token id from logits (V,) with the rules in the module docstring."""
    if temperature == 0:
        return int(torch.argmax(logits))
    z = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(z, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def validate_sampling(temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def default_window_keep(max_seq_len: int) -> int:
    """Tokens kept when the window slides, unless given: half the context (at least 1)."""
    return max(1, max_seq_len // 2)


def slides(n_prompt: int, max_new_tokens: int, max_seq_len: int) -> bool:
    """Whether the window will have to slide (or crop the prompt): the sequence outgrows the context.

    The last new token is never fed back, so the model sees at most n_prompt + max_new_tokens − 1 tokens."""
    return n_prompt > max_seq_len or n_prompt + max_new_tokens - 1 > max_seq_len


def prompt_tokens(prompt_ids: Sequence[int] | Tensor, vocab_size: int) -> list[int]:
    """The prompt (a list or a (P,) / (1, P) tensor of ids) as a list of ints, each checked against the vocabulary;
    ValueError for an empty prompt or an id out of range."""
    ids = prompt_ids.flatten().tolist() if isinstance(prompt_ids, Tensor) else list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token to condition on")
    bad = next((i for i in ids if not 0 <= int(i) < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for the model's vocabulary ({vocab_size})")
    return [int(i) for i in ids]


def checked_window_keep(window_keep: int | None, max_seq_len: int) -> int:
    """Tokens kept when the window slides: ``window_keep``, checked to be in 1..max_seq_len, or the default."""
    keep = default_window_keep(max_seq_len) if window_keep is None else window_keep
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= max_seq_len:
        raise ValueError(f"window_keep must be an int in [1, max_seq_len = {max_seq_len}], got {keep!r}")
    return keep


def sampling_generator(temperature: float, seed: int | None, device: torch.device) -> torch.Generator | None:
    """The generator sampling draws from: seeded with ``seed`` (reproducible) or from OS entropy when it is None;
    None for greedy decoding (temperature 0), which draws nothing."""
    if temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


class SlidingWindow:
    """The sequence (prompt + generated tokens) and the window ``seq[start:]`` of at most ``max_seq_len`` tokens
    the model attends to (module docstring): :meth:`prefill` runs the first window, :meth:`feed` appends a token
    and returns the next logits (1, T, V), from the KV cache one token at a time, or, once the window is full,
    by restarting it on the last ``keep`` tokens. ``use_cache=False``: a full forward on the window every time."""

    def __init__(self, model: nn.Module, seq: list[int], keep: int, cache_len: int, use_cache: bool) -> None:
        self.model, self.seq, self.keep, self.cache_len, self.use_cache = model, seq, keep, cache_len, use_cache
        self.max_seq_len = int(model.config.max_seq_len)
        self.device = next(model.parameters()).device
        self.start = max(0, len(seq) - self.max_seq_len)  # a prompt longer than the context: its last tokens

    def prefill(self) -> Tensor:
        """Logits of the model on seq[start:] at positions 0..; with the cache, a fresh cache prefilled."""
        window = torch.tensor([self.seq[self.start:]], device=self.device)
        if not self.use_cache:
            return self.model(window)
        # a fresh buffer: the window's tokens move to new positions, so nothing cached before is valid
        self.model.setup_cache(1, self.cache_len)
        return self.model(window, input_pos=torch.arange(window.shape[1], device=self.device))

    def feed(self, token: int) -> Tensor:
        """Append ``token``; -> the logits of the model on the window that now ends with it."""
        self.seq.append(token)
        if len(self.seq) - self.start > self.max_seq_len:  # the window is full: restart it on the last `keep`
            self.start = len(self.seq) - self.keep
            return self.prefill()
        if not self.use_cache:
            return self.model(torch.tensor([self.seq[self.start:]], device=self.device))
        pos = torch.tensor([len(self.seq) - 1 - self.start], device=self.device)
        return self.model(torch.tensor([[token]], device=self.device), input_pos=pos)


@contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """The model in eval mode with an empty KV cache for the block; its cache cleared and its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        model.clear_cache()
        yield
    finally:
        model.clear_cache()
        model.train(was_training)


def _below(logits: Tensor, vocab_limit: int | None) -> Tensor:
    """``logits`` (V,) with every id from ``vocab_limit`` on set to -inf (ids the tokenizer cannot decode)."""
    if vocab_limit is None or vocab_limit >= logits.shape[-1]:
        return logits
    logits = logits.clone()
    logits[vocab_limit:] = float("-inf")
    return logits


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, use_cache: bool = True, stop_ids: Iterable[int] | None = None,
             on_token: Callable[[int], None] | None = None, window_keep: int | None = None,
             vocab_limit: int | None = None) -> list[int]:
    """Continue ``prompt_ids`` (a list or a (P,) / (1, P) tensor of ids) by up to ``max_new_tokens`` tokens.

    Returns the new tokens only (not the prompt). Generation stops early after emitting an id in ``stop_ids``
    (that id is included). ``on_token(id)`` is called for every new token as soon as it is chosen (streaming).
    Past ``config.max_seq_len`` the context window slides (module docstring), keeping the last
    ``window_keep`` tokens (1..max_seq_len, default max_seq_len // 2) at each restart.
    The model is put in eval mode for the call and restored afterwards; the KV cache is cleared on return.
    ``vocab_limit``: sample only ids below it (a model whose embedding table is padded beyond its tokenizer's
    vocabulary, as converted Llamas often are, must not emit ids the tokenizer cannot decode).
    """
    validate_sampling(temperature, top_k, top_p, max_new_tokens)
    max_seq_len = int(model.config.max_seq_len)
    keep = checked_window_keep(window_keep, max_seq_len)
    seq = prompt_tokens(prompt_ids, model.config.vocab_size)
    stops = set(int(s) for s in stop_ids) if stop_ids is not None else set()
    generator = sampling_generator(temperature, seed, next(model.parameters()).device)
    # the cache holds the longest window this call can reach
    window = SlidingWindow(model, seq, keep, min(max_seq_len, len(seq) + max_new_tokens), use_cache)
    new: list[int] = []
    with inference(model):
        logits = window.prefill() if max_new_tokens > 0 else None
        for step in range(max_new_tokens):
            token = sample_next(_below(logits[0, -1], vocab_limit), temperature, top_k, top_p, generator)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if token in stops or step == max_new_tokens - 1:
                break
            logits = window.feed(token)
    return new


@torch.no_grad()
def generate_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                   generator: torch.Generator | None = None,
                   should_stop: Callable[[int, list[int]], bool] | None = None, pad_id: int = 0) -> list[list[int]]:
    """Continue every prompt of a batch by up to ``max_new_tokens`` tokens, all rows at once on the KV cache.

    The prompts are left-padded to the longest, the padding masked out of every attention map (a padded row
    then computes what it computes alone: attention sees relative positions only, RoPE and distance alike;
    tested against :func:`generate` for every attention type), one prefill, then one token per step for every
    row. Row i is finished after ``max_new_tokens`` tokens or once ``should_stop(i, its new ids)`` is true;
    the call returns when every row is. Returns each row's new ids (the token that stopped it included).

    The window does not slide here: the longest prompt plus ``max_new_tokens`` must fit in
    ``config.max_seq_len`` (truncate the prompts first; :func:`generate` slides, one prompt at a time).
    Sampling as in :func:`sample_next`, row-wise, drawing from ``generator`` (temperature 0: greedy)."""
    validate_sampling(temperature, top_k, top_p, max_new_tokens)
    cfg = model.config
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) == 0:
        raise ValueError("generate_batch needs at least one prompt, and every prompt at least one token")
    n, width = len(prompts), max(lengths)
    if width + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"the longest prompt ({width} tokens) plus max_new_tokens ({max_new_tokens}) exceed the "
                         f"context ({cfg.max_seq_len}); truncate the prompts")
    device = next(model.parameters()).device
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)
    keep = torch.zeros((n, width + max_new_tokens), dtype=torch.bool, device=device)  # (B, cache slots)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        keep[i, width - len(p):] = True  # the generated slots after the prompt are real too
    new: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * n
    with inference(model):
        model.setup_cache(n, width + max_new_tokens)
        logits = model(ids, input_pos=torch.arange(width, device=device), attn_mask=keep)[:, -1]
        for step in range(max_new_tokens):
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                z = filter_logits(logits.float() / temperature, top_k, top_p)
                tok = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator)[:, 0]
            for i, t in enumerate(tok.tolist()):
                if not done[i]:
                    new[i].append(t)
                    done[i] = len(new[i]) == max_new_tokens or (should_stop is not None and should_stop(i, new[i]))
            if all(done):
                break
            pos = torch.tensor([width + step], device=device)
            logits = model(tok[:, None], input_pos=pos, attn_mask=keep)[:, -1]
    return new


class StreamDecoder:
    """Turns a stream of token ids into printable text pieces.

    Byte-level BPE tokens may end inside a multi-byte UTF-8 character, so decoding token by token would print
    U+FFFD halves. Pending ids are held back while their decoded text ends in U+FFFD (an incomplete
    character), up to ``max_pending`` ids (a genuinely invalid byte sequence is then printed as is).
    Concatenating every ``push`` result and the final ``flush`` gives ``tokenizer.decode(all ids)`` for
    byte-level decoders.
    """

    def __init__(self, tokenizer, max_pending: int = 8):
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        self.pending.append(int(token_id))
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < self.max_pending:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending = []
        return text
