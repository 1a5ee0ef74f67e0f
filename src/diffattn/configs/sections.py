"""The run config's sections that need no model: :class:`TrainConfig`, :class:`DataConfig`, :class:`ClassifyConfig`,
with the walk that reads a section from a table (:func:`read_section`) and lists its fields and defaults
(:func:`section_items`). Imports no torch: ``diffattn train --help`` lists these defaults from the dataclasses
themselves (:mod:`diffattn.configs.field_list`), so a default is written once, here. The whole run config, with
the model's section, is :mod:`diffattn.configs.run_config`."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from diffattn.configs.fields import ConfigError, checked, coerce, literal

# Where a run's scalars go besides metrics.csv (train.tracker; the trackers are diffattn.train.trackers').
TRACKERS = ("tensorboard", "wandb")
_EXTRA = {"tensorboard": "tb", "wandb": "wandb"}


def parse_trackers(value: str, installed: bool = True) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ("tensorboard", "wandb"); ``"none"`` or ``""`` -> (). ValueError for an
    unknown name, or (``installed``) for ``wandb`` when the wandb package is not installed (a one-line message
    naming the extra): a run asks that before it starts; a run config read back from a checkpoint does not."""
    if not isinstance(value, str):
        raise ValueError(f"tracker must be a string such as 'tensorboard,wandb' or 'none', got {value!r}")
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    if names == ("none",):
        return ()
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"tracker: unknown {bad}; choose from {', '.join(TRACKERS)} (comma-separated) or none")
    if installed and "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ValueError("tracker 'wandb' needs the wandb package, which is not installed: "
                         f"pip install 'diffattn[{_EXTRA['wandb']}]' (or wandb)")
    return names


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 1e-3  # the one general default: compare, the study and the packaged configs say why theirs differ
    min_lr: float = 1e-4  # lr / 10 (the cosine schedule's floor)
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 0  # 0: checkpoint at each evaluation and at the end
    keep_checkpoints: int = 2  # the newest in OUT/ckpt, older ones in OUT/ckpt-step-<N> (a fallback if it is corrupt)
    seed: int = 1337
    dtype: str = "float32"  # "bfloat16" / "float16": autocast where the device supports it
    compile: bool = False  # torch.compile each block (regional compilation); off: eager
    # Activation checkpointing of each block: "none"; "full" (recompute the block in the backward);
    # "selective" (keep matmul and attention outputs, recompute the element-wise ops)
    activation_checkpointing: str = "none"
    deterministic: bool = False
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard)
    # Differential attention: scale λ (V1) / sigmoid(W_λ x) (V2) by min(1, step / lambda_warmup_steps), ramping
    # the negative map in from 0 (e.g. after `diffattn convert`); 0: off.
    lambda_warmup_steps: int = 0
    # Early-training diagnostics (diagnostics.py: per-layer attention/residual RMS, λ, gradient norms per
    # parameter group) every log_every steps up to this step, in diagnostics.csv; 0: off. Read-only: training
    # is unchanged.
    diag_early_steps: int = 0
    # Where the scalars go besides metrics.csv: "tensorboard", "wandb", both comma-separated, or "none"
    # (diffattn.train.trackers).
    tracker: str = "tensorboard"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"TrainConfig: {msg}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "keep_checkpoints"):
            v = getattr(self, name)
            need(is_int(v) and v > 0, f"{name} must be a positive int, got {v!r}")
        for name in ("warmup_steps", "eval_every", "eval_batches", "ckpt_every", "seed", "lambda_warmup_steps",
                     "diag_early_steps"):
            v = getattr(self, name)
            need(is_int(v) and v >= 0, f"{name} must be an int >= 0, got {v!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v),
                f"{name} must be a finite number >= 0, got {v!r}",
            )
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and 0.0 <= v < 1.0, f"{name} must be in [0, 1), got {v!r}")
        need(
            self.dtype in ("float32", "bfloat16", "float16"),
            f"dtype must be float32|bfloat16|float16, got {self.dtype!r}",
        )
        need(self.parallel in ("ddp", "fsdp"), f"parallel must be ddp|fsdp, got {self.parallel!r}")
        from diffattn.model.blocks import CHECKPOINTING  # its torch: a run config built, not `train --help`

        need(self.activation_checkpointing in CHECKPOINTING,
             f"activation_checkpointing must be {'|'.join(CHECKPOINTING)}, got {self.activation_checkpointing!r}")
        need(self.eval_every == 0 or self.eval_batches > 0, "eval_batches must be > 0 when eval_every > 0")
        for name in ("compile", "deterministic"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        try:
            parse_trackers(self.tracker, installed=False)
        except ValueError as e:
            need(False, str(e))


@dataclass
class DataConfig:
    """The ``[data]`` section: what :func:`diffattn.data.lm.make_source` (a language model) and
    :mod:`diffattn.data.classification` (a classifier) read. A synthetic task's own parameters go in ``params``
    (a ``[data]`` key that is no field, with ``synthetic`` set, is one of them)."""

    path: str | None = None  # text file, folder, .bin token file; a classifier's .csv/.jsonl training file
    tokenizer: str = "char"  # "char", "bpe", or a Hugging Face tokenizer.json
    vocab_size: int | None = None  # BPE vocabulary size
    val_fraction: float = 0.1
    synthetic: str | None = None  # a built-in task (diffattn.data.synthetic) instead of path
    params: dict[str, Any] = field(default_factory=dict)  # the synthetic task's parameters
    # record corpora (.jsonl/.json/.parquet, see diffattn.data.records); text_field also names a classifier's text
    text_field: str | None = None
    bpe_sample_mb: float | None = None
    cache_dir: str | None = None
    # classification files (task = "classify"; see diffattn.data.classification)
    test_path: str | None = None
    text_columns: str | list | None = None
    label_column: str | int | None = None
    no_header: bool = False
    split_seed: int = 0
    fingerprint: dict | None = None  # written by `diffattn train`: the data's absolute path, sizes and sha256

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        fp = self.fingerprint  # read back from a checkpoint: its readers (resume, eval, a model card) trust it
        if fp is not None and not (isinstance(fp.get("path"), str) and isinstance(fp.get("files"), dict) and all(
                isinstance(m, dict) and isinstance(m.get("bytes"), int) and isinstance(m.get("sha256"), str)
                for m in fp["files"].values())):
            raise ValueError('data.fingerprint must be {"path": str, "files": {name: {"bytes", "sha256"}}}')

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataConfig:
        """A ``[data]`` section (e.g. a checkpoint's), checked."""
        return read_section(cls, data, "data")

    def to_dict(self) -> dict[str, Any]:
        """The keys that differ from their defaults (what the data readers take; they default the rest alike)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != default(f)}


@dataclass
class ClassifyConfig:
    """The ``[classify]`` section: the head of a classifier. ``num_classes`` (optional) is checked against the
    data; ``labels`` (class id i means labels[i]) is recorded by the run, so a resumed run keeps the mapping."""

    pooling: str = "mean"  # "mean" over the real tokens, or "first"
    num_classes: int | None = None
    labels: list[str] | None = None

    def __post_init__(self) -> None:
        if self.pooling not in ("mean", "first"):
            raise ValueError(f"classify.pooling must be 'mean' or 'first', got {self.pooling!r}")


def default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def read_section(cls: type, table: Any, name: str) -> Any:
    """The section ``name`` as a ``cls``: every key a field of it, converted to the field's type, then the
    dataclass's own checks. A synthetic task's extra ``[data]`` keys move into ``params``."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    extra = sorted(set(table) - fields)
    if extra and cls is DataConfig and table.get("synthetic") is not None:
        params = dict(coerce(table.get("params", {}), dict, "data.params"))
        table = {**{k: v for k, v in table.items() if k in fields},
                 "params": {**params, **{k: literal(table[k]) for k in extra}}}
    elif extra:
        hint = " (other keys are task parameters and need data.synthetic)" if cls is DataConfig else ""
        raise ConfigError(f"unknown {name} field(s) {extra}; valid: {sorted(fields)}{hint}")
    values = {k: coerce(v, hints[k], f"{name}.{k}") for k, v in table.items()}
    return checked(lambda: cls(**values))


# Written by the run itself, not set by hand: left out of the list.
_RECORDED = {("data", "fingerprint")}
# Defaults that the run derives when the field is not set (the dataclass's own default is not what a run gets).
_DERIVED = {("model", "vocab_size"): "from the data", ("model", "max_seq_len"): ">= train.seq_len"}


def section_items(name: str, cls: type) -> list[str]:
    """["field=default", ...] of the section ``name`` (dataclass ``cls``): the --name.field overrides ``diffattn
    train`` takes, each with the default a run gets."""
    items = []
    for f in dataclasses.fields(cls):
        if (name, f.name) in _RECORDED:
            continue
        value = default(f)
        if (name, f.name) in _DERIVED:
            items.append(f"{f.name} ({_DERIVED[name, f.name]})")
        else:
            items.append(f"{f.name}={value!r}" if value not in (None, {}, []) else f.name)
    return items
