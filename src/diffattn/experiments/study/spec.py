"""The spec of a ``diffattn study``: :class:`StudySpec` (its arms and head groups, each arm's model and
training configs, the grid and the size ladder), the variant options, the default learning rates and sizes, and
``OUT/study.json`` (:func:`read_spec` / :func:`write_spec`: the spec and the plan that every worker reads)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffattn.attention.registry import ATTENTION, attention_label, option_fields
from diffattn.configs.retrofit import RetrofitConfig
from diffattn.configs.run_config import DataConfig, TrainConfig
from diffattn.experiments.study.defaults import TEXT_DEFAULTS
from diffattn.interop.convert import converted_config
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import atomic_write, printable, temp_name
from diffattn.system.untrusted import Refused
from diffattn.train.retrofit import retrofit_config

N_EVALS = 10  # validation points per cell (the loss-vs-tokens curves)
N_EVALS_FROM = 4  # with --from SRC (a checkpoint at each: a pretrained model's are GBs)
# study.json's flat keys and their defaults (StudySpec.to_dict / from_dict): the command's shape, the run config's
# data and training defaults, and the study's own (warmup -1: default_warmup of the steps; 8 evaluation batches);
# the grid's keys are the spec's own
_FLAT_DEFAULTS: dict[str, Any] = dict(
    data=None, tokenizer=DataConfig.tokenizer, vocab_size=None, val_fraction=DataConfig.val_fraction,
    **{k: TEXT_DEFAULTS[k] for k in ("d_model", "n_layers", "seq_len", "batch_size", "steps")}, warmup_steps=-1,
    eval_batches=8, weight_decay=TrainConfig.weight_decay, diag_early_steps=TrainConfig.diag_early_steps,
    dtype=TrainConfig.dtype,
    val_tokens=None, evals=None, retrofit_steps=None, source_model=None, **{"from": None})
_GRID = ("heads", "variants", "lrs", "seeds", "sizes", "head_dims", "lr_extensions")  # lists, then a number
# dtype: the cells' autocast ("float32" unless a driver asks, as benchmarks/gpu_verdict.py asks bf16 on a GPU)
_TRAIN = ("seq_len", "batch_size", "steps", "warmup_steps", "eval_batches", "weight_decay", "diag_early_steps",
          "dtype")
_DATA = ("tokenizer", "vocab_size", "val_fraction")  # and "data": the DataConfig's path
SPEC_FILE = "study.json"
# What the study writes in place in its folder (appends, reads then rewrites, folders written into): a symbolic
# link among them is refused when the folder is taken (it would lead a write out of the folder)
STUDY_WRITES = (SPEC_FILE, "optuna.db*", "events.log", "cells", "tokenizer.json", "results.json", "report.*",
                "*.png", "measures")
# what a re-run may change (the ladder, the extension rounds) or what follows from the rest: not the experiment's
# fingerprint (every other key of study.json is)
NOT_FINGERPRINTED = ("sizes", "lr_extensions", "head_dim", "source_model")
# ``--variants`` options after the attention type, e.g. ``diff+nosubln`` or ``diff_v2+matched`` (see parse_variant),
# and the ModelConfig fields (or, ``nosubln``, V1's typed option) each sets; a type's own boolean options (its
# ``Options`` in its file, e.g. ``diff+qk_norm``) are spelled the same way. ``matched`` sets the FFN width
# (:func:`matched_ffn_hidden`).
_OPTION_FIELDS: dict[str, dict[str, Any]] = {"shared_qk": {"shared_qk": True}, "norope": {"rope": "none"}}
_OPTION_OPTIONS: dict[str, dict[str, Any]] = {"nosubln": {"subln": False}}
VARIANT_OPTIONS = ("nosubln", "shared_qk", "matched", "norope")


class StudyError(Refused):
    """Bad arguments or an OUT folder that belongs to another experiment (one line for the CLI)."""


@dataclass(frozen=True)
class Arm:
    name: str
    attention: str
    n_heads: int
    options: tuple[str, ...] = ()  # VARIANT_OPTIONS or the type's boolean options of a ``TYPE+option`` variant

    @property
    def label(self) -> str:
        base = attention_label(self.attention) + "".join(f"+{o}" for o in self.options)
        return f"{base} ({self.n_heads} head{'' if self.n_heads == 1 else 's'})"


def type_flags(kind: str) -> tuple[str, ...]:
    """The boolean options attention type ``kind`` declares (``TYPE+flag`` sets ``attn_options[flag] = True``)."""
    return tuple(n for n, tp in option_fields(kind).items() if tp is bool)


def parse_variant(variant: str) -> tuple[str, tuple[str, ...]]:
    """``TYPE[+option...]`` -> (attention type, options): :data:`VARIANT_OPTIONS` (``norope``: e.g.
    ``distance+norope``, the DA paper's setting and ALiBi's peer) and the type's own boolean options
    (:func:`type_flags`). Raises StudyError (one line) for an unknown type or option, or one the type lacks."""
    kind, *opts = [x.strip() for x in variant.split("+")]
    if kind not in ATTENTION:
        raise StudyError(f"unknown attention variant {variant!r}; registered: {sorted(ATTENTION)}, each optionally "
                         f"with +{' +'.join(VARIANT_OPTIONS)} or +one of its boolean options")
    known = (*VARIANT_OPTIONS, *type_flags(kind))
    bad = [o for o in opts if o not in known or opts.count(o) > 1]
    if bad:
        raise StudyError(f"variant {variant!r}: unknown or repeated option(s) {bad}; known for {kind}: {list(known)}")
    if "nosubln" in opts and ATTENTION[kind].head_split != 2:
        raise StudyError(f"variant {variant!r}: +nosubln drops V1's per-head norm; {kind} has none")
    if "norope" in opts and not ATTENTION[kind].uses_rope:
        raise StudyError(f"variant {variant!r}: {kind} takes no RoPE anyway")
    if "shared_qk" in opts and not ATTENTION[kind].supports_shared_qk:
        raise StudyError(f"variant {variant!r}: shared_qk is not defined for {kind}")
    return kind, tuple(o for o in known if o in opts)


def head_counts(d_model: int, head_dim: int, attention: str) -> int:
    """The ``n_heads`` of an arm whose Q/K (sub-)head width is ``head_dim`` = D at this ``d_model`` (head width as
    the study's axis: ``--head-dims``).

    standard and distance: d_model / D heads (the baseline). diff (V1) and diff_distance: d_model / (2D)
    diff-heads, half the baseline's, each with two Q/K sub-heads of width D and a V head of width 2D, so the
    projections match the baseline's. diff_v2: d_model / D output heads, like its baseline (standard at the
    same n_heads), each with two query heads of width D sharing one K/V head of width D. In general
    n_heads = d_model / (head_split · D), and :class:`diffattn.model.config.ModelConfig` with that n_heads derives
    ``qk_head_dim == D`` (no ``head_dim`` override needed). Raises ValueError (one line) when D does not fit."""
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; registered: {sorted(ATTENTION)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"--head-dim must be a positive int, got {head_dim!r}")
    split = ATTENTION[attention].head_split
    if d_model % (split * head_dim):
        what = "2·head-dim" if split == 2 else "head-dim"
        raise ValueError(f"--head-dim {head_dim} does not fit d_model {d_model} for {attention}: d_model must be "
                         f"a multiple of {what} ({split * head_dim})")
    return d_model // (split * head_dim)


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


def default_warmup(steps: int) -> int:
    """A cell's warmup when none is given: min(100, steps // 10), at least 1."""
    return max(1, min(100, steps // 10))


@dataclass
class StudySpec:
    """A study: the data every cell reads, the model shape every arm shares (each arm sets its attention type and
    heads), the training every cell shares (each cell sets its LR and seed), and the grid: DIFF head counts (``heads``;
    the baseline gets twice as many) or Q/K head widths (``head_dims``, :func:`head_counts`), variants, LRs,
    seeds, the size ladder's d_model values (``sizes``) and the LR-extension rounds per arm (``lr_extensions``; 0
    keeps a study.json written before bracketing existed as it was). ``study.json`` keeps its flat layout
    (:meth:`to_dict` / :meth:`from_dict`), so every study folder resumes."""

    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    heads: list[int] = field(default_factory=lambda: [4])
    variants: list[str] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    sizes: list[int] = field(default_factory=list)
    head_dims: list[int] = field(default_factory=list)
    lr_extensions: int = 0
    source: str | None = None  # --from SRC: the pretrained standard model every arm starts from (its shape)
    val_tokens: int | None = None  # the final full-validation pass reads at most this many tokens (None: 262,144)
    evals: int | None = None  # validation points (and checkpoints) per cell (None: N_EVALS, N_EVALS_FROM with --from)
    retrofit_steps: int | None = None  # --from: each converted arm anneals in over this many steps (None: no schedule)

    @property
    def head_dim(self) -> int | None:
        """The Q/K (sub-)head width every arm shares, when there is one (a single width or head group)."""
        if self.source:
            return self.model.qk_head_dim
        if self.head_dims:
            return self.head_dims[0] if len(self.head_dims) == 1 else None
        return self.model.d_model // (2 * self.heads[0]) if len(self.heads) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        """``study.json``'s flat layout."""
        return {"data": self.data.path, **{k: getattr(self.data, k) for k in _DATA}, "d_model": self.model.d_model,
                "n_layers": self.model.n_layers, **{k: getattr(self.train, k) for k in _TRAIN},
                **{k: list(getattr(self, k)) for k in _GRID[:-1]}, "lr_extensions": self.lr_extensions,
                "head_dim": self.head_dim, "from": self.source, "val_tokens": self.val_tokens, "evals": self.evals,
                "retrofit_steps": self.retrofit_steps, "source_model": self.model.to_dict() if self.source else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StudySpec:
        """The spec of ``study.json``'s flat layout (a key it lacks is its default: ``warmup_steps`` -1 or
        missing is :func:`default_warmup` of the steps)."""
        g = {**_FLAT_DEFAULTS, **{k: v for k, v in d.items() if k in _FLAT_DEFAULTS or k in _GRID}}
        if g["warmup_steps"] < 0:
            g["warmup_steps"] = default_warmup(g["steps"])
        data = DataConfig(path=g["data"], **{k: g[k] for k in _DATA})
        train = TrainConfig(**{k: g[k] for k in _TRAIN})
        grid = {k: (list(g[k]) if isinstance(g[k], (list, tuple)) else g[k]) for k in _GRID if k in g}
        # the shape every arm shares (each sets its attention type, heads and vocabulary), or --from SRC's model
        model = (ModelConfig.from_dict(g["source_model"]) if g["from"] and g["source_model"] else
                 ModelConfig(vocab_size=256, d_model=g["d_model"], n_layers=g["n_layers"], n_heads=1,
                             max_seq_len=g["seq_len"], attention="standard"))
        return cls(data=data, model=model, train=train, source=g["from"], val_tokens=g["val_tokens"], evals=g["evals"],
                   retrofit_steps=g["retrofit_steps"], **grid)

    def with_steps(self, steps: int, warmup_steps: int | None = None) -> StudySpec:
        """This spec at ``steps`` steps per cell (warmup ``warmup_steps``, or the default for those steps)."""
        warmup = default_warmup(steps) if warmup_steps is None else warmup_steps
        return dataclasses.replace(self, train=dataclasses.replace(self.train, steps=steps, warmup_steps=warmup))

    def fingerprint(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if k not in NOT_FINGERPRINTED}

    # -- arms and cells
    def _groups(self) -> list[tuple[str, dict[str, int]]]:
        """(arm-name suffix, {attention type: n_heads}) per head group: one per --head-dims width (every type's
        heads derived from the width), else one per --heads count (DIFF's; its matched baseline's twice)."""
        kinds = {"diff", "standard", *(parse_variant(v)[0] for v in self.variants)}
        if self.head_dims:
            multi = len(self.head_dims) > 1
            return [(f"-hd{d}" if multi else "", {k: head_counts(self.model.d_model, d, k) for k in kinds})
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
        reference it matches (head_split-2 types at DIFF's heads, others at the baseline's). With ``--from SRC``:
        ``standard`` (SRC continued), then each variant, SRC converted to it (its heads the conversion's)."""
        if self.source:
            return [Arm("standard", "standard", self.model.n_heads)] + [
                Arm(v, v, self.source_config(v).n_heads) for v in self.variants]
        out: list[Arm] = []
        for suffix, heads in self._groups():
            out.append(Arm(f"diff{suffix}", "diff", heads["diff"]))
            out.append(Arm(f"standard{suffix}", "standard", heads["standard"]))
            for v in self.variants:
                kind, opts = parse_variant(v)
                out.append(Arm(f"{v}{suffix}", kind, heads[kind], opts))
        return out

    def arm(self, name: str) -> Arm:
        return {a.name: a for a in self.arms()}[name]

    def model_config(self, attention: str, n_heads: int, vocab_size: int = 256,
                     d_model: int | None = None) -> ModelConfig:
        """The shared shape as attention type ``attention`` with ``n_heads`` heads (and another d_model)."""
        return self.model.replace(vocab_size=vocab_size, d_model=d_model or self.model.d_model, n_heads=n_heads,
                                  attention=attention)

    def source_config(self, attention: str) -> ModelConfig:
        """With ``--from``: SRC's model (``standard``) or its exact conversion to ``attention`` (with
        ``--retrofit-steps``, the plain type the schedule anneals into); StudyError (one line) for a type without a
        conversion recipe (or a schedule) or one that cannot convert SRC."""
        if attention == "standard":
            return self.model
        try:
            if self.retrofit_steps is not None:
                return retrofit_config(self.model, self.retrofit(attention), list(range(self.model.n_layers)))
            return converted_config(self.model, attention, "exact")
        except ValueError as e:
            raise StudyError(f"--from: {printable(e)}") from None

    def retrofit(self, attention: str) -> RetrofitConfig:
        """The ``[retrofit]`` section of a cell of arm type ``attention`` (inactive: no schedule, or ``standard``)."""
        if self.retrofit_steps is None or attention == "standard":
            return RetrofitConfig()
        return RetrofitConfig(to=attention, steps=self.retrofit_steps)

    def arm_config(self, arm: Arm, vocab_size: int = 256, d_model: int | None = None) -> ModelConfig:
        """The model of an arm: :meth:`model_config` with the arm's variant options applied (with ``--from``,
        :meth:`source_config`: SRC's shape and vocabulary, whatever ``vocab_size`` says)."""
        if self.source:
            return self.source_config(arm.attention)
        cfg = self.model_config(arm.attention, arm.n_heads, vocab_size, d_model)
        cfg = cfg.replace(**{k: v for o in arm.options for k, v in _OPTION_FIELDS.get(o, {}).items()})
        flags = {k: v for o in arm.options for k, v in _OPTION_OPTIONS.get(o, {}).items()}
        flags.update({o: True for o in arm.options if o in type_flags(arm.attention)})
        if flags:
            cfg = cfg.replace(attn_options=flags)
        if "matched" in arm.options:
            group = head_group(arm.name)
            base = next(a for a in self.arms() if a.attention == "standard" and head_group(a.name) == group)
            with torch.device("meta"):
                target = TransformerLM(self.arm_config(base, vocab_size, d_model)).num_params()
            cfg = cfg.replace(ffn_hidden=matched_ffn_hidden(cfg, target))
        return cfg

    def train_config(self, lr: float, seed: int) -> TrainConfig:
        """The training of a cell at ``lr`` and ``seed``: the shared section with warmup, cosine decay to lr/10,
        ``N_EVALS`` validation points and a metrics row every 2% of the steps."""
        t = self.train
        # --from: a checkpoint of a pretrained model with its optimizer state is GBs: one kept per cell
        keep = 1 if self.source else t.keep_checkpoints
        return dataclasses.replace(t, lr=lr, min_lr=lr / 10, warmup_steps=min(t.warmup_steps, t.steps),
                                   eval_every=max(1, t.steps // self.n_evals), log_every=max(1, t.steps // 50),
                                   seed=seed, keep_checkpoints=keep)

    @property
    def n_evals(self) -> int:
        """Validation points per cell (``--evals``): by default ``N_EVALS``, or ``N_EVALS_FROM`` with ``--from``
        (each evaluation writes a checkpoint, GBs for a pretrained model with its optimizer state)."""
        return self.evals or (N_EVALS_FROM if self.source else N_EVALS)

    def eval_passes(self, steps: int) -> int:
        """Forward passes a cell of ``steps`` steps runs besides training, at the cadence :meth:`train_config`
        gives the loop (:func:`diffattn.train.loop.due`): each evaluation reads ``eval_batches`` batches and
        costs about one more for its diagnostics pass and checkpoint save; each early-diagnostics row one more.
        Evaluations come every ``steps // N_EVALS`` steps and at the end, so a cell of fewer than
        ``20 · N_EVALS`` steps evaluates more than N_EVALS times: at every step below ``2 · N_EVALS``."""
        every = max(1, steps // self.n_evals)
        evals = steps // every + (steps % every != 0)
        rows = min(self.train.diag_early_steps, steps) // max(1, steps // 50)
        return evals * (self.train.eval_batches + 1) + rows

    def ladder_sizes(self) -> list[int]:
        return [d for d in self.sizes if d != self.model.d_model]


def head_group(arm_name: str) -> str:
    """The head-group suffix of an arm name ("" with one group): arms are compared within their group."""
    for tag in ("-hd", "-h"):
        if tag in arm_name:
            return tag + arm_name.rsplit(tag, 1)[1]
    return ""


def default_lrs(d_model: int) -> list[float]:
    """Three learning rates a factor 2 apart around a size-aware centre: 3e-3 at d_model 128, scaled as
    1/sqrt(d_model); a sweep around it, not TrainConfig's general 1e-3 (the tiny shape preferred 4e-3 over 1e-3
    in 1,000-step probes)."""
    c = 3e-3 * math.sqrt(128 / d_model)
    return [float(f"{c * f:.2g}") for f in (0.5, 1.0, 2.0)]


def default_sizes(d_model: int, heads: list[int]) -> list[int]:
    """d_model × (1/2, 1, 3/2), rounded to a multiple every arm's head layout accepts (4·max DIFF heads:
    2·h sub-heads of even width)."""
    q = 4 * max(heads)
    return sorted({max(q, round(d_model * f / q) * q) for f in (0.5, 1.0, 1.5)})


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
        new = spec.with_steps(old.train.steps, old.train.warmup_steps) if keep else spec
        if old.fingerprint() != new.fingerprint():
            diff = [k for k, v in old.fingerprint().items() if new.fingerprint()[k] != v]
            raise StudyError(f"{out} holds another experiment (different {', '.join(diff)}); use a new --out")
        if (spec.sizes and spec.sizes != old.sizes) or (k_given and spec.lr_extensions != old.lr_extensions):
            # more sizes, or another --lr-extensions K: the cells trained so far stay valid and are reused
            old.sizes = spec.sizes or old.sizes
            old.lr_extensions = spec.lr_extensions
            atomic_write(f, json.dumps({"spec": old.to_dict(), "plan": old_plan}, indent=2) + "\n")
        return old, old_plan
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / temp_name(SPEC_FILE)
    try:
        with open(tmp, "w") as fh:
            fh.write(json.dumps({"spec": spec.to_dict(), "plan": plan}, indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, f)  # atomic create-if-absent, also on NFS
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return read_spec(out)
