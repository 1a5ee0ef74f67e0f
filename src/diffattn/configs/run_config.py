"""The run config: one typed :class:`RunConfig` (``task`` and the ``model``, ``train``, ``data`` and ``classify``
sections as dataclasses), parsed once from a TOML file and ``--section.field value`` overrides by walking the
dataclasses' field types, validated once (one-line :class:`ConfigError`), written as TOML (``resolved.toml``, by
:mod:`diffattn.configs.toml_writer`) and read back from a checkpoint's ``run_config`` (old layouts included). The
packaged configs. Knows the model's config but no training loop (torchtitan's "config manager")."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from diffattn.configs.fields import ConfigError, Given, checked, coerce, is_table, parse_literal
from diffattn.configs.packaged import ConfigNotFound, config_path
from diffattn.configs.retrofit import RetrofitConfig
from diffattn.configs.sections import (
    ClassifyConfig,
    DataConfig,
    TrainConfig,
    parse_trackers,
    read_section,
    section_items,
)
from diffattn.model.config import MOVED_TO_OPTIONS, ModelConfig, migrate_fields
from diffattn.system.untrusted import Refused, read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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




def _build_run(cfg: dict[str, Any], recorded: frozenset[str] | None = None) -> RunConfig:
    unknown = sorted(set(cfg) - {"task", "study", *SECTIONS})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; valid: {['task', *SECTIONS]}")
    task = cfg.get("task", "lm")
    if task not in MODEL_TASKS:
        raise ConfigError(f"task must be 'lm' or 'classify', got {task!r}")
    model = cfg.get("model", {})
    if isinstance(model, dict):  # an old config's fields that became attention options
        model = cfg["model"] = checked(lambda: migrate_fields(model))
    sections = {name: read_section(cls, cfg.get(name, {}), name) for name, cls in SECTIONS.items()}
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
        where = "--" + ".".join(path)
        if path[0] == "model" and len(path) == 2 and path[1] in MOVED_TO_OPTIONS:  # an old spelling: the option
            if isinstance(cfg.get("model"), dict):
                cfg["model"].pop(path[1], None)  # the command line wins over the file's old spelling
            path, raw = ["model", "attn_options", path[1]], "true" if raw is None else raw
        section, name = path[0], path[1]
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


def field_items() -> dict[str, list[str]]:
    """{section: ["field=default", ...]}: the --section.field overrides ``diffattn train`` takes, from the
    dataclasses (:data:`diffattn.configs.field_list.FIELDS` reads the same, its model section written out)."""
    return {name: section_items(name, cls) for name, cls in SECTIONS.items()}
