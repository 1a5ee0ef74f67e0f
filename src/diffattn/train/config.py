"""Run configuration: ``TrainConfig``, TOML run configs with ``--section.field value`` overrides, and the
packaged configs. Knows the model's config but no training loop (torchtitan's "config manager")."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from diffattn.model.blocks import CHECKPOINTING
from diffattn.model.config import ModelConfig
from diffattn.train.trackers import parse_trackers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
            parse_trackers(self.tracker)
        except ValueError as e:
            need(False, str(e))


SECTIONS = ("model", "train", "data", "classify")
# The [data] keys data.make_source reads, with their types; a synthetic task also takes its own parameters.
DATA_TYPES: dict[str, Any] = {
    "path": str | None,
    "tokenizer": str,
    "vocab_size": int | None,
    "val_fraction": float,
    "synthetic": str | None,
    "params": dict,
    # record corpora (.jsonl/.json/.parquet, see diffattn.data.records); text_field also names a classifier's text
    "text_field": str | None,
    "bpe_sample_mb": float | None,
    "cache_dir": str | None,
    # classification files (task = "classify"; see textcls_data.py)
    "test_path": str | None,
    "text_columns": str | list | None,
    "label_column": str | int | None,
    "no_header": bool,
    "split_seed": int,
    "fingerprint": dict | None,  # written by `diffattn train`: the data's absolute path, sizes and sha256
}


class ConfigError(ValueError):
    """A run config or a command-line override is invalid."""


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_literal(raw: str) -> Any:
    """Untyped value from the command line: bool, None, int, float, JSON list/dict, else the string."""
    low = raw.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.strip()[:1] in ("[", "{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` (a CLI string or a TOML value) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot parse {value!r}")
    if tp is Any:
        return _parse_literal(value) if isinstance(value, str) else value
    base = origin or tp
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.strip().lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected a bool (true/false), got {value!r}")
    if base in (int, float):  # an int field takes ints only; a float field takes any number
        accepted = (int,) if base is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return base(value)
        if isinstance(value, str):
            try:
                return base(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected {'an int' if base is int else 'a number'}, got {value!r}")
    if base is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if base is dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            try:
                v = json.loads(value)
            except json.JSONDecodeError:
                v = None
            if isinstance(v, dict):
                return v
        raise ConfigError(f"{where}: expected a table / JSON object, got {value!r}")
    return value


def _section_schema(section: str) -> dict[str, Any] | None:
    """Field name -> type for the typed sections (model, train, data); None for the open classify section."""
    if section == "model":
        return _field_types(ModelConfig)
    if section == "train":
        return _field_types(TrainConfig)
    if section == "data":
        return DATA_TYPES
    return None


def parse_overrides(extra: list[str]) -> list[tuple[list[str], str | None]]:
    """``["--train.steps", "100", "--model.d_model=64"]`` -> ``[(["train", "steps"], "100"), ...]``; a key
    followed by nothing or by another ``--`` option is a bare flag (value None, true for a bool field)."""
    out: list[tuple[list[str], str | None]] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.field VALUE "
                f"(sections: {', '.join(SECTIONS)})"
            )
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                val = None  # a bare --section.flag: apply_overrides sets a bool field to true
            else:
                val = extra[i + 1]
                i += 1
        i += 1
        path = key.split(".")
        if len(path) < 2 or path[0] not in SECTIONS or not all(path):
            raise ConfigError(
                f"unknown option --{key}; overrides look like --section.field VALUE with section "
                f"in {list(SECTIONS)} (e.g. --train.steps 100)"
            )
        out.append((path, val))
    return out


def apply_overrides(cfg: dict[str, Any], overrides: list[tuple[list[str], str | None]]) -> dict[str, Any]:
    """Apply parsed overrides to a run config (in place; returns it). Typed fields (model, train, the data
    keys) are checked by name and converted with their declared type; a synthetic task's extra data keys and
    the classify section are parsed as literals (true/false/none/int/float/JSON, else string), or typed like
    the value they replace."""
    for path, raw in overrides:
        section, name = path[0], path[1]
        where = "--" + ".".join(path)
        if raw is None:
            if len(path) != 2 or (_section_schema(section) or {}).get(name) is not bool:
                raise ConfigError(f"override {where} needs a value")
            raw = "true"
        sec = cfg.setdefault(section, {})
        schema = _section_schema(section)
        open_section = schema is None or (section == "data" and sec.get("synthetic") is not None)
        if schema is not None and name in schema:
            if len(path) == 2:
                sec[name] = _coerce(raw, schema[name], where)
                continue
            if typing.get_origin(schema[name]) is not dict and schema[name] is not dict:
                raise ConfigError(f"{where}: {section}.{name} is not a table")
        elif not open_section:
            hint = " (other keys are task parameters and need data.synthetic)" if section == "data" else ""
            raise ConfigError(f"{where}: unknown {section} field {name!r}; valid: {sorted(schema)}{hint}")
        node = sec
        for p in path[1:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {p!r} is not a table")
        leaf, current = path[-1], node.get(path[-1])
        if isinstance(current, str) and raw.strip().lower() not in ("none", "null"):
            node[leaf] = raw
        elif isinstance(current, bool):
            node[leaf] = _coerce(raw, bool, where)
        elif isinstance(current, (int, float)):
            node[leaf] = _coerce(raw, int | float if isinstance(current, int) else float, where)
        else:
            node[leaf] = _parse_literal(raw)
    return cfg


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check sections and field names, convert typed fields, and fill the train section's defaults."""
    unknown = sorted(set(cfg) - {"task", *SECTIONS})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; valid: {['task', *SECTIONS]}")
    task = cfg.setdefault("task", "lm")
    if task not in ("lm", "classify"):
        raise ConfigError(f"task must be 'lm' or 'classify', got {task!r}")
    for section in SECTIONS:
        sec = cfg.setdefault(section, {})
        if not isinstance(sec, dict):
            raise ConfigError(f"[{section}] must be a table, got {sec!r}")
        schema = _section_schema(section)
        if schema is None:
            continue
        bad = sorted(set(sec) - set(schema))
        if bad and not (section == "data" and sec.get("synthetic") is not None):
            raise ConfigError(f"unknown {section} field(s) {bad}; valid: {sorted(schema)}")
        for k, v in list(sec.items()):
            if k in schema:
                sec[k] = _coerce(v, schema[k], f"{section}.{k}")
    try:
        cfg["train"] = dataclasses.asdict(TrainConfig(**cfg["train"]))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return cfg


def config_path(name: str) -> Path:
    """A TOML path, or the name of a packaged config (``tiny`` -> diffattn/configs/tiny.toml)."""
    p = Path(name)
    if p.is_file():
        return p
    if len(p.parts) == 1 and not name.endswith(".toml"):
        packaged = resources.files("diffattn") / "configs" / f"{name}.toml"
        if packaged.is_file():
            return Path(str(packaged))
    raise ConfigError(
        f"config {name!r} not found: not a file, and not a packaged config "
        f"(available: {', '.join(packaged_configs())})"
    )


def packaged_configs() -> list[str]:
    d = resources.files("diffattn") / "configs"
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".toml")) if d.is_dir() else []


def load_run_config(
    config: str | os.PathLike | None, overrides: list[str] | None = None, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """TOML file (or packaged name) + command-line overrides -> normalized run config (model section partial:
    vocab_size is filled from the data later, see :func:`resolve_model_config`)."""
    if base is not None:
        cfg = json.loads(json.dumps(base))
    elif config is not None:
        path = config_path(str(config))
        try:
            cfg = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from e
    else:
        cfg = {}
    apply_overrides(cfg, parse_overrides(overrides or []))
    return normalize_config(cfg)


def resolve_model_config(cfg: dict[str, Any], vocab_size: int | None) -> ModelConfig:
    """ModelConfig from the model section; vocab_size defaults to the data's, max_seq_len to >= seq_len."""
    m = dict(cfg["model"])
    if "vocab_size" not in m:
        if vocab_size is None:
            raise ConfigError("model.vocab_size is not set and the data source does not report a vocab_size")
        m["vocab_size"] = int(vocab_size)
    elif vocab_size is not None and m["vocab_size"] < vocab_size:
        raise ConfigError(
            f"model.vocab_size ({m['vocab_size']}) is smaller than the data's vocabulary ({vocab_size})"
        )
    seq_len = cfg["train"]["seq_len"]
    m.setdefault("max_seq_len", max(ModelConfig.max_seq_len, seq_len))
    if m["max_seq_len"] < seq_len:
        raise ConfigError(f"train.seq_len ({seq_len}) exceeds model.max_seq_len ({m['max_seq_len']})")
    try:
        return ModelConfig.from_dict(m)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # JSON string escapes are valid TOML basic-string escapes; TOML also wants DEL escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        if any(x is None for x in v):
            raise ConfigError(f"TOML arrays cannot hold None: {v!r}")
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{" + items + "}"
    raise ConfigError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _toml_key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def to_toml(cfg: dict[str, Any]) -> str:
    """Write a run config as TOML (None values, which TOML cannot express, become comments and read back as
    absent -> the field's default). Nested tables in a section are written as inline tables."""
    lines: list[str] = []
    scalars = {k: v for k, v in cfg.items() if not isinstance(v, dict)}
    for k, v in scalars.items():
        lines.append(f"# {k} = None" if v is None else f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in cfg.items():
        if not isinstance(v, dict):
            continue
        lines += ["", f"[{_toml_key(k)}]"]
        for kk, vv in v.items():
            lines.append(f"# {kk} = None" if vv is None else f"{_toml_key(kk)} = {_toml_value(vv)}")
    return "\n".join(lines) + "\n"
