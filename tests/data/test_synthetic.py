"""Synthetic retrieval tasks: layout, depths, seeding, loss masking, and needle_accuracy against an oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from diffattn.data.synthetic import (
    BOS,
    NDL,
    NEEDLE_LEN,
    QRY,
    NeedleData,
    make_synthetic,
    needle_accuracy,
    needle_eval_set,
)


def _check_sample(task: NeedleData, s, length: int, n_needles: int, n_queries: int) -> None:
    v = task.vocab
    seq = s.seq
    assert len(seq) == length + 1 and seq[0] == BOS
    assert seq.count(NDL) == n_needles and seq.count(QRY) == n_queries
    keys = [seq[i + 1] for i, t in enumerate(seq) if t == NDL]
    assert len(set(keys)) == n_needles, "keys in one sequence must be distinct"
    assert all(v.key0 <= k < v.value0 for k in keys)
    for pos, ans, start in zip(s.answer_pos, s.answers, s.span_start):
        key = seq[pos]
        assert seq[pos - 1] == QRY and seq[pos + 1] == ans  # the query, then its answer
        assert seq[start : start + NEEDLE_LEN] == [NDL, key, ans]  # the needle really is in the context
        assert start < s.query_start
        assert v.value0 <= ans < v.distractor0
    hay = [t for i, t in enumerate(seq[1 : s.query_start]) if t >= v.distractor0]
    assert len(hay) == s.query_start - 1 - NEEDLE_LEN * n_needles  # everything else is distractors


@pytest.mark.parametrize("length,n,r", [(16, 1, 1), (40, 4, 2), (64, 6, 2), (24, 6, 2)])
def test_needle_sample_layout(length, n, r):
    task = make_synthetic("needle", 64)
    g = torch.Generator().manual_seed(3)
    for depth in (None, 0.0, 0.3, 1.0):
        if depth is not None and n > 1 and length == 24:
            continue  # a fixed depth in a packed haystack may not leave room; tested below
        _check_sample(task, task.sample(g, length, n, r, depth=depth), length, n, r)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_depth_is_honoured(depth):
    task = make_synthetic("needle", 128)
    cells = needle_eval_set(task, [depth], [48, 128], n_needles=3, n_queries=2, n_samples=5, seed=1)
    for c in cells:
        ctx = c.query_start - 1  # haystack tokens between BOS and the first query
        expect = torch.tensor([1 + round(depth * (int(n) - NEEDLE_LEN)) for n in ctx])
        assert torch.equal(c.span_start[:, 0], expect)
        if depth == 0.0:
            assert (c.span_start[:, 0] == 1).all()  # right after BOS
        if depth == 1.0:
            assert (c.span_start[:, 0] + NEEDLE_LEN == c.query_start).all()  # right before the queries
        # The first queried needle is the one at the depth: its key is the first query's key.
        rows = torch.arange(len(c.inputs))
        assert torch.equal(c.inputs[rows, c.span_start[:, 0] + 1], c.inputs[rows, c.answer_pos[:, 0]])
        assert torch.equal(c.inputs[rows, c.span_start[:, 0] + 2], c.answers[:, 0])


def test_no_room_is_a_clear_error():
    task = make_synthetic("needle", 64)
    with pytest.raises(ValueError, match="cannot fit"):
        task.sample(torch.Generator().manual_seed(0), 24, 6, 2, depth=0.5)
    with pytest.raises(ValueError, match="too short"):
        task.sample(torch.Generator().manual_seed(0), 10, 4, 2)


def test_eval_set_is_seeded():
    task = make_synthetic("needle", 64)
    a = needle_eval_set(task, [0.0, 0.5], [32, 64], n_samples=4, seed=7)
    b = needle_eval_set(task, [0.0, 0.5], [32, 64], n_samples=4, seed=7)
    c = needle_eval_set(task, [0.0, 0.5], [32, 64], n_samples=4, seed=8)
    assert all(torch.equal(x.inputs, y.inputs) and torch.equal(x.answers, y.answers) for x, y in zip(a, b))
    assert any(not torch.equal(x.inputs, z.inputs) for x, z in zip(a, c))


def test_batches_mask_everything_but_answers():
    task = make_synthetic("needle", 48, max_needles=3, max_queries=2)
    x1, y1 = task.get_batch("train", 16, torch.Generator().manual_seed(5))
    x2, y2 = task.get_batch("train", 16, torch.Generator().manual_seed(5))
    x3, _ = task.get_batch("train", 16, torch.Generator().manual_seed(6))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert x1.shape == y1.shape == (16, 48) and x1.dtype == torch.long
    v = task.vocab
    for b in range(16):
        pos = (y1[b] != -100).nonzero().flatten()
        assert 1 <= len(pos) <= 2
        for p in pos.tolist():
            key, ans = int(x1[b, p]), int(y1[b, p])
            assert int(x1[b, p - 1]) == QRY and v.value0 <= ans < v.distractor0
            # The answer is the value right after this key's needle in the context.
            ndl = [i for i in range(p) if int(x1[b, i]) == NDL and int(x1[b, i + 1]) == key]
            assert len(ndl) == 1 and int(x1[b, ndl[0] + 2]) == ans
        assert int(x1[b, -1]) in range(v.key0, v.value0)  # the last input is the final query's key


def test_assoc_recall():
    task = make_synthetic("assoc_recall", 24, n_keys=16, n_values=8)
    x, y = task.get_batch("val", 8, torch.Generator().manual_seed(0))
    assert (y[:, :-1] == -100).all()
    for b in range(8):
        row = x[b].tolist()
        key, ans = row[-1], int(y[b, -1])
        start = row.index(BOS) + 1
        pairs = dict(zip(row[start:-2:2], row[start + 1 : -2 : 2]))
        assert row[-2] == QRY and pairs[key] == ans


def test_make_task_errors():
    with pytest.raises(ValueError, match="unknown synthetic task"):
        make_synthetic("haystack", 32)
    with pytest.raises(ValueError, match="bad parameters"):
        make_synthetic("needle", 32, colour="red")
    with pytest.raises(ValueError, match="max_needles"):
        make_synthetic("needle", 32, max_needles=40)


class _Oracle(nn.Module):
    """Reads the answer from the context: at each position holding a key right after QRY, predicts the value
    that follows the same key after NDL earlier in the sequence. ``wrong`` shifts every prediction by one."""

    def __init__(self, vocab: int, wrong: bool = False):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        b, t = ids.shape
        out = torch.zeros(b, t, self.vocab)
        for i in range(b):
            row = ids[i].tolist()
            for p in range(1, t):
                if row[p - 1] == QRY:
                    hit = [j for j in range(p - 1) if row[j] == NDL and row[j + 1] == row[p]]
                    out[i, p, row[hit[0] + 2] + int(self.wrong)] = 1.0
        return out


def test_needle_accuracy_with_oracle():
    task = make_synthetic("needle", 40, max_needles=3)
    cells = needle_eval_set(task, [0.0, 1.0], [20, 40], n_needles=3, n_queries=2, n_samples=6, seed=2)
    acc = needle_accuracy(_Oracle(task.vocab_size + 1), cells)
    assert set(acc) == {(0.0, 20), (1.0, 20), (0.0, 40), (1.0, 40)}
    assert all(a == 1.0 for a in acc.values())
    assert all(a == 0.0 for a in needle_accuracy(_Oracle(task.vocab_size + 1, wrong=True), cells).values())
