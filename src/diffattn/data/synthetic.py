"""Synthetic retrieval tasks (generated, seeded, no download): multi-needle retrieval and associative recall.

Token layout (shared by both tasks; ids are fixed so checkpoints and evaluation sets agree)::

    0 PAD   1 BOS   2 NDL (needle marker)   3 QRY (query marker)   4..7 reserved
    keys        [8, 8 + n_keys)
    values      [8 + n_keys, 8 + n_keys + n_values)
    distractors [8 + n_keys + n_values, ... + n_distractors)

Needle sequence of context length L (the model input has L tokens; the last answer is the L+1-th token)::

    [PAD …] BOS  haystack(distractors, with N needles "NDL k v" inserted)  QRY k_1 v_1  …  QRY k_R v_R

Keys inside one sequence are distinct, so every query has one answer. Loss (targets != -100) only where the
next token is an answer ``v_r``, i.e. at the query key's position. Depth d ∈ [0, 1] places a needle's first
token at ``round(d · (C − 3))`` inside the haystack of C tokens: 0 right after BOS, 1 just before the queries.

Training batches draw N ∈ [1, max_needles], R ∈ [1, min(max_queries, N)], random depths and an effective
length in [min_len, seq_len] (shorter sequences are left-padded with PAD, outside the loss), so one model
covers every (depth, length, N, R) cell the evaluation grid asks about.

Associative recall::

    [PAD …] BOS  k_1 v_1  k_2 v_2 …  k_n v_n  QRY k_q   -> answer v_q  (keys distinct)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, NDL, QRY = 0, 1, 2, 3
N_SPECIAL = 8
NEEDLE_LEN = 3  # NDL, key, value


@dataclass(frozen=True)
class Vocab:
    n_keys: int = 32
    n_values: int = 32
    n_distractors: int = 64

    def __post_init__(self) -> None:
        for name in ("n_keys", "n_values", "n_distractors"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def key0(self) -> int:
        return N_SPECIAL

    @property
    def value0(self) -> int:
        return N_SPECIAL + self.n_keys

    @property
    def distractor0(self) -> int:
        return N_SPECIAL + self.n_keys + self.n_values

    @property
    def size(self) -> int:
        return self.distractor0 + self.n_distractors


def _randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform int in [lo, hi] (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _place(g: torch.Generator, room: int, count: int) -> list[int]:
    """Sorted starts of ``count`` non-overlapping needles in ``room`` tokens, uniform over placements
    (stars and bars: choose ``count`` of ``room − 2·count`` slots, then shift slot i right by 2i)."""
    if count == 0:
        return []
    slots = sorted(torch.randperm(room - (NEEDLE_LEN - 1) * count, generator=g)[:count].tolist())
    return [c + (NEEDLE_LEN - 1) * i for i, c in enumerate(slots)]


@dataclass
class NeedleSample:
    """One needle sequence: ``seq`` has length + 1 tokens (inputs = seq[:-1], the last answer = seq[-1])."""

    seq: list[int]
    answer_pos: list[int]  # input index of each query key (its target is the answer), query order
    answers: list[int]
    span_start: list[int]  # input index of the NDL token of each queried needle, query order
    query_start: int  # input index of the first QRY token (the context ends here)


class NeedleData:
    """Multi-needle retrieval as a :class:`diffattn.data.lm.BatchSource` (layout: see the module docstring).

    ``get_batch(split, B, generator)`` -> inputs, targets (B, seq_len); split does not change the distribution
    (the data are synthetic), the caller's generator does.
    """

    name = "needle"

    def __init__(
        self,
        seq_len: int,
        *,
        max_needles: int = 6,
        max_queries: int = 2,
        min_len: int | None = None,
        n_keys: int = 32,
        n_values: int = 32,
        n_distractors: int = 64,
    ):
        self.vocab = Vocab(n_keys, n_values, n_distractors)
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if not 1 <= max_queries <= max_needles:
            raise ValueError(f"need 1 <= max_queries ({max_queries}) <= max_needles ({max_needles})")
        if max_needles > n_keys:
            raise ValueError(f"max_needles ({max_needles}) exceeds n_keys ({n_keys}): keys must be distinct")
        self.seq_len = seq_len
        self.max_needles = max_needles
        self.max_queries = max_queries
        self.min_len = (
            min_len if min_len is not None else max(self.min_length(max_needles, max_queries), seq_len // 4)
        )
        need = self.min_length(max_needles, max_queries)
        if not need <= self.min_len <= seq_len:
            raise ValueError(
                f"min_len ({self.min_len}) must be in [{need}, seq_len={seq_len}]: {max_needles} needles "
                f"and {max_queries} queries need at least {need} tokens"
            )
        self.vocab_size = self.vocab.size

    @staticmethod
    def min_length(n_needles: int, n_queries: int) -> int:
        """Shortest context length that holds BOS, the needles and the queries."""
        return 1 + NEEDLE_LEN * n_needles + 3 * n_queries - 1

    @staticmethod
    def _haystack(length: int, n_queries: int) -> int:
        """Haystack tokens between BOS and the first QRY in a context of ``length`` input tokens."""
        return length + 1 - 1 - 3 * n_queries

    @staticmethod
    def _around(ctx: int, n_needles: int, depth: float) -> tuple[int, int, int, int, int]:
        """Needle 0 at ``depth`` in a ``ctx``-token haystack: its start, the free tokens left and right of it,
        and the fewest / most of the other needles that fit on its left."""
        s0 = round(depth * (ctx - NEEDLE_LEN))
        left, right = s0, ctx - s0 - NEEDLE_LEN
        rest = n_needles - 1
        return s0, left, right, max(0, rest - right // NEEDLE_LEN), min(rest, left // NEEDLE_LEN)

    def fits(self, length: int, n_needles: int, n_queries: int, depths: Sequence[float]) -> bool:
        """Whether :meth:`sample` can place ``n_needles`` with the queried one at every depth in ``depths``
        in a context of ``length`` (deterministic: the placement rule, not a draw)."""
        if length < self.min_length(n_needles, n_queries):
            return False
        ctx = self._haystack(length, n_queries)
        return all(lo <= hi for *_, lo, hi in (self._around(ctx, n_needles, d) for d in depths))

    def shortest_fit(self, n_needles: int, n_queries: int, depths: Sequence[float], at_least: int = 1) -> int:
        """The shortest length >= ``at_least`` (and <= seq_len) where :meth:`fits` holds."""
        for length in range(max(at_least, self.min_length(n_needles, n_queries)), self.seq_len + 1):
            if self.fits(length, n_needles, n_queries, depths):
                return length
        raise ValueError(
            f"{n_needles} needles ({n_queries} queried) at depths {list(depths)} do not fit in "
            f"seq_len {self.seq_len}"
        )

    def sample(
        self, g: torch.Generator, length: int, n_needles: int, n_queries: int, depth: float | None = None
    ) -> NeedleSample:
        """One sequence of ``length`` input tokens. ``depth`` (if given) places the first queried needle."""
        if n_queries > n_needles:
            raise ValueError(f"n_queries ({n_queries}) > n_needles ({n_needles})")
        if n_needles > self.vocab.n_keys:
            raise ValueError(f"n_needles ({n_needles}) exceeds n_keys ({self.vocab.n_keys})")
        if length < self.min_length(n_needles, n_queries):
            raise ValueError(
                f"length {length} too short for {n_needles} needles and {n_queries} queries "
                f"(need >= {self.min_length(n_needles, n_queries)})"
            )
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        v = self.vocab
        ctx = self._haystack(length, n_queries)
        keys = (torch.randperm(v.n_keys, generator=g)[:n_needles] + v.key0).tolist()
        vals = (torch.randint(0, v.n_values, (n_needles,), generator=g) + v.value0).tolist()
        hay = (torch.randint(0, v.n_distractors, (ctx,), generator=g) + v.distractor0).tolist()
        # Needle starts: needle 0 at the depth (if given), the others uniform over non-overlapping placements.
        if depth is None:
            starts = _place(g, ctx, n_needles)
            order = torch.randperm(n_needles, generator=g).tolist()
            starts = [starts[i] for i in order]
        else:
            s0, left, right, lo, hi = self._around(ctx, n_needles, depth)
            rest = n_needles - 1
            if lo > hi:
                raise ValueError(
                    f"cannot fit {n_needles} needles around one at depth {depth} in a {ctx}-token "
                    f"haystack (length {length}); use a longer length or fewer needles"
                )
            # Split the other needles between the two sides in proportion to their room (clipped to fit).
            p_left = left / max(1, left + right)
            n_left = sum(int(torch.rand((), generator=g) < p_left) for _ in range(rest))
            n_left = min(hi, max(lo, n_left))
            starts = (
                [s0]
                + _place(g, left, n_left)
                + [s0 + NEEDLE_LEN + p for p in _place(g, right, rest - n_left)]
            )
        for i, s in enumerate(starts):
            hay[s : s + NEEDLE_LEN] = [NDL, keys[i], vals[i]]
        # Queried needles: needle 0 first (it carries the depth), then R-1 others in random order.
        others = (torch.randperm(n_needles - 1, generator=g)[: n_queries - 1] + 1).tolist()
        queried = [0] + others
        seq = [BOS] + hay
        answer_pos, answers, span_start = [], [], []
        query_start = len(seq)
        for i in queried:
            seq += [QRY, keys[i]]
            answer_pos.append(len(seq) - 1)
            answers.append(vals[i])
            span_start.append(1 + starts[i])
            seq.append(vals[i])
        assert len(seq) == length + 1
        return NeedleSample(seq, answer_pos, answers, span_start, query_start)

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        t = self.seq_len
        inputs = torch.full((batch_size, t), PAD, dtype=torch.long)
        targets = torch.full((batch_size, t), -100, dtype=torch.long)
        for b in range(batch_size):
            n = _randint(generator, 1, self.max_needles)
            r = _randint(generator, 1, min(self.max_queries, n))
            length = _randint(generator, max(self.min_len, self.min_length(n, r)), t)
            s = self.sample(generator, length, n, r)
            off = t - length  # left padding keeps the queries at the end
            seq = torch.tensor(s.seq)
            inputs[b, off:] = seq[:-1]
            targets[b, [off + p for p in s.answer_pos]] = torch.tensor(s.answers)
        return inputs, targets


class AssocRecallData:
    """Associative recall as a BatchSource: ``BOS k1 v1 … kn vn QRY kq`` -> ``vq`` (loss on the answer)."""

    name = "assoc_recall"

    def __init__(
        self,
        seq_len: int,
        *,
        n_pairs: int | None = None,
        min_pairs: int = 2,
        n_keys: int = 32,
        n_values: int = 32,
        n_distractors: int = 1,
    ):
        self.vocab = Vocab(n_keys, n_values, n_distractors)
        max_pairs = (seq_len - 3) // 2  # inputs: BOS + 2n pair tokens + QRY + kq <= seq_len
        if max_pairs < 1:
            raise ValueError(f"seq_len {seq_len} too short for associative recall (need >= 5)")
        n_pairs = min(max_pairs, n_keys) if n_pairs is None else n_pairs
        if not 1 <= n_pairs <= min(max_pairs, n_keys):
            raise ValueError(
                f"n_pairs must be in [1, {min(max_pairs, n_keys)}] for seq_len {seq_len} and "
                f"n_keys {n_keys}, got {n_pairs}"
            )
        if not 1 <= min_pairs <= n_pairs:
            min_pairs = n_pairs
        self.seq_len, self.n_pairs, self.min_pairs = seq_len, n_pairs, min_pairs
        self.vocab_size = self.vocab.size

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        v, t = self.vocab, self.seq_len
        inputs = torch.full((batch_size, t), PAD, dtype=torch.long)
        targets = torch.full((batch_size, t), -100, dtype=torch.long)
        for b in range(batch_size):
            n = _randint(generator, self.min_pairs, self.n_pairs)
            keys = torch.randperm(v.n_keys, generator=generator)[:n] + v.key0
            vals = torch.randint(0, v.n_values, (n,), generator=generator) + v.value0
            q = _randint(generator, 0, n - 1)
            body = torch.stack((keys, vals), dim=1).flatten()
            seq = torch.cat((torch.tensor([BOS]), body, torch.tensor([QRY, int(keys[q])])))
            inputs[b, t - len(seq) :] = seq
            targets[b, t - 1] = vals[q]
        return inputs, targets


SYNTHETIC = {"needle": NeedleData, "assoc_recall": AssocRecallData}


def make_synthetic(name: str, seq_len: int, **params) -> NeedleData | AssocRecallData:
    """Build a synthetic task BatchSource by name ("needle", "assoc_recall"); ``params`` go to its class."""
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic task {name!r}; available: {sorted(SYNTHETIC)}")
    try:
        return SYNTHETIC[name](seq_len, **params)
    except TypeError as e:  # an unknown keyword: say which task rejected it
        raise ValueError(f"bad parameters for task {name!r}: {e}") from None


# ------------------------------------------------------------------------------------------- evaluation
@dataclass
class NeedleCell:
    """A fixed evaluation cell: n sequences at one (depth, length, N needles, R queries).

    inputs (n, L); answer_pos, answers, span_start (n, R) in query order (column 0: the needle at ``depth``);
    query_start (n,): where the queries begin (positions before it are the context).
    """

    depth: float
    length: int
    n_needles: int
    n_queries: int
    inputs: Tensor
    answer_pos: Tensor
    answers: Tensor
    span_start: Tensor
    query_start: Tensor


def needle_eval_set(
    task: NeedleData,
    depths: Sequence[float],
    lengths: Sequence[int],
    *,
    n_needles: int = 1,
    n_queries: int = 1,
    n_samples: int = 32,
    seed: int = 0,
) -> list[NeedleCell]:
    """One :class:`NeedleCell` per (depth, length), generated from ``seed`` (same seed -> same set)."""
    g = torch.Generator().manual_seed(seed)
    cells = []
    for length in lengths:
        for depth in depths:
            samples = [task.sample(g, length, n_needles, n_queries, depth=depth) for _ in range(n_samples)]
            cells.append(
                NeedleCell(
                    depth=float(depth),
                    length=int(length),
                    n_needles=n_needles,
                    n_queries=n_queries,
                    inputs=torch.tensor([s.seq[:-1] for s in samples]),
                    answer_pos=torch.tensor([s.answer_pos for s in samples]),
                    answers=torch.tensor([s.answers for s in samples]),
                    span_start=torch.tensor([s.span_start for s in samples]),
                    query_start=torch.tensor([s.query_start for s in samples]),
                )
            )
    return cells


@torch.no_grad()
def cell_correct(model: torch.nn.Module, cell: NeedleCell, batch_size: int = 64) -> Tensor:
    """(n, R) bool: greedy (argmax) answer == true answer at each query (answers are single tokens)."""
    out = []
    for i in range(0, len(cell.inputs), batch_size):
        ids = cell.inputs[i : i + batch_size]
        dev = next(model.parameters()).device
        logits = model(ids.to(dev)).float().cpu()  # (b, L, V)
        pos = cell.answer_pos[i : i + batch_size]
        pred = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)  # (b, R)
        out.append(pred == cell.answers[i : i + batch_size])
    return torch.cat(out)


def needle_accuracy(model: torch.nn.Module, cells: Sequence[NeedleCell]) -> dict[tuple[float, int], float]:
    """Exact-match accuracy over all queried answers of each cell, keyed by (depth, length)."""
    was = model.training
    model.eval()
    try:
        return {(c.depth, c.length): cell_correct(model, c).float().mean().item() for c in cells}
    finally:
        model.train(was)
