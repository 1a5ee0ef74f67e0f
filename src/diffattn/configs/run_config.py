"""The run config: one typed :class:`RunConfig` (``task`` and the ``model``, ``train``, ``data`` and ``classify``
sections as dataclasses), parsed once from a TOML file and ``--section.field value`` overrides by walking the
dataclasses' field types, validated once (one-line :class:`ConfigError`), written as TOML (``resolved.toml``, by
:mod:`diffattn.configs.toml_writer`) and read back from a checkpoint's ``run_config`` (old layouts included). The
packaged configs. Knows the model's config but no training loop (torchtitan's "config manager")."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from diffattn.configs.fields import ConfigError, Given, checked, coerce, is_table, literal, parse_literal
from diffattn.configs.packaged import ConfigNotFound, config_path
from diffattn.configs.retrofit import RetrofitConfig
from diffattn.model.blocks import CHECKPOINTING
from diffattn.model.config import ModelConfig
from diffattn.untrusted import Refused, read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
    lr: float = 1e-3
    min_lr: float = 1e-4
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
        return _section(cls, data, "data")

    def to_dict(self) -> dict[str, Any]:
        """The keys that differ from their defaults (what the data readers take; they default the rest alike)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != _default(f)}


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


SECTIONS: dict[str, type] = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig,
                             "classify": ClassifyConfig, "retrofit": RetrofitConfig}
TASKS = ("lm", "classify")  # what a run trains
MODEL_TASKS = (*TASKS, "encoder")  # what a model folder holds (a bare encoder only in a save_pretrained folder)


@dataclass
class RunConfig:
    """A whole run: ``task`` ("lm" or "classify") and one typed section each. ``model`` is complete once the data
    is known (:meth:`resolve_model`); ``model_given`` names the model fields the config set (the others are
    defaults: vocab_size then comes from the data, max_seq_len covers train.seq_len). ``study``: the cell of a
    study this run is (arm, lr, seed, d_model), recorded by the study, not read by training. A run config built
    in code has its model complete (``model_given``: every field); one parsed from a file, the fields it set.

    Read back from any folder diffattn writes (a checkpoint's ``run_config``, ``cell.json``, a save_pretrained
    folder), it is this same type. ``recorded``: the sections it has: all of them for a run; a model that no run
    trained (``convert``, a save_pretrained folder: :meth:`of_model`) has only its model (and a classifier's head),
    so its train and data sections are defaults, not a record; :meth:`to_dict` writes the recorded ones."""

    task: str = "lm"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    classify: ClassifyConfig = field(default_factory=ClassifyConfig)
    retrofit: RetrofitConfig = field(default_factory=RetrofitConfig)
    study: dict[str, Any] | None = None
    model_given: frozenset[str] = field(default=frozenset(f.name for f in dataclasses.fields(ModelConfig)),
                                        compare=False, repr=False)
    recorded: frozenset[str] = field(default=frozenset(SECTIONS), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.task not in MODEL_TASKS:
            raise ConfigError(f"task must be 'lm' or 'classify', got {self.task!r}")
        if self.retrofit.active and self.retrofit.steps > self.train.steps:
            raise ConfigError(f"retrofit: the schedule ({self.retrofit.steps} steps) is longer than the run "
                              f"({self.train.steps} steps): it would never reach the target type")

    @classmethod
    def of_model(cls, model: ModelConfig, task: str = "lm", classify: ClassifyConfig | None = None) -> RunConfig:
        """The run config of a model that no run trained (converted, or read from a save_pretrained folder)."""
        return cls(task=task, model=model, classify=classify or ClassifyConfig(),
                   recorded=frozenset({"model"} | ({"classify"} if classify is not None else set())))

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``run_config`` layout: {"task", "model", "train", "data", "classify"[, "retrofit"][,
        "study"]} (the :attr:`recorded` sections; ``retrofit`` when the run is one)."""
        out = {"task": self.task, "model": self.model.to_dict(), "train": dataclasses.asdict(self.train),
               "data": self.data.to_dict(),
               "classify": dataclasses.asdict(self.classify) if self.task == "classify" else {}}
        out = {k: v for k, v in out.items() if k == "task" or k in self.recorded}
        if self.retrofit.active:  # recorded only by a retrofit: every other run's record is as it was
            out["retrofit"] = dataclasses.asdict(self.retrofit)
        if self.study is not None:
            out["study"] = dict(self.study)
        return out

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> RunConfig:
        """A run config from its dict layout (a checkpoint's ``run_config``, ``cell.json``), checked; the
        sections it has are :attr:`recorded`."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"a run config must be a table, got {type(cfg).__name__}")
        return _build_run(json.loads(json.dumps(cfg)), frozenset(k for k in SECTIONS if k in cfg))

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def resolve_model(self, vocab_size: int | None) -> RunConfig:
        """This run with its model complete: vocab_size defaults to the data's (``vocab_size``) and must hold it,
        max_seq_len defaults to at least train.seq_len. Raises ConfigError."""
        given, m, seq_len = self.model_given, self.model, self.train.seq_len
        changes: dict[str, Any] = {}
        if "vocab_size" not in given:
            if vocab_size is None:
                raise ConfigError("model.vocab_size is not set and the data source does not report a vocab_size")
            changes["vocab_size"] = int(vocab_size)
        elif vocab_size is not None and m.vocab_size < vocab_size:
            raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than the data's vocabulary "
                              f"({vocab_size})")
        if "max_seq_len" not in given:
            changes["max_seq_len"] = max(ModelConfig.max_seq_len, seq_len)
        elif m.max_seq_len < seq_len:
            raise ConfigError(f"train.seq_len ({seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
        model = checked(lambda: m.replace(**changes))
        return self.replace(model=model, model_given=frozenset(f.name for f in dataclasses.fields(ModelConfig)))




def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# -------------------------------------------------------------------------------------- the walk over fields
def _section(cls: type, table: Any, name: str) -> Any:
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


def _build_run(cfg: dict[str, Any], recorded: frozenset[str] | None = None) -> RunConfig:
    unknown = sorted(set(cfg) - {"task", "study", *SECTIONS})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; valid: {['task', *SECTIONS]}")
    task = cfg.get("task", "lm")
    if task not in MODEL_TASKS:
        raise ConfigError(f"task must be 'lm' or 'classify', got {task!r}")
    model = cfg.get("model", {})
    sections = {name: _section(cls, cfg.get(name, {}), name) for name, cls in SECTIONS.items()}
    study = cfg.get("study")
    return RunConfig(task=task, study=dict(study) if isinstance(study, dict) else None,
                     model_given=frozenset(model) if isinstance(model, dict) else frozenset(),
                     recorded=frozenset(SECTIONS) if recorded is None else recorded, **sections)


# --------------------------------------------------------------------------------------- command-line overrides
def parse_overrides(extra: list[str]) -> list[tuple[list[str], str | None]]:
    """``["--train.steps", "100", "--model.d_model=64"]`` -> ``[(["train", "steps"], "100"), ...]``; a key
    followed by nothing or by another ``--`` option is a bare flag (value None, true for a bool field)."""
    out: list[tuple[list[str], str | None]] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field VALUE "
                              f"(sections: {', '.join(SECTIONS)})")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                val = None  # a bare --section.flag: a bool field becomes true
            else:
                val = extra[i + 1]
                i += 1
        i += 1
        path = key.split(".")
        if len(path) < 2 or path[0] not in SECTIONS or not all(path):
            raise ConfigError(f"unknown option --{key}; overrides look like --section.field VALUE with section "
                              f"in {list(SECTIONS)} (e.g. --train.steps 100)")
        out.append((path, val))
    return out


def apply_overrides(cfg: dict[str, Any], overrides: list[tuple[list[str], str | None]]) -> dict[str, Any]:
    """Put parsed overrides into a run config's dict layout (in place; returns it), each checked against its
    field's declared type now, so that an error names the option (``--train.steps: expected an int``). A table
    field (``--model.attn_options.qk_norm``) and a synthetic task's parameters take literals."""
    for path, raw in overrides:
        section, name, where = path[0], path[1], "--" + ".".join(path)
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        tp = hints.get(name)
        if raw is None:
            if len(path) != 2 or tp is not bool:
                raise ConfigError(f"override {where} needs a value")
            raw = "true"
        sec = cfg.setdefault(section, {})
        if tp is None and not (cls is DataConfig and sec.get("synthetic") is not None):
            hint = " (other keys are task parameters and need data.synthetic)" if cls is DataConfig else ""
            valid = sorted(f.name for f in dataclasses.fields(cls) if f.init)
            raise ConfigError(f"{where}: unknown {section} field {name!r}; valid: {valid}{hint}")
        if len(path) == 2:
            sec[name] = coerce(Given(raw), tp, where) if tp is not None else parse_literal(raw)
            continue
        if tp is not None and not is_table(tp):
            raise ConfigError(f"{where}: {section}.{name} is not a table")
        node = sec
        for p in path[1:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {p!r} is not a table")
        node[path[-1]] = parse_literal(raw)
    return cfg


def load_run_config(config: str | os.PathLike | None, overrides: list[str] | None = None,
                    base: RunConfig | dict[str, Any] | None = None) -> RunConfig:
    """The run config of a TOML file (or packaged name), or of ``base`` (a checkpoint's run config, or its dict
    layout), with the command-line ``overrides`` applied: parsed and checked once; a run's task is "lm" or
    "classify". The model is resolved against the data later (:meth:`RunConfig.resolve_model`)."""
    if base is not None:
        cfg = base.to_dict() if isinstance(base, RunConfig) else json.loads(json.dumps(base))
    elif config is not None:
        try:
            path = config_path(str(config))
        except ConfigNotFound as e:
            raise ConfigError(str(e)) from None
        try:  # a FIFO, a huge file or a document nested too deeply is refused before or while it is read
            cfg = read_toml(path)
        except Refused as e:
            raise ConfigError(str(e)) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
    else:
        cfg = {}
    for name in SECTIONS:
        if not isinstance(cfg.get(name, {}), dict):
            raise ConfigError(f"[{name}] must be a table, got {cfg[name]!r}")
    run = _build_run(apply_overrides(cfg, parse_overrides(overrides or [])))
    if run.task not in TASKS:
        raise ConfigError(f"task must be 'lm' or 'classify', got {run.task!r}")
    try:  # a tracker this machine lacks is refused before the run starts
        parse_trackers(run.train.tracker)
    except ValueError as e:
        raise ConfigError(f"TrainConfig: {e}") from None
    return run


def resolve_model_config(run: RunConfig, vocab_size: int | None) -> ModelConfig:
    """The run's complete ModelConfig (:meth:`RunConfig.resolve_model`)."""
    return run.resolve_model(vocab_size).model


# Written by the run itself, not set by hand: left out of the list.
_RECORDED = {("data", "fingerprint")}
# Defaults that the run derives when the field is not set (the dataclass's own default is not what a run gets).
_DERIVED = {("model", "vocab_size"): "from the data", ("model", "max_seq_len"): ">= train.seq_len"}


def field_items() -> dict[str, list[str]]:
    """{section: ["field=default", ...]}: the --section.field overrides ``diffattn train`` takes, from the
    dataclasses (:data:`diffattn.configs.field_list.FIELDS` is this, kept where ``--help`` reads it without
    torch; a test keeps the two equal)."""
    out: dict[str, list[str]] = {}
    for name, cls in SECTIONS.items():
        items = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if (name, f.name) in _RECORDED:
                continue
            if (name, f.name) in _DERIVED:
                items.append(f"{f.name} ({_DERIVED[name, f.name]})")
            else:
                items.append(f"{f.name}={default!r}" if default not in (None, {}, []) else f.name)
        out[name] = items
    return out
