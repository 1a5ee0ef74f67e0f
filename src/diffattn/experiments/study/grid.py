"""``diffattn compare --data``: a fair, budgeted, resumable DIFF-vs-baseline experiment on a text corpus.

The experiment is a grid of *cells*, arm × learning rate × seed (and, with ``--sizes``, a ladder of model
sizes per arm at its best learning rate). A cell is an ordinary run folder ``OUT/cells/<arm>-lr<lr>-s<seed>/``
(``cell.json`` = the resolved run config, ``ckpt/``, ``metrics.csv``, ``result.json`` once finished), trained
by :func:`diffattn.train.loop.train_lm`. A seed fixes both the initial weights and the batch order, and every arm
with that seed sees the same batches (a paired design). A finished cell is reused; an unfinished one resumes
from its last checkpoint.

Scheduling is an Optuna study (``GridSampler`` over the cells) in ``OUT/optuna.journal`` (JournalFileStorage,
on any shared filesystem) or an RDB URL (``--storage``). Any number of ``--worker`` processes, on any machines
that see OUT, pull cells until the grid is done, one cell at a time. A worker records a heartbeat in its trial;
a RUNNING trial whose worker died (same host: the process is gone; another host: no heartbeat for
``grace_s``) is marked FAIL and its grid point re-queued, so a killed worker never blocks the grid, and the
re-run cell resumes from its checkpoint.

LR bracketing (issue 16): after the base grid, an arm whose best mean LR is at an edge of its list gets the
next LR beyond it, in rounds, up to ``lr_extensions`` per arm (:func:`lr_brackets`, :func:`_extend_lrs`);
each round is a further Optuna grid whose points are cell keys, derived from the finished cells alone, so
every worker and every rerun agree on it. Head groups: ``head_dims`` (Q/K widths, every arm's heads derived)
or ``heads`` (DIFF head counts); each group's arms are compared with its standard arm.

This module plans, runs and collects; :mod:`diffattn.experiments.study.report` renders. Files in OUT:
``study.json`` (the spec and the plan; re-runs and workers read it), ``tokenizer.json`` (fitted once),
``events.log`` (one line per cell start/finish), ``results.json``/``report.md``/``report.html`` and plots.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffattn.attention.registry import ATTENTION, attention_label
from diffattn.experiments.study import analysis, stats  # noqa: F401  (stats: callers reach it as grid.stats)
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.train.loop import NonFiniteLossError, TrainConfig, make_optimizer, train_lm
from diffattn.train.loss import cross_entropy
from diffattn.train.signals import TrainingInterrupted, training_stop_taken
from diffattn.train.step import TrainStep
from diffattn.train.task import LMTask

# The tiny shape (configs/tiny.toml) for real text, and a seconds-long smoke shape for tests (--quick).
TEXT_DEFAULTS = dict(d_model=128, n_layers=4, n_heads=4, seq_len=128, batch_size=16, steps=1000)
TEXT_QUICK = dict(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, steps=8)
N_EVALS = 10  # validation points per cell (the loss-vs-tokens curves)
MAX_VAL_TOKENS = 262_144  # the final full-validation pass reads at most this many tokens
SPEC_FILE = "study.json"
FINGERPRINT = (
    "data", "tokenizer", "vocab_size", "val_fraction", "d_model", "n_layers", "heads", "head_dims", "variants", "lrs",
    "seeds", "seq_len", "batch_size", "steps", "warmup_steps", "eval_batches", "weight_decay", "diag_early_steps",
)
# ``--variants`` options after the attention type, e.g. ``diff+nosubln`` or ``diff_v2+matched`` (see parse_variant).
VARIANT_OPTIONS = ("nosubln", "shared_qk", "matched")


class StudyError(ValueError):
    """Bad arguments or an OUT folder that belongs to another experiment (one line for the CLI)."""


class StudyInterrupted(Exception):
    """SIGINT/SIGTERM stopped this worker: the cell in training (if any) saved its checkpoint at the step it had
    reached and no further cell was started. ``saved``: (cell, step) of that cell; ``exit_code``: 130 / 143."""

    def __init__(self, signum: int, saved: tuple[str, int] | None = None) -> None:
        self.signum, self.saved = signum, saved
        self.exit_code = 128 + signum
        where = f"{saved[0]} saved at step {saved[1]}" if saved else "no cell was in training"
        super().__init__(f"{signal.Signals(signum).name}: {where}")


class _StopRequest:
    """This worker's SIGINT/SIGTERM handler (main thread only).

    While a cell trains, train_lm's own handler takes the first signal (it finishes the step, saves and raises
    TrainingInterrupted) and then re-installs this one. Outside training the first signal only asks the worker
    to start no further cell (an evaluation in flight finishes and its result is kept). Any later signal quits
    at once: the cell then resumes from its last checkpoint on the next run. ``training`` is set around the
    train_lm call: a signal reaching this handler then came before train_lm's handler was installed or after
    train_lm's handler took the first one, told apart by :func:`~diffattn.train.signals.training_stop_taken`."""

    def __init__(self, resume_hint: str | None = None) -> None:
        self.signum = 0
        self.training = False
        self.resume_hint = resume_hint
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum or (self.training and training_stop_taken()):
            quit_now(signum, self.resume_hint)
        self.signum = signum
        if self.training:  # train_lm has not installed its handler yet (or has finished): nothing to save
            raise StudyInterrupted(signum)
        _say(f"{signal.Signals(signum).name}: no further cell starts; the one finishing now is kept "
             "(again to quit at once)")


_ACTIVE_STOP: _StopRequest | None = None  # the handler of this process's worker, while one runs


def _say(msg: str) -> None:
    """A line on stderr from a signal handler: os.write, as print() may be in the middle of a write already."""
    os.write(2, f"{datetime.now():%H:%M:%S} {msg}\n".encode())


def quit_now(signum: int, resume_hint: str | None = None) -> None:
    """A second signal: leave at once, without cleanup (checkpoints are written atomically; a trial left
    RUNNING is recovered by the next run, whose cell resumes from its last checkpoint)."""
    _say(f"{signal.Signals(signum).name} again: quitting at once"
         + (f"; resume with: {resume_hint}" if resume_hint else ""))
    os._exit(128 + signum)


# ----------------------------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class Arm:
    name: str
    attention: str
    n_heads: int
    options: tuple[str, ...] = ()  # VARIANT_OPTIONS of a ``TYPE+option`` variant

    @property
    def label(self) -> str:
        base = attention_label(self.attention) + "".join(f"+{o}" for o in self.options)
        return f"{base} ({self.n_heads} heads)"


def parse_variant(variant: str) -> tuple[str, tuple[str, ...]]:
    """``TYPE[+option...]`` -> (attention type, options). Options: ``nosubln`` (V1 without its per-head
    RMSNorm, ``ModelConfig.subln=False``), ``shared_qk`` (K from the query projection) and ``matched`` (a
    smaller FFN so the arm's parameters match its baseline's, see :func:`matched_ffn_hidden`). Raises
    StudyError (one line) for an unknown type or option, or an option the type does not have."""
    kind, *opts = [x.strip() for x in variant.split("+")]
    if kind not in ATTENTION:
        raise StudyError(f"unknown attention variant {variant!r}; registered: {sorted(ATTENTION)}, each optionally "
                         f"with +{' +'.join(VARIANT_OPTIONS)}")
    bad = [o for o in opts if o not in VARIANT_OPTIONS or opts.count(o) > 1]
    if bad:
        raise StudyError(f"variant {variant!r}: unknown or repeated option(s) {bad}; known: {list(VARIANT_OPTIONS)}")
    if "nosubln" in opts and ATTENTION[kind].head_split != 2:
        raise StudyError(f"variant {variant!r}: +nosubln drops V1's per-head norm; {kind} has none")
    if "shared_qk" in opts and not ATTENTION[kind].supports_shared_qk:
        raise StudyError(f"variant {variant!r}: shared_qk is not defined for {kind}")
    return kind, tuple(o for o in VARIANT_OPTIONS if o in opts)


def matched_ffn_hidden(cfg: ModelConfig, target_params: int) -> int:
    """The FFN width that brings ``cfg``'s parameter count closest to ``target_params`` (its baseline's).

    How: the FFN's parameters grow linearly with its hidden width (SwiGLU: 3·d_model per unit and layer), so
    two meta-device models give the slope and the offset, and the nearest width follows. V2 at the baseline's
    head width adds a query projection and W_λ per layer (8% at the tiny shape); taking it out of the FFN keeps
    attention exactly V2's while total parameters match within a fraction of a percent."""

    def count(hidden: int) -> int:
        with torch.device("meta"):
            return TransformerLM(cfg.replace(ffn_hidden=hidden)).num_params()

    h0 = cfg.ffn_dim
    n0, n1 = count(h0), count(h0 - 1)
    per_unit = n0 - n1
    return max(1, h0 - round((n0 - target_params) / per_unit))


@dataclass
class StudySpec:
    data: str
    tokenizer: str = "char"
    vocab_size: int | None = None
    val_fraction: float = 0.1
    d_model: int = 128
    n_layers: int = 4
    heads: list[int] = field(default_factory=lambda: [4])  # DIFF heads; the baseline gets twice as many
    variants: list[str] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    warmup_steps: int = -1  # -1: min(100, steps // 10)
    eval_batches: int = 8
    weight_decay: float = 0.1
    sizes: list[int] = field(default_factory=list)  # d_model of the size ladder (empty: no ladder)
    # Q/K (sub-)head widths (--head-dim / --head-dims): every arm's head count derives from one (analysis.
    # head_counts); empty: ``heads`` gives DIFF's head count, as before.
    head_dims: list[int] = field(default_factory=list)
    # --lr-extensions K: rounds per arm beyond an edge best LR. The command's default is 2; 0 here keeps a
    # study.json written before bracketing existed (no such key) as it was when it resumes.
    lr_extensions: int = 0
    diag_early_steps: int = 0  # TrainConfig.diag_early_steps: per-layer RMS/λ/gradient diagnostics early on

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            self.warmup_steps = max(1, min(100, self.steps // 10))

    @property
    def head_dim(self) -> int | None:
        """The Q/K (sub-)head width every arm shares, when there is one (a single width or head group)."""
        if self.head_dims:
            return self.head_dims[0] if len(self.head_dims) == 1 else None
        return self.d_model // (2 * self.heads[0]) if len(self.heads) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "head_dim": self.head_dim}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StudySpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def fingerprint(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FINGERPRINT}

    # -- arms and cells
    def _groups(self) -> list[tuple[str, dict[str, int]]]:
        """(arm-name suffix, {attention type: n_heads}) per head group: one per --head-dims width (every type's
        heads derived from the width), else one per --heads count (DIFF's; its matched baseline's twice)."""
        kinds = {"diff", "standard", *(parse_variant(v)[0] for v in self.variants)}
        if self.head_dims:
            multi = len(self.head_dims) > 1
            return [(f"-hd{d}" if multi else "", {k: analysis.head_counts(self.d_model, d, k) for k in kinds})
                    for d in self.head_dims]
        multi = len(self.heads) > 1
        out = []
        for h in self.heads:
            base = matched_baseline(self.model_config("diff", h)).n_heads
            out.append((f"-h{h}" if multi else "",
                        {k: h if ATTENTION[k].head_split == 2 else base for k in kinds}))
        return out

    def arms(self) -> list[Arm]:
        """DIFF and its matched baseline for each head group, then each variant at the head count of the
        reference it matches (head_split-2 types at DIFF's heads, others at the baseline's)."""
        out: list[Arm] = []
        for suffix, heads in self._groups():
            out.append(Arm(f"diff{suffix}", "diff", heads["diff"]))
            out.append(Arm(f"standard{suffix}", "standard", heads["standard"]))
            for v in self.variants:
                kind, opts = parse_variant(v)
                out.append(Arm(f"{v}{suffix}", kind, heads[kind], opts))
        return out

    def arm(self, name: str) -> Arm:
        for a in self.arms():
            if a.name == name:
                return a
        raise KeyError(name)

    def model_config(self, attention: str, n_heads: int, vocab_size: int = 256, d_model: int | None = None):
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=d_model or self.d_model,
            n_layers=self.n_layers,
            n_heads=n_heads,
            max_seq_len=self.seq_len,
            attention=attention,
        )

    def arm_config(self, arm: Arm, vocab_size: int = 256, d_model: int | None = None) -> ModelConfig:
        """The model of an arm: :meth:`model_config` with the arm's variant options applied."""
        cfg = self.model_config(arm.attention, arm.n_heads, vocab_size, d_model)
        if "nosubln" in arm.options:
            cfg = cfg.replace(subln=False)
        if "shared_qk" in arm.options:
            cfg = cfg.replace(shared_qk=True)
        if "matched" in arm.options:
            base = next(a for a in self.arms() if a.attention == "standard" and _group(a.name) == _group(arm.name))
            with torch.device("meta"):
                target = TransformerLM(self.arm_config(base, vocab_size, d_model)).num_params()
            cfg = cfg.replace(ffn_hidden=matched_ffn_hidden(cfg, target))
        return cfg

    def train_config(self, lr: float, seed: int):
        from diffattn.train.loop import TrainConfig

        return TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lr=lr,
            min_lr=lr / 10,
            warmup_steps=min(self.warmup_steps, self.steps),
            weight_decay=self.weight_decay,
            eval_every=max(1, self.steps // N_EVALS),
            eval_batches=self.eval_batches,
            log_every=max(1, self.steps // 50),
            seed=seed,
            diag_early_steps=self.diag_early_steps,
        )

    def grid(self) -> dict[str, list]:
        return {"arm": [a.name for a in self.arms()], "lr": list(self.lrs), "seed": list(self.seeds)}

    def ladder_sizes(self) -> list[int]:
        return [d for d in self.sizes if d != self.d_model]


def _group(arm_name: str) -> str:
    """The head-group suffix of an arm name ("" with one group): arms are compared within their group."""
    for tag in ("-hd", "-h"):
        if tag in arm_name:
            return tag + arm_name.rsplit(tag, 1)[1]
    return ""


def default_lrs(d_model: int) -> list[float]:
    """Three learning rates a factor 2 apart around a size-aware centre: 3e-3 at d_model 128, scaled as
    1/sqrt(d_model) (the tiny shape preferred 4e-3 over 1e-3 in 1,000-step probes)."""
    c = 3e-3 * math.sqrt(128 / d_model)
    return [float(f"{c * f:.2g}") for f in (0.5, 1.0, 2.0)]


def default_sizes(d_model: int, heads: list[int]) -> list[int]:
    """d_model × (1/2, 1, 3/2), rounded to a multiple every arm's head layout accepts (4·max DIFF heads:
    2·h sub-heads of even width)."""
    q = 4 * max(heads)
    return sorted({max(q, round(d_model * f / q) * q) for f in (0.5, 1.0, 1.5)})


def cell_name(arm: str, lr: float, seed: int, d_model: int | None = None) -> str:
    size = f"-d{d_model}" if d_model is not None else ""
    return f"{arm}{size}-lr{lr:g}-s{seed}"


# --------------------------------------------------------------------------------------------- the plan
def makespan(costs: list[float], jobs: int) -> float:
    """Wall time of running cells of these costs on ``jobs`` workers that each take the next cell when free
    (longest first, as a good greedy schedule; the real order is random, so this is a slight underestimate)."""
    loads = [0.0] * max(1, jobs)
    for c in sorted(costs, reverse=True):
        i = loads.index(min(loads))
        loads[i] += c
    return max(loads)


def plan_steps(cells: list[tuple[float, float]], budget_s: float, jobs: int, min_steps: int = 10,
               rounds: list[list[tuple[float, float]]] = ()) -> int:
    """Largest steps per cell such that the grid's estimated wall time fits ``budget_s``.

    ``cells``: (seconds per training step, fixed seconds per cell: evaluations, the final validation pass,
    start-up) for every cell. The estimate is :func:`makespan` of steps · step + fixed; it grows with steps, so
    a bisection finds the largest fitting value. Never below ``min_steps`` (then the plan exceeds the budget,
    and says so). ``rounds``: cells that run after them in successive stages (LR extensions: each round waits
    for the previous results), added as one makespan per round."""

    def est(steps: int) -> float:
        return estimate_s(cells, rounds, steps, jobs)

    lo, hi = min_steps, min_steps
    if est(lo) > budget_s:
        return min_steps
    while est(hi * 2) <= budget_s:
        hi *= 2
    hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if est(mid) <= budget_s else (lo, mid)
    return lo


def estimate_s(cells: list[tuple[float, float]], rounds: list[list[tuple[float, float]]], steps: int,
               jobs: int) -> float:
    """Wall time of ``cells`` then each of ``rounds`` in turn, ``steps`` per cell (see :func:`makespan`)."""
    return sum(makespan([steps * s + f for s, f in stage], jobs) for stage in [cells, *rounds] if stage)


def extension_costs(spec: StudySpec, timing: dict[str, dict[str, float]],
                    val_tokens: int | None = None) -> list[list[tuple[float, float]]]:
    """(step seconds, fixed seconds) of the LR-extension cells the study may need, per round, at the most:
    every arm extends in each of its ``lr_extensions`` rounds (a single-LR arm by two LRs in its first), as
    :func:`analysis.max_extension_cells` counts them."""
    per_arm = {name.split("@")[0]: (st, fixed) for st, fixed, name in cell_costs(spec, timing, val_tokens, False)}
    single = len(set(spec.lrs)) == 1
    return [[per_arm[a.name] for a in spec.arms()
             for _ in range((2 if single and r == 0 else 1) * len(spec.seeds))]
            for r in range(spec.lr_extensions)]


def cell_costs(spec: StudySpec, timing: dict[str, dict[str, float]], val_tokens: int | None = None,
               ladder: bool = True) -> list[tuple[float, float, str]]:
    """(step seconds, fixed seconds, cell name) for every cell of the grid (and the ladder), from a timing
    probe ``timing[f"{arm}@{d_model}"] = {"step": s, "fwd": s}``."""
    n_eval_fwd = N_EVALS * spec.eval_batches + _val_batches(spec, val_tokens) * 32 // spec.batch_size
    out = []
    for a in spec.arms():
        for d in [spec.d_model] + (spec.ladder_sizes() if ladder else []):
            t = timing[f"{a.name}@{d}"]
            n = len(spec.lrs) * len(spec.seeds) if d == spec.d_model else len(spec.seeds)
            for _ in range(n):
                out.append((t["step"], n_eval_fwd * t["fwd"] + t.get("start", 1.0), f"{a.name}@{d}"))
    return out


def _val_batches(spec: StudySpec, val_tokens: int | None = None) -> int:
    v = MAX_VAL_TOKENS if val_tokens is None else min(val_tokens, MAX_VAL_TOKENS)
    return max(1, math.ceil(v / spec.seq_len / 32))


def _probe_ignores_sigint() -> None:
    # A Ctrl-C at the terminal reaches the probe processes too: only the command itself handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _probe_ready(_: int) -> None:
    time.sleep(0.5)  # long enough that every pool process gets one: all have imported torch before timing


def _probe_cell(cfg: dict, tokens: np.ndarray, seq_len: int, batch_size: int, threads: int, seconds: float,
                min_steps: int, seed: int) -> tuple[float, float]:
    """In a probe process: -> (seconds per training step after a warm-up step, seconds per forward pass of an
    evaluation batch) of a model of config ``cfg`` on windows of ``tokens``. The step is the training loop's
    own (:class:`~diffattn.train.step.TrainStep`: lr, loss, backward, clipping, optimizer), as a cell runs it."""
    torch.set_num_threads(max(1, threads))
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.from_dict(cfg))
    tcfg = TrainConfig(lr=1e-3, batch_size=batch_size, seq_len=seq_len)
    train_step = TrainStep(LMTask(None), model, make_optimizer(model, tcfg), tcfg)
    g = torch.Generator().manual_seed(seed)
    t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(len(t) - seq_len - 1, (batch_size,), generator=g)
        w = torch.stack([t[j:j + seq_len + 1] for j in i.tolist()])
        return w[:, :-1], w[:, 1:]

    n, t0 = -1, 0.0
    while n < min_steps or time.perf_counter() - t0 < seconds:
        if n == 0:
            t0 = time.perf_counter()  # after the warm-up step
        train_step(n + 1, batch())
        n += 1
    step = (time.perf_counter() - t0) / n
    x, _ = batch()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    return step, time.perf_counter() - t0


def probe_timing(spec: StudySpec, source: Any, threads: int, jobs: int = 1, seconds: float = 5.0,
                 min_steps: int = 3) -> dict[str, dict[str, float]]:
    """Seconds per training step and per evaluation batch for every arm and ladder size, measured here as the
    grid will run: ``jobs`` separate processes training at once, each for at least ``seconds`` after a
    warm-up step. (A few steps of one process alone overstated the speed 3× on a busy machine, where each job
    gets only its share of the cores; threads in one process understated it 2-3× on an idle one, where the
    GIL serialises the Python overhead of small models.)"""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = max(1, jobs)
    a0, b0 = source.splits["train"]
    tokens = np.asarray(source.tokens[a0:min(b0, a0 + 200_000)], dtype=np.int64)  # enough to draw batches
    out: dict[str, dict[str, float]] = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_probe_ignores_sigint) as ex:
        list(ex.map(_probe_ready, range(jobs)))
        for a in spec.arms():
            for d in [spec.d_model] + spec.ladder_sizes():
                cfg = spec.arm_config(a, source.vocab_size, d).to_dict()
                futs = [ex.submit(_probe_cell, cfg, tokens, spec.seq_len, spec.batch_size, threads, seconds,
                                  min_steps, i) for i in range(jobs)]
                res = [f.result() for f in futs]
                out[f"{a.name}@{d}"] = {
                    "step": float(np.mean([r[0] for r in res])),
                    "fwd": float(np.mean([r[1] for r in res])),
                    "start": 1.0,
                    "jobs": jobs,
                }
    return out


# ------------------------------------------------------------------------------------------- data & model
def load_data(out: Path, spec: StudySpec) -> tuple[Any, Any]:
    """(source, tokenizer): the tokenizer is fitted once per study and kept in OUT/tokenizer.json."""
    from diffattn.tokenizer import tokenizer_from_dict

    tok_file = out / "tokenizer.json"
    if tok_file.exists():
        return prepare_data(spec, tokenizer_from_dict(json.loads(tok_file.read_text())))
    source, tok = prepare_data(spec)
    _atomic_write_text(tok_file, json.dumps(tok.to_dict()))
    return source, tok


def prepare_data(spec: StudySpec, tokenizer: Any = None) -> tuple[Any, Any]:
    """(source, tokenizer) in memory, writing nothing: fits the tokenizer unless given. Raises DataError (a
    ValueError, one line) for missing, empty, binary or non-UTF-8 data and for splits shorter than a window."""
    from diffattn.data.lm import make_source, read_text
    from diffattn.tokenizer import build_tokenizer

    tok = tokenizer if tokenizer is not None else build_tokenizer(spec.tokenizer, read_text(spec.data),
                                                                  spec.vocab_size)
    data_cfg = {"path": spec.data, "tokenizer": spec.tokenizer, "val_fraction": spec.val_fraction}
    return make_source(data_cfg, spec.seq_len, tokenizer=tok)


def chars_per_token(source: Any, tokenizer: Any) -> float:
    """Characters per token of the validation split, measured by decoding it (1.0 for the char tokenizer)."""
    a, b = source.splits["val"]
    ids = np.asarray(source.tokens[a:b], dtype=np.int64).tolist()
    return len(tokenizer.decode(ids)) / max(1, len(ids))


@torch.no_grad()
def full_val_loss(model: torch.nn.Module, source: Any, seq_len: int, max_tokens: int = MAX_VAL_TOKENS) -> float:
    """Mean next-token loss (nats) over the validation split read as consecutive non-overlapping windows
    (up to ``max_tokens``): the same tokens for every cell, unlike the sampled in-training evaluations."""
    a, b = source.splits["val"]
    b = min(b, a + max_tokens + 1)
    starts = list(range(a, b - seq_len, seq_len))
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(starts), 32):
            w = np.stack([np.asarray(source.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts[i:i + 32]])
            w = torch.from_numpy(w)
            logits = model(w[:, :-1])
            total += float(cross_entropy(logits, w[:, 1:]))
            count += w[:, 1:].numel()
    finally:
        model.train(was)
    return total / max(1, count)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _event(out: Path, what: str) -> None:
    line = f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%S} {socket.gethostname()}:{os.getpid()} {what}\n"
    with open(out / "events.log", "a") as f:
        f.write(line)


def _log(msg: str) -> None:
    print(f"{datetime.now():%H:%M:%S} {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- one cell
def run_cell(out: Path, spec: StudySpec, arm: Arm, lr: float, seed: int, source: Any, tokenizer: Any,
             d_model: int | None = None, progress_s: float = 60.0) -> dict[str, Any]:
    """Train (or resume, or reuse) one cell; -> its result.json dict.

    Initial weights come from ``torch.manual_seed(seed)`` and the batch order from ``TrainConfig.seed = seed``,
    so arms with the same seed see the same batches. A NaN/inf loss ends the cell as diverged (val_loss inf):
    a result about that learning rate, not a crash."""
    size = d_model if d_model not in (None, spec.d_model) else None
    name = cell_name(arm.name, lr, seed, size)
    folder = out / "cells" / name
    res_file = folder / "result.json"
    if res_file.exists():
        return json.loads(res_file.read_text())
    cfg = spec.arm_config(arm, source.vocab_size, d_model)
    tcfg = spec.train_config(lr, seed)
    run_config = {
        "task": "lm",
        "model": cfg.to_dict(),
        "data": {"path": spec.data, "tokenizer": spec.tokenizer, "val_fraction": spec.val_fraction},
        "train": dataclasses.asdict(tcfg),
        "study": {"arm": arm.name, "lr": lr, "seed": seed, "d_model": cfg.d_model},
    }
    folder.mkdir(parents=True, exist_ok=True)
    cfg_file = folder / "cell.json"
    if cfg_file.exists() and json.loads(cfg_file.read_text()) != run_config:
        raise StudyError(f"{folder} was trained with another configuration; use a new --out folder")
    _atomic_write_text(cfg_file, json.dumps(run_config, indent=2) + "\n")
    ckpt = folder / "ckpt"
    resume = (ckpt / "config.json").exists()
    start_step = _ckpt_step(ckpt) if resume else 0
    _event(out, f"start {name} step={start_step}")
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    stop = threading.Event()
    ticker = threading.Thread(target=_progress_lines, args=(folder, name, spec.steps, progress_s, stop), daemon=True)
    ticker.start()
    t0 = time.perf_counter()
    diverged = None
    guard = _ACTIVE_STOP
    try:
        try:
            if guard is not None:
                guard.training = True
                if guard.signum:  # the signal came while this cell was being set up: do not start it
                    raise StudyInterrupted(guard.signum)
            tr = train_lm(model, source, tcfg, out_dir=folder, progress=False, run_config=run_config,
                          tokenizer=tokenizer, resume=resume)
        finally:
            if guard is not None:
                guard.training = False
        history, elapsed, step = tr.history, tr.elapsed_s, tr.step
        val_loss = full_val_loss(model, source, spec.seq_len)
    except NonFiniteLossError as e:
        diverged = str(e)
        history, elapsed, step, val_loss = [], time.perf_counter() - t0, None, math.inf
    except TrainingInterrupted as e:  # train_lm saved the cell at e.step: the next run resumes it there
        if guard is not None:
            guard.signum = guard.signum or e.signum  # a further signal now quits at once
        _event(out, f"stop {name} step={e.step}")
        raise StudyInterrupted(e.signum, (name, e.step)) from None
    except StudyInterrupted as e:  # outside train_lm's loop: its last checkpoint is where the cell stands
        at = max(_ckpt_step(ckpt), 0)
        _event(out, f"stop {name} step={at}")
        raise StudyInterrupted(e.signum, (name, at)) from None
    finally:
        stop.set()
        ticker.join()
    result = {
        "cell": name,
        "arm": arm.name,
        "attention": arm.attention,
        "n_heads": arm.n_heads,
        "d_model": cfg.d_model,
        "lr": lr,
        "seed": seed,
        "steps": spec.steps,
        "step": step,
        "tokens": spec.steps * spec.batch_size * spec.seq_len,
        "params": model.num_params(),
        "non_embedding_params": model.num_params(exclude_embeddings=True),
        "val_loss": val_loss,  # nats/token, full validation split
        "diverged": diverged,
        "train_seconds": elapsed,
        "history": [{k: h.get(k) for k in ("step", "tokens_seen", "train_loss", "val_loss")} for h in history],
    }
    _atomic_write_text(res_file, json.dumps(result, indent=1, default=_json_float) + "\n")
    _event(out, f"done {name} val_loss={val_loss:.4f}")
    return result


def _json_float(x: Any) -> Any:
    return float(x)


def _ckpt_step(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / "config.json").read_text())["train_state"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _progress_lines(folder: Path, name: str, steps: int, every_s: float, stop: threading.Event) -> None:
    """One readable line per interval while a cell trains (read from its metrics.csv): works the same when
    stderr is a file, where carriage-return progress bars pile up into one enormous line."""
    while not stop.wait(every_s):
        try:
            lines = (folder / "metrics.csv").read_text().strip().splitlines()
            head, last = lines[0].split(","), lines[-1].split(",")
            row = dict(zip(head, last))
            if len(lines) < 2:
                continue
            val = [dict(zip(head, ln.split(","))).get("val_loss") for ln in lines[1:]]
            val = [v for v in val if v]
            msg = f"{name}: step {row['step']}/{steps}, train loss {float(row['train_loss']):.3f}"
            if val:
                msg += f", val {float(val[-1]):.3f}"
            if row.get("tokens_per_s"):
                msg += f", {float(row['tokens_per_s']):,.0f} tok/s"
            _log(msg)
        except (OSError, ValueError, IndexError, KeyError):
            continue


# ------------------------------------------------------------------------------------ Optuna scheduling
def open_storage(out: Path, url: str | None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url:
        return optuna.storages.RDBStorage(url)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(out / "optuna.journal")))


def _grid_keys(space: dict[str, list]) -> list[tuple]:
    """Grid points in GridSampler's grid_id order (parameter names sorted, values in the given order)."""
    names = sorted(space)
    return [tuple(zip(names, combo)) for combo in itertools.product(*(space[n] for n in names))]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GridWorker:
    """Pull the cells of one Optuna grid study until every grid point has a COMPLETE trial.

    A grid point is identified by its parameters (``trial.params``); GridSampler's ``grid_id`` (the same in
    every process: its shuffle is seeded) is used to re-queue a point and to spot a racing trial whose
    parameters are not written yet."""

    def __init__(self, storage: Any, study_name: str, space: dict[str, list], run: Callable[[dict], float],
                 grace_s: float = 300.0, heartbeat_s: float = 20.0, poll_s: float = 5.0):
        import optuna

        self.space, self.run_fn = space, run
        self.keys = _grid_keys(space)
        self.grace_s, self.heartbeat_s, self.poll_s = grace_s, heartbeat_s, poll_s
        self.host = socket.gethostname()
        self.study = optuna.create_study(
            study_name=study_name, storage=storage, sampler=optuna.samplers.GridSampler(space),
            direction="minimize", load_if_exists=True,
        )
        self.gave_up: set[tuple] = set()  # points that crashed in this process (retried on the next run)
        self.interrupted: StudyInterrupted | None = None

    # -- trial bookkeeping
    def _trials(self):
        return self.study._storage.get_all_trials(self.study._study_id, deepcopy=False)

    @staticmethod
    def _key(t) -> tuple | None:
        return tuple(sorted(t.params.items())) if t.params else None

    def _by_key(self) -> dict[tuple, list]:
        out: dict[tuple, list] = {k: [] for k in self.keys}
        for t in self._trials():
            k = self._key(t)
            if k in out:
                out[k].append(t)
        return out

    def _requeue(self, gid: int, why: str, retry_of: int | None = None) -> None:
        import optuna

        search_space = {k: list(v) for k, v in sorted(self.space.items())}
        self.study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            system_attrs={"grid_id": gid, "search_space": search_space, "requeued": why, "retry_of": retry_of},
        ))

    def recover(self) -> int:
        """Mark RUNNING trials whose worker is gone as FAIL and re-queue their grid points; -> how many."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        n, now = 0, time.time()
        for t in self._trials():
            if t.state != TrialState.RUNNING:
                continue
            ua = t.user_attrs
            gone = ua.get("host") == self.host and "pid" in ua and not _pid_alive(int(ua["pid"]))
            last = ua.get("heartbeat") or (t.datetime_start.timestamp() if t.datetime_start else now)
            if not (gone or now - last > self.grace_s):
                continue
            try:
                changed = self.study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue  # another worker recovered it first
            if changed and t.system_attrs.get("grid_id") is not None:
                self._requeue(t.system_attrs["grid_id"], "stale", t.number)
                n += 1
        return n

    def requeue_failed(self) -> int:
        """Grid points whose trials all failed (a crash in an earlier run): queue them again once."""
        from optuna.trial import TrialState

        n = 0
        for ts in self._by_key().values():
            if ts and all(t.state in (TrialState.FAIL, TrialState.PRUNED) for t in ts):
                gid = next((t.system_attrs["grid_id"] for t in ts if "grid_id" in t.system_attrs), None)
                if gid is not None:
                    self._requeue(gid, "failed earlier")
                    n += 1
        return n

    def remaining(self) -> tuple[list[tuple], list[tuple]]:
        """(points with no COMPLETE trial, those of them this worker may start now: never tried, or one of
        its trials is WAITING)."""
        from optuna.trial import TrialState

        todo, free = [], []
        waiting = any(t.state == TrialState.WAITING for t in self._trials())
        for k, ts in self._by_key().items():
            states = {t.state for t in ts}
            if TrialState.COMPLETE in states:
                continue
            todo.append(k)
            if k not in self.gave_up and (not states or waiting):
                free.append(k)
        return todo, free

    # -- the loop
    def work(self, log: Callable[[str], None] = _log) -> bool:
        """Run cells until the grid is complete; -> True if it is (False: cells failed here, re-run)."""
        self.recover()
        self.requeue_failed()
        while True:
            self.recover()
            todo, free = self.remaining()
            if not todo:
                return True
            if not free:
                if all(k in self.gave_up for k in todo):
                    log(f"{len(todo)} cell(s) failed; re-run the command to retry them")
                    return False
                self._idle(self.poll_s)  # the rest are running in other workers
                continue
            self._check_stop()
            try:
                self.study.optimize(self._objective, n_trials=1)
            except Exception as e:  # the trial is FAIL; keep going with the other cells
                log(f"cell failed: {type(e).__name__}: {e}")
            if self.interrupted is not None:
                raise self.interrupted
            self._check_stop()

    @staticmethod
    def _check_stop() -> None:
        if _ACTIVE_STOP is not None and _ACTIVE_STOP.signum:
            raise StudyInterrupted(_ACTIVE_STOP.signum)

    def _idle(self, seconds: float) -> None:
        """Sleep, but notice a stop request within a fraction of a second."""
        end = time.monotonic() + seconds
        while True:
            self._check_stop()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.2))

    def _objective(self, trial) -> float:
        import optuna

        params = {n: trial.suggest_categorical(n, self.space[n]) for n in sorted(self.space)}
        key = tuple(sorted(params.items()))
        try:
            return self._run_trial(trial, params, key)
        except optuna.TrialPruned:
            raise
        except StudyInterrupted as e:
            # Not a failure: PRUNED keeps Optuna quiet (a FAIL logs a traceback), and the point goes back in
            # the queue at once, so that the next run (or a worker elsewhere that is still running) resumes
            # the cell from the checkpoint it just saved.
            self.interrupted = e
            trial.set_user_attr("interrupted", str(e))
            gid = self.study._storage.get_trial_system_attrs(trial._trial_id).get("grid_id")
            if gid is not None:
                self._requeue(gid, "interrupted", trial.number)
            raise optuna.TrialPruned(str(e)) from None
        except BaseException:
            self.gave_up.add(key)
            raise

    def _run_trial(self, trial, params: dict, key: tuple) -> float:
        import optuna
        from optuna.trial import TrialState

        storage, tid = self.study._storage, trial._trial_id
        gid = storage.get_trial_system_attrs(tid).get("grid_id")
        trial.set_user_attr("host", self.host)
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("heartbeat", time.time())
        # GridSampler hands out a point that is RUNNING elsewhere when nothing else is left, and two workers can
        # race for one point: the lowest-numbered live trial owns it, any later one stands down.
        for t in self._trials():
            same = self._key(t) == key or (gid is not None and t.system_attrs.get("grid_id") == gid)
            if t.number == trial.number or not same:
                continue
            if t.state == TrialState.COMPLETE or (t.state == TrialState.RUNNING and t.number < trial.number):
                trial.set_user_attr("duplicate_of", t.number)
                raise optuna.TrialPruned()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                try:
                    storage.set_trial_user_attr(tid, "heartbeat", time.time())
                except Exception:  # a storage hiccup must not kill the training thread
                    pass

        hb = threading.Thread(target=beat, daemon=True)
        hb.start()
        try:
            value = float(self.run_fn(params))
        finally:
            stop.set()
            hb.join()
        return value


# ------------------------------------------------------------------------------------------ the experiment
def collect_cells(out: Path, spec: StudySpec) -> list[dict]:
    """Every finished cell's result.json (of this study's horizon)."""
    cells = []
    for f in sorted((out / "cells").glob("*/result.json")):
        r = json.loads(f.read_text())
        if r.get("steps") == spec.steps:
            cells.append(r)
    return cells


def is_cell(c: dict, arm: str, lr: float, seed: int, d_model: int) -> bool:
    return c["arm"] == arm and c["lr"] == lr and c["seed"] == seed and c["d_model"] == d_model


def cell_loss(c: dict) -> float:
    v = c["val_loss"]
    return math.inf if v is None else float(v)


def lr_sweeps(spec: StudySpec, cells: list[dict],
              lrs: dict[str, list[float]] | None = None) -> dict[str, dict[float, list[float]]]:
    """{arm: {lr: [val_loss per seed, in seed order]}} over the base-size cells present, at each arm's LRs
    (``lrs``: {arm: LR list}, e.g. :func:`lr_brackets`' ``lrs``; default: the base list ``spec.lrs``)."""
    out: dict[str, dict[float, list[float]]] = {}
    for a in spec.arms():
        sw: dict[float, list[float]] = {}
        for lr in (lrs or {}).get(a.name, spec.lrs):
            vals = [cell_loss(c) for s in spec.seeds for c in cells if is_cell(c, a.name, lr, s, spec.d_model)]
            if vals:
                sw[lr] = vals
        if sw:
            out[a.name] = sw
    return out


def lr_brackets(spec: StudySpec, cells: list[dict]) -> dict[str, analysis.Bracket]:
    """Each arm's learning-rate state (:class:`analysis.Bracket`), replaying the extension rounds from the
    finished cells: start from ``spec.lrs``; while the best mean LR is at an edge, fewer than
    ``spec.lr_extensions`` rounds are used and the next round's cells are all finished, add that round's LRs.
    A result with ``status == "extend"`` names the LRs whose cells must run next. Deterministic in the
    finished cells, so every worker (and every rerun) derives the same extension cells."""
    out = {}
    for a in spec.arms():
        lrs, used = list(spec.lrs), 0
        while True:
            b = analysis.bracket_arm(_full_sweep(spec, cells, a.name, lrs), lrs, used, spec.lr_extensions)
            if b.status != "extend":
                break
            nxt = _full_sweep(spec, cells, a.name, b.next_lrs)
            if len(nxt) < len(b.next_lrs):  # this round's cells are still to run
                break
            lrs, used = sorted(lrs + b.next_lrs), used + 1
        out[a.name] = b
    return out


def _full_sweep(spec: StudySpec, cells: list[dict], arm: str, lrs: list[float]) -> dict[float, list[float]]:
    """{lr: [loss per seed]} of the LRs among ``lrs`` whose every seed has finished (a partial LR is no result)."""
    sw = lr_sweeps(spec, cells, {arm: lrs}).get(arm, {})
    return {lr: v for lr, v in sw.items() if len(v) == len(spec.seeds)}


def grid_cells(spec: StudySpec, brackets: dict[str, analysis.Bracket]) -> list[tuple[str, float, int]]:
    """(arm, lr, seed) of every base-size cell the study needs so far: the base LRs, the extensions already
    made and the ones pending."""
    return [(a.name, lr, s) for a in spec.arms()
            for lr in sorted(set(brackets[a.name].lrs) | set(brackets[a.name].next_lrs)) for s in spec.seeds]


def ladder_lrs(out: Path, spec: StudySpec) -> dict[str, float]:
    """Each arm's best learning rate from the finished grid (run folders), extensions included."""
    return {arm: b.best_lr for arm, b in lr_brackets(spec, collect_cells(out, spec)).items()
            if b.best_lr is not None}


def worker_main(out: Path, storage_url: str | None, threads: int, grace_s: float = 300.0,
                poll_s: float = 5.0, progress_s: float = 60.0, resume_hint: str | None = None,
                parent_pid: int | None = None) -> bool:
    """One worker: the grid, then (with sizes) the ladder. -> True when both are complete.

    SIGINT/SIGTERM (see :class:`_StopRequest`) raise :class:`StudyInterrupted` once the cell in training has
    saved its checkpoint; ``resume_hint`` is printed if a second signal quits at once. ``parent_pid``: a
    spawned worker stops the same way when the command that started it is gone."""
    global _ACTIVE_STOP

    spec, plan = read_spec(out)
    if threads:
        torch.set_num_threads(threads)
    source, tok = load_data(out, spec)
    storage = open_storage(out, storage_url)
    with _StopRequest(resume_hint) as guard:
        _ACTIVE_STOP = guard
        gone = threading.Event()
        if parent_pid is not None:
            threading.Thread(target=_watch_parent, args=(parent_pid, gone), daemon=True).start()
        try:
            return _work(out, spec, plan, storage, source, tok, grace_s, poll_s, progress_s)
        finally:
            gone.set()
            _ACTIVE_STOP = None


def _watch_parent(parent_pid: int, done: threading.Event) -> None:
    """A spawned worker whose command died (killed outright) stops as on SIGTERM: saves and exits."""
    while not done.wait(1.0):
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _work(out: Path, spec: StudySpec, plan: dict, storage: Any, source: Any, tok: Any, grace_s: float,
          poll_s: float, progress_s: float) -> bool:
    study_name = plan["study_name"]

    def grid_cell(p: dict) -> float:
        r = run_cell(out, spec, spec.arm(p["arm"]), p["lr"], p["seed"], source, tok, progress_s=progress_s)
        _log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")
        return r["val_loss"]

    w = GridWorker(storage, study_name, spec.grid(), grid_cell, grace_s=grace_s, poll_s=poll_s)
    if not w.work() or not _extend_lrs(out, spec, storage, study_name, grid_cell, grace_s, poll_s):
        return False
    if not spec.ladder_sizes():
        return True
    best = ladder_lrs(out, spec)

    def ladder_cell(p: dict) -> float:
        lr = best[p["arm"]]
        r = run_cell(out, spec, spec.arm(p["arm"]), lr, p["seed"], source, tok, d_model=p["d_model"],
                     progress_s=progress_s)
        _log(f"{r['cell']}: val loss {r['val_loss']:.4f} nats/token")
        return r["val_loss"]

    space = {"arm": [a.name for a in spec.arms()], "d_model": spec.ladder_sizes(), "seed": list(spec.seeds)}
    lw = GridWorker(storage, f"{study_name}-ladder-" + "-".join(map(str, spec.ladder_sizes())), space,
                    ladder_cell, grace_s=grace_s, poll_s=poll_s)
    return lw.work()


def _extend_lrs(out: Path, spec: StudySpec, storage: Any, study_name: str, grid_cell: Callable[[dict], float],
                grace_s: float, poll_s: float) -> bool:
    """LR bracketing after the base grid: while some arm's best LR is at an edge (and it has rounds left), run
    the cells of the next LR beyond it, one round for all such arms at a time.

    A round is its own Optuna grid study over one parameter, the cell key ``arm|lr|seed``, named after its
    contents: :func:`lr_brackets` derives the same round from the same finished cells in every worker and every
    rerun, so they all join that study (finished cells are reused, killed ones re-queued, as in the base grid).
    A worker reaches this only once the previous grid is complete (GridWorker.work waits for the others)."""
    import hashlib

    for _ in range(spec.lr_extensions * 2 + 2):  # each round uses one of an arm's K extensions: this bounds it
        br = lr_brackets(spec, collect_cells(out, spec))
        keys = [f"{arm}|{lr!r}|{s}" for arm, b in br.items() if b.status == "extend"
                for lr in b.next_lrs for s in spec.seeds]
        if not keys:
            return True
        ext = {a: f"{', '.join(f'{x:g}' for x in b.next_lrs)}" for a, b in br.items() if b.status == "extend"}
        _log("LR extension (best LR at an edge): " + "; ".join(f"{a} + lr {x}" for a, x in ext.items()))
        tag = hashlib.sha1("\n".join(sorted(keys)).encode()).hexdigest()[:12]

        def ext_cell(p: dict) -> float:
            arm, lr, seed = p["cell"].split("|")
            return grid_cell({"arm": arm, "lr": float(lr), "seed": int(seed)})

        if not GridWorker(storage, f"{study_name}-lrext-{tag}", {"cell": sorted(keys)}, ext_cell,
                          grace_s=grace_s, poll_s=poll_s).work():
            return False
    return True


def study_progress(out: Path, spec: StudySpec) -> dict[str, int]:
    """Finished cells of this horizon, from the run folders: {"grid", "grid_done", "ladder", "ladder_done",
    "total", "done", "brackets"}. The grid holds the base LRs and every LR extension made or pending, so it grows
    as extensions are found; it is done when every arm is bracketed or has used its ``--lr-extensions``.
    Ladder cells count once the grid is done (their LR is the grid's best)."""
    cells = collect_cells(out, spec)
    finished = {c["cell"] for c in cells}
    br = lr_brackets(spec, cells)
    grid = [cell_name(a, lr, s) for a, lr, s in grid_cells(spec, br)]
    n_ladder = len(spec.arms()) * len(spec.ladder_sizes()) * len(spec.seeds)
    grid_done = sum(n in finished for n in grid)
    ladder_done = 0
    if n_ladder and grid_done == len(grid):
        best = {a: b.best_lr for a, b in br.items()}
        ladder_done = sum(cell_name(a.name, best[a.name], s, d) in finished for a in spec.arms()
                          for d in spec.ladder_sizes() for s in spec.seeds)
    return {"grid": len(grid), "grid_done": grid_done, "ladder": n_ladder, "ladder_done": ladder_done,
            "total": len(grid) + n_ladder, "done": grid_done + ladder_done, "brackets": br}


def read_spec(out: Path) -> tuple[StudySpec, dict]:
    f = out / SPEC_FILE
    if not f.exists():
        raise StudyError(f"{out} holds no {SPEC_FILE}: start the experiment (without --worker) first, "
                         "or give the same --out as the first command")
    d = json.loads(f.read_text())
    return StudySpec.from_dict(d["spec"]), d["plan"]


def write_spec(out: Path, spec: StudySpec, plan: dict, steps_given: bool = False,
               k_given: bool = False) -> tuple[StudySpec, dict]:
    """Write OUT/study.json unless it exists (first writer wins, atomically); -> the spec and plan in force.
    A re-run keeps the stored plan (with a budget, its steps were sized by the first run's probe) unless
    ``steps_given`` names other steps; ``sizes`` may be added later (the ladder reuses the grid), and so may
    another ``lr_extensions`` when ``k_given`` (the cells run so far are reused)."""
    f = out / SPEC_FILE
    if f.exists():
        old, old_plan = read_spec(out)
        keep = not steps_given
        new = dataclasses.replace(spec, steps=old.steps, warmup_steps=old.warmup_steps) if keep else spec
        if old.fingerprint() != new.fingerprint():
            diff = [k for k in FINGERPRINT if old.fingerprint()[k] != new.fingerprint()[k]]
            raise StudyError(f"{out} holds another experiment (different {', '.join(diff)}); use a new --out")
        if (spec.sizes and spec.sizes != old.sizes) or (k_given and spec.lr_extensions != old.lr_extensions):
            # more sizes, or another --lr-extensions K: the cells trained so far stay valid and are reused
            old.sizes = spec.sizes or old.sizes
            old.lr_extensions = spec.lr_extensions
            _atomic_write_text(f, json.dumps({"spec": old.to_dict(), "plan": old_plan}, indent=2) + "\n")
        return old, old_plan
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{SPEC_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"spec": spec.to_dict(), "plan": plan}, indent=2) + "\n")
    try:
        os.link(tmp, f)  # atomic create-if-absent, also on NFS
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return read_spec(out)


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()}: {os.cpu_count()} CPU cores {cpu}, torch {torch.__version__}".strip()


def format_plan(spec: StudySpec, plan: dict) -> str:
    n_grid = len(spec.arms()) * len(spec.lrs) * len(spec.seeds)
    n_ladder = len(spec.arms()) * len(spec.ladder_sizes()) * len(spec.seeds)
    tok = spec.steps * spec.batch_size * spec.seq_len
    n_ext = analysis.max_extension_cells({a.name: spec.lrs for a in spec.arms()}, len(spec.seeds),
                                         spec.lr_extensions)
    lines = [
        f"plan: {n_grid} cells = {len(spec.arms())} arms ({', '.join(a.name for a in spec.arms())}) × "
        f"{len(spec.lrs)} LRs ({', '.join(f'{x:g}' for x in spec.lrs)}) × {len(spec.seeds)} seeds"
        + (f", + {n_ladder} ladder cells (d_model {', '.join(map(str, spec.ladder_sizes()))})" if n_ladder else ""),
        (f"      + up to {n_ext} LR-extension cells: an arm whose best LR is at an edge of its list gets the next "
         f"LR beyond it (×2 or ÷2), up to {spec.lr_extensions} time(s) (--lr-extensions); counted in the estimate"
         if n_ext else "      no LR extensions (--lr-extensions 0): an edge best LR is only reported"),
        f"      Q/K head width {spec.head_dim if spec.head_dim else 'per group'}: "
        + ", ".join(f"{a.name} {a.n_heads} heads" for a in spec.arms()),
        f"      {spec.steps} steps per cell × batch {spec.batch_size} × {spec.seq_len} tokens = {tok:,} tokens per "
        f"cell, {tok * (n_grid + n_ladder):,} in all (before LR extensions)",
    ]
    if plan.get("estimate_s") is not None:
        total = plan["estimate_s"] + plan.get("overhead_s", 0.0)
        lines.append(f"      estimated wall time {total / 60:.1f} min with {plan['jobs']} job(s) (cells "
                     f"{plan['estimate_s'] / 60:.1f} min, planning and report {plan.get('overhead_s', 0.0):.0f} s"
                     + (f"; {plan['estimate_without_lr_extensions_s'] / 60:.1f} min if no LR extension is needed"
                        if plan.get("estimate_without_lr_extensions_s") is not None and n_ext else "") + ")"
                     + (f", within the budget of {plan['budget_minutes']:g} min" if plan.get("budget_minutes")
                        else ""))
    return "\n".join(lines)


# Seconds a budget must leave for what is not a cell: the end of the command (collect the results, draw the
# plots, write the report) and, with --jobs > 1, starting each worker process (importing torch, reading data).
REPORT_S = 10.0
WORKER_START_S = 5.0


def make_plan(out: Path, spec: StudySpec, *, budget_minutes: float | None, jobs: int, threads: int,
              command: str, probe_s: float = 5.0, quick: bool = False,
              k_given: bool = True) -> tuple[StudySpec, dict]:
    """Size the horizon (``--budget-minutes``: timing probe + :func:`plan_steps`) and write study.json.

    Everything is checked before anything is created: the data (read, tokenized, long enough), the timing
    probe and whether the budget can be met (:class:`StudyError` naming the smallest budget that can). Only
    then OUT is created, with tokenizer.json and study.json; if that fails, the folders it made are removed."""
    t_start = time.perf_counter()
    if (out / SPEC_FILE).exists():
        return write_spec(out, spec, {}, steps_given=budget_minutes is None, k_given=k_given)
    if probe_s <= 0 and budget_minutes is not None:
        raise StudyError("--budget-minutes needs the timing probe (--probe-seconds > 0)")
    source, tok = prepare_data(spec)
    timing = probe_timing(spec, source, threads, jobs, probe_s) if probe_s > 0 else {}
    val_tokens = source.split_size("val")
    plan: dict[str, Any] = {
        "study_name": f"compare-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}",
        "jobs": jobs,
        "threads_per_job": threads,
        "timing_probe": timing,
        "machine": machine(),
        "command": command,
        "budget_minutes": budget_minutes,
        "quick": quick,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    plan["estimate_s"] = None
    if timing:
        costs = [(s, f) for s, f, _ in cell_costs(spec, timing, val_tokens)]
        rounds = extension_costs(spec, timing, val_tokens)
        # What the budget pays for besides the cells: the planning so far (data, probe), the report, workers.
        overhead = time.perf_counter() - t_start + REPORT_S + (WORKER_START_S + 0.5 * jobs if jobs > 1 else 0.0)
        plan["overhead_s"] = overhead
        if budget_minutes is not None:
            spec = dataclasses.replace(spec, steps=_budget_steps(costs, budget_minutes, jobs, overhead, rounds),
                                       warmup_steps=-1)
        plan["estimate_s"] = estimate_s(costs, rounds, spec.steps, jobs)
        plan["estimate_without_lr_extensions_s"] = estimate_s(costs, [], spec.steps, jobs)
    created = _create_folder(out)
    try:
        _atomic_write_text(out / "tokenizer.json", json.dumps(tok.to_dict()))
        return write_spec(out, spec, plan)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


MIN_STEPS = 10


def _budget_steps(costs: list[tuple[float, float]], budget_minutes: float, jobs: int, overhead_s: float,
                  rounds: list[list[tuple[float, float]]] = ()) -> int:
    """Steps per cell for the budget, or StudyError naming the smallest budget that fits (MIN_STEPS per cell).
    ``rounds``: the LR-extension cells it may need (:func:`extension_costs`), budgeted at their most."""
    cells_s = budget_minutes * 60 - overhead_s
    least = estimate_s(costs, rounds, MIN_STEPS, jobs)
    if least > cells_s:
        need = math.ceil((least + overhead_s) / 6) / 10  # minutes, rounded up to 0.1
        raise StudyError(
            f"--budget-minutes {budget_minutes:g} cannot be met: even {MIN_STEPS} steps per cell need about "
            f"{need:g} min for {len(costs)} cells (+ up to {sum(map(len, rounds))} LR-extension cells) "
            f"with {jobs} job(s) on this machine (timing probe, report and "
            f"start-up included); the smallest budget that fits is --budget-minutes {need:g} (or train fewer "
            "cells: --lrs, --seeds, --variants, --sizes, --lr-extensions; or more --jobs on a machine with the "
            "cores)")
    return plan_steps(costs, cells_s, jobs, MIN_STEPS, rounds)


def _create_folder(out: Path) -> Path | None:
    """mkdir -p OUT; -> the topmost folder it created (None: OUT existed). An OSError becomes one line."""
    missing = [p for p in [out, *out.parents] if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StudyError(f"cannot create the output folder {str(out)!r}: {e.strerror or e}") from None
    return missing[-1] if missing else None


def spawn_workers(out: Path, jobs: int, threads: int, storage_url: str | None, extra: list[str] = (),
                  resume_hint: str | None = None) -> tuple[list[int], int]:
    """Start ``jobs`` local worker processes (``diffattn compare --worker``) and wait; -> (their exit codes,
    the signal that stopped this command, or 0).

    Each worker runs in its own session, so a Ctrl-C at the terminal reaches this process alone, which passes
    it on exactly once to every worker, as SIGTERM (a worker still starting up then ends quietly, where SIGINT
    would print a KeyboardInterrupt traceback): each saves its cell at the current step and exits. A second
    signal is passed on as well (the workers quit at once) and this process quits at once. A worker whose
    parent is gone stops as on SIGTERM (``--spawned-by``)."""
    procs: list[subprocess.Popen] = []
    told: dict[int, int] = {}  # pid -> signals passed on
    got: list[int] = []

    def tell(p: subprocess.Popen, signum: int) -> None:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        told[p.pid] = told.get(p.pid, 0) + 1

    def forward(signum: int, frame: Any) -> None:
        got.append(signum)
        for p in procs:
            tell(p, signum)
        if len(got) > 1:
            quit_now(signum, resume_hint)
        _say(f"{signal.Signals(signum).name}: each worker saves its cell at the current step and stops "
             "(again to quit at once)")

    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for _ in range(jobs):
            if got:
                break  # no further worker starts
            cmd = [sys.executable, "-m", "diffattn", "compare", "--worker", "--out", str(out), "--threads",
                   str(threads), "--spawned-by", str(os.getpid()), *extra]
            if storage_url:
                cmd += ["--storage", storage_url]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            p = subprocess.Popen(cmd, env=env, start_new_session=True)
            procs.append(p)
            if got and not told.get(p.pid):  # the signal came while it was being started
                tell(p, got[0])
            time.sleep(0.5)
        codes = [p.wait() for p in procs]
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    return codes, got[0] if got else 0
