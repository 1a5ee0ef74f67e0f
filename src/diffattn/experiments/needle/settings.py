"""The settings of a ``diffattn compare`` run, typed: DIFF's :class:`~diffattn.model.config.ModelConfig` (its
matched baseline and the variants derive from it), the :class:`~diffattn.configs.run_config.TrainConfig` every
model shares, the evaluation sizes and the variants.

:meth:`CompareSettings.from_knobs` builds them from the command's knobs (:mod:`.defaults`: the defaults, or
``--quick``, overridden by what was given); :meth:`CompareSettings.record` is their flat layout in
``config.json`` and ``results.json``, which a rerun compares to tell whether it continues the same run, and
:meth:`CompareSettings.command_line` the full command that reruns them.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffattn.attention.registry import ATTENTION
from diffattn.configs.run_config import TrainConfig
from diffattn.data.synthetic import NeedleData, make_synthetic
from diffattn.experiments.needle.defaults import DEFAULTS, QUICK, SHARED_QK, TASK_PARAMS, split_variant
from diffattn.experiments.plots import label_for
from diffattn.model.config import ModelConfig, matched_baseline

KNOBS = tuple(DEFAULTS)  # steps, seq_len, d_model, n_layers, n_heads, batch_size, lr, samples, n_evals, depths


@dataclass(frozen=True)
class CompareSettings:
    """One compare run. ``model``: DIFF's shape, on the needle task's vocabulary, at ``train.seq_len``;
    ``train``: warmup, cosine decay to lr/10, ``n_evals`` validation points, the run's seed; ``samples``:
    evaluation sequences per (depth, length) cell; ``depths``: the grid's needle depths."""

    model: ModelConfig
    train: TrainConfig
    samples: int
    n_evals: int
    depths: tuple[float, ...]
    variants: tuple[str, ...] = ()
    quick: bool = False
    threads: int = 1

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any] | None = None, *, seed: int = 0, quick: bool = False,
                   variants: tuple[str, ...] | list[str] = (), threads: int = 1) -> CompareSettings:
        """The defaults (or ``--quick``) overridden by the given ``knobs`` (None: not given). Raises
        ValueError (one line) for a bad value, an unknown variant or a model shape that cannot be built."""
        k = dict(QUICK if quick else DEFAULTS)
        k.update({n: v for n, v in (knobs or {}).items() if n in KNOBS and v is not None})
        if not k["lr"] > 0:
            raise ValueError(f"--lr must be > 0, got {k['lr']}")
        check_variants(list(variants))
        steps, vocab = k["steps"], _needle(k["seq_len"], quick).vocab_size
        model = ModelConfig(vocab_size=vocab, d_model=k["d_model"], n_layers=k["n_layers"], n_heads=k["n_heads"],
                            max_seq_len=k["seq_len"], attention="diff")
        train = TrainConfig(steps=steps, batch_size=k["batch_size"], seq_len=k["seq_len"], lr=k["lr"],
                            min_lr=k["lr"] / 10, warmup_steps=max(1, min(50, steps // 10)), weight_decay=0.01,
                            eval_every=max(1, steps // k["n_evals"]), eval_batches=4, seed=seed)
        s = cls(model, train, samples=k["samples"], n_evals=k["n_evals"], depths=tuple(k["depths"]),
                variants=tuple(variants), quick=quick, threads=threads)
        s.model_configs()  # every model's shape is valid
        return s

    @property
    def seed(self) -> int:
        return self.train.seed

    def task_params(self) -> dict[str, int]:
        """The needle task's parameters (--quick: at most 2 needles)."""
        return dict(TASK_PARAMS, max_needles=2) if self.quick else dict(TASK_PARAMS)

    def task(self) -> NeedleData:
        """The synthetic multi-needle task every model trains and is evaluated on."""
        return _needle(self.train.seq_len, self.quick)

    def model_configs(self) -> list[ModelConfig]:
        """DIFF, its matched baseline, then each variant (head_split-2 types at DIFF's heads, others at the
        baseline's heads, so every model has the same head width as one of the two references)."""
        diff = self.model
        base = matched_baseline(diff)
        cfgs = [diff, base]
        for v in self.variants:
            kind, shared = split_variant(v)
            heads = diff.n_heads if ATTENTION[kind].head_split == 2 else base.n_heads
            cfgs.append(diff.replace(attention=kind, n_heads=heads, shared_qk=shared))
        return cfgs

    def record(self) -> dict[str, Any]:
        """The flat layout of ``config.json``'s and ``results.json``'s ``settings`` (a rerun compares it)."""
        m, t = self.model, self.train
        return {"steps": t.steps, "seq_len": t.seq_len, "d_model": m.d_model, "n_layers": m.n_layers,
                "n_heads": m.n_heads, "batch_size": t.batch_size, "lr": t.lr, "samples": self.samples,
                "n_evals": self.n_evals, "depths": list(self.depths), "seed": t.seed, "quick": self.quick,
                "variants": list(self.variants), "data": None, "threads": self.threads}

    def command_line(self, out: Path) -> str:
        """The full command that reruns these settings into ``out`` (every setting spelled out)."""
        return command_line(self.record(), out)

    def replace(self, **changes: Any) -> CompareSettings:
        return dataclasses.replace(self, **changes)


def _needle(seq_len: int, quick: bool) -> NeedleData:
    return make_synthetic("needle", seq_len, **(dict(TASK_PARAMS, max_needles=2) if quick else TASK_PARAMS))


def label(variant: str) -> str:
    """How the report names a ``--variants`` entry: the type's label, "-sym" for ``TYPE+shared_qk``."""
    base, shared = split_variant(variant)
    return label_for(base) + ("-sym" if shared else "")


def check_variants(variants: list[str]) -> None:
    """Raise ValueError (one line) for an unregistered type, ``+shared_qk`` on a type that does not define it,
    or a variant listed twice (diff and standard are always trained)."""
    unknown = [v for v in variants if split_variant(v)[0] not in ATTENTION]
    if unknown:
        raise ValueError(f"unknown attention variant(s) {unknown}; registered: {sorted(ATTENTION)}, each also as "
                         f"TYPE{SHARED_QK} where shared_qk is defined")
    no_sym = [v for v in variants if split_variant(v)[1] and not ATTENTION[split_variant(v)[0]].supports_shared_qk]
    if no_sym:
        raise ValueError(f"variant(s) {no_sym}: shared_qk is not defined for that type; it is for "
                         f"{sorted(n for n, c in ATTENTION.items() if c.supports_shared_qk)}")
    dup = {v for v in variants if variants.count(v) > 1 or v in ("diff", "standard")}
    if dup:
        raise ValueError(f"variant(s) {sorted(dup)} listed twice (diff and standard are always trained)")


def command_line(record: Mapping[str, Any], out: Path) -> str:
    """The full command that reruns the settings ``record`` (:meth:`CompareSettings.record`) into ``out``."""
    parts = ["diffattn", "compare"]
    if record["quick"]:
        parts.append("--quick")
    for k in ("steps", "seq_len", "d_model", "n_layers", "n_heads", "batch_size", "lr", "samples"):
        parts += [f"--{k.replace('_', '-')}", str(record[k])]
    parts += ["--seed", str(record["seed"]), "--threads", str(record["threads"])]
    if record["variants"]:
        parts += ["--variants", ",".join(record["variants"])]
    parts += ["--out", str(out)]
    return shlex.join(parts)
