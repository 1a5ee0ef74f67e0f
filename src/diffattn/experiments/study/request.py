"""What ``diffattn study`` is asked, read from its options: how it runs (:func:`study_run`: a
:class:`~diffattn.experiments.study.launch.StudyRun`) and what it studies (:func:`spec_from_options`: the defaults or
``--quick`` overridden by what was given, every arm and size checked to be a valid model shape), and
:func:`run_study`, the command's one call. The options are the parsed command line as a mapping (``vars(args)``):
an option the mapping lacks is not given. A bad option raises StudyError (one line)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffattn.attention.registry import ATTENTION
from diffattn.experiments.study.defaults import DEFAULT_LR_EXTENSIONS, TEXT_DEFAULTS, TEXT_QUICK, default_head_dim
from diffattn.experiments.study.launch import StudyRun, launch, run_worker
from diffattn.experiments.study.source import source_spec
from diffattn.experiments.study.spec import (
    StudyError,
    StudySpec,
    default_lrs,
    default_sizes,
    head_counts,
    parse_variant,
)

Options = Mapping[str, Any]


def run_study(o: Options) -> int:
    """``diffattn study DATA ...`` (or ``--worker``): the library does the work and says how it ended."""
    opts = study_run(o)
    if o.get("worker"):
        return run_worker(opts)
    return launch(opts, lambda: spec_from_options(o))


def study_run(o: Options) -> StudyRun:
    """How the study runs, from the options (what it studies is :func:`spec_from_options`')."""
    return StudyRun(out=Path(o["out"]) if o.get("out") else None, jobs=o.get("jobs", 1), threads=o.get("threads", 1),
                    storage=o.get("storage"), budget_minutes=o.get("budget_minutes"),
                    probe_seconds=o.get("probe_seconds"), quick=bool(o.get("quick")),
                    lr_extensions_given=o.get("lr_extensions") is not None,
                    **{k: o[f] for k, f in (("grace_s", "grace_seconds"), ("poll_s", "poll_seconds"),
                                            ("progress_s", "progress_seconds")) if o.get(f) is not None},
                    verbose=bool(o.get("verbose")), bar=not o.get("no_progress") and sys.stderr.isatty(),
                    spawned_by=o.get("spawned_by"), argv=o.get("_argv"))


def _floats(s: str, what: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise StudyError(f"{what} must be comma-separated numbers, got {s!r}") from None
    if not v or any(not (x > 0 and math.isfinite(x)) for x in v):
        raise StudyError(f"{what} must be positive numbers, got {s!r}")
    return v


def _base(o: Options) -> dict[str, int]:
    """The shape and schedule: the defaults (or ``--quick``'s) overridden by what was given."""
    base = dict(TEXT_QUICK if o.get("quick") else TEXT_DEFAULTS)
    return {k: o[k] if o.get(k) is not None else v for k, v in base.items()}


def _variants(o: Options) -> list[str]:
    variants = [v.strip() for v in (o.get("variants") or "").split(",") if v.strip()]
    unknown = [v for v in variants if v.split("+")[0].strip() not in ATTENTION]
    if unknown:
        raise StudyError(f"unknown attention variant(s) {unknown}; registered: {sorted(ATTENTION)}")
    for v in variants:
        parse_variant(v)
    if any(v in ("diff", "standard") or variants.count(v) > 1 for v in variants):
        raise StudyError("variants listed twice (diff and standard are always trained)")
    return variants


def _lrs(o: Options) -> list[float] | None:
    """--lrs, or --lr alone; None: neither given."""
    if o.get("lrs"):
        return _floats(o["lrs"], "--lrs")
    return [o["lr"]] if o.get("lr") else None


def _seeds(o: Options) -> int:
    seeds = o.get("seeds", 3)
    if seeds < 1:
        raise StudyError(f"--seeds must be >= 1, got {seeds}")
    return seeds


def spec_from_options(o: Options) -> StudySpec:
    """The study the options ask for, every arm and size checked to be a valid model shape. Raises StudyError
    (one line)."""
    if o.get("source"):
        return _source_spec(o)
    if o.get("retrofit_steps") is not None:
        raise StudyError("--retrofit-steps applies only with --from SRC (a retrofit starts from a pretrained model)")
    base = _base(o)
    data = o.get("data")
    if data is None:
        raise StudyError("give the data to study: diffattn study DATA (a text file or folder), or --worker --out DIR")
    if not Path(data).exists():
        raise StudyError(f"data {data!r} does not exist (give a text file or a folder of text files)")
    heads = [int(x) for x in _floats(o["heads"], "--heads")] if o.get("heads") else [base["n_heads"]]
    variants = _variants(o)
    head_dims = _head_dims(o, base["d_model"])
    lrs = _lrs(o) or default_lrs(base["d_model"])
    seeds = _seeds(o)
    sizes: list[int] = []
    if o.get("sizes") == "auto":
        sizes = default_sizes(base["d_model"], [base["d_model"] // (2 * d) for d in head_dims] or heads)
    elif o.get("sizes"):
        sizes = sorted({int(x) for x in _floats(o["sizes"], "--sizes")} | {base["d_model"]})
    if o.get("vocab_size") is not None and o.get("tokenizer") != "bpe":
        raise StudyError("--vocab-size applies only to --tokenizer bpe")
    spec = StudySpec.from_dict(dict(
        data=str(Path(data).resolve()), tokenizer=o.get("tokenizer") or "char", val_tokens=_val_tokens(o),
        vocab_size=o.get("vocab_size"), d_model=base["d_model"], n_layers=base["n_layers"], heads=heads,
        variants=variants, lrs=lrs, seeds=list(range(seeds)), seq_len=base["seq_len"],
        batch_size=base["batch_size"], steps=base["steps"], sizes=sizes, head_dims=head_dims,
        **_k_and_diag(o, base["steps"]), **_eval_batches(o),
    ))
    try:  # every arm and size must be a valid model shape
        for a in spec.arms():
            for d in [spec.model.d_model] + spec.ladder_sizes():
                spec.arm_config(a, 256, d)
    except ValueError as e:
        raise StudyError(str(e)) from None
    return spec


def _source_spec(o: Options) -> StudySpec:
    """``--from SRC``: the retrofit study (:func:`diffattn.experiments.study.source.source_spec` checks it)."""
    if o.get("data") is None:
        raise StudyError("give the data to study: diffattn study DATA --from SRC")
    base = _base(o)
    shape = {k: o.get(k) for k in ("d_model", "n_layers", "n_heads", "head_dim")}
    for flag in ("--heads", "--head-dims", "--sizes", "--tokenizer", "--vocab-size"):
        if o.get(flag[2:].replace("-", "_")) is not None:
            raise StudyError(f"{flag} does not apply with --from: the model's shape and tokenizer are SRC's")
    lrs, seeds = _lrs(o), _seeds(o)
    return source_spec(o["data"], o["source"], variants=o.get("variants") or "", lrs=lrs, seeds=seeds,
                       steps=base["steps"], seq_len=base["seq_len"], batch_size=base["batch_size"],
                       val_tokens=_val_tokens(o), shape=shape, retrofit_steps=o.get("retrofit_steps"),
                       **_k_and_diag(o, base["steps"]), **_eval_batches(o))


def _eval_batches(o: Options) -> dict[str, int]:
    """--eval-batches and --evals, as given."""
    return {k: o[k] for k in ("eval_batches", "evals") if o.get(k) is not None}


def _val_tokens(o: Options) -> int | None:
    v = o.get("val_tokens")
    if v is not None and v < 1:
        raise StudyError(f"--val-tokens must be >= 1, got {v}")
    return v


def _head_dims(o: Options, d_model: int) -> list[int]:
    """--head-dim / --head-dims; none of them nor --heads/--n-heads: the default width (defaults.default_head_dim)."""
    if o.get("head_dim") is not None and o.get("head_dims"):
        raise StudyError("give --head-dim or --head-dims, not both")
    given = [o["head_dim"]] if o.get("head_dim") is not None else (
        [int(x) for x in _floats(o["head_dims"], "--head-dims")] if o.get("head_dims") else [])
    if given and (o.get("heads") or o.get("n_heads")):
        raise StudyError("--head-dim(s) derives the head counts: give it or --heads/--n-heads, not both")
    if not given:
        return [] if o.get("heads") or o.get("n_heads") else [default_head_dim(d_model)]
    if len(set(given)) != len(given):
        raise StudyError(f"--head-dims lists a width twice: {given}")
    for d in given:  # one line naming the width that does not fit
        for kind in ("diff", "standard"):
            head_counts(d_model, d, kind)
    return given


def _k_and_diag(o: Options, steps: int) -> dict[str, int]:
    k = DEFAULT_LR_EXTENSIONS if o.get("lr_extensions") is None else o["lr_extensions"]
    diag = min(500, steps) if o.get("diag_early_steps") is None else o["diag_early_steps"]
    if k < 0 or diag < 0:
        raise StudyError("--lr-extensions and --diag-early-steps must be >= 0")
    return {"lr_extensions": k, "diag_early_steps": diag}
