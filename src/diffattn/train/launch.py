"""A run from a config, prepared and launched: what ``diffattn train`` does, for a language model and a classifier
alike.

:func:`prepare` validates before anything is written: the run config (a new run from ``--config``, a resumed run
from its checkpoint, or a fresh run started from a checkpoint's weights with ``--init-from``), the data (recorded
by fingerprint, so a resumed run notices a change), the checkpoint and the run folder (a
:class:`~diffattn.train.driver.RunFolder`), which it holds from before reading it until the command ends.
:func:`launch` then drives the run (:func:`diffattn.train.driver.drive`: build, claim the folder, write
``resolved.toml``, the one training loop) and says how it ended: one line and one exit code
(:func:`~diffattn.train.driver.exit_code`) for every failure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffattn.checkpoint.format import MANIFEST, Checkpoint, CheckpointError, load_checkpoint
from diffattn.checkpoint.model_folders import is_pretrained_folder, open_model_folder
from diffattn.checkpoint.output_guard import unsaved_run
from diffattn.checkpoint.run_folder import LATEST, load_run_checkpoint, resolve_checkpoint_dir
from diffattn.configs.packaged import packaged_configs
from diffattn.configs.run_config import ConfigError, RunConfig, load_run_config, parse_overrides
from diffattn.data.fingerprint import data_changes, data_fingerprint
from diffattn.data.lm import check_input
from diffattn.model.config import ModelConfig
from diffattn.ops import backends
from diffattn.system.atomic_files import printable as _p
from diffattn.system.io_errors import EX_IOERR
from diffattn.train.distributed import check_launch_env, setup_distributed
from diffattn.train.driver import (
    EXIT_DIVERGED,
    EXIT_USAGE,
    USAGE_ERRORS,
    RunFolder,
    RunOutcome,
    drive,
    exit_code,
    failure_line,
    main_rank,
    resume_hint,
)
from diffattn.train.preflight import check_memory
from diffattn.train.retrofit import check_source
from diffattn.train.signals import QuitOnSecondSignal, TrainingInterrupted


@dataclass
class RunRequest:
    """What ``diffattn train`` was asked: ``config`` a TOML path, a packaged name or a :class:`RunConfig`;
    ``overrides`` the ``--section.field value`` arguments; ``task`` replaces the config's."""

    config: str | RunConfig | None = None
    out: str | os.PathLike | None = None
    resume: bool = False
    overwrite: bool = False
    init_from: str | None = None
    task: str | None = None
    overrides: list[str] = field(default_factory=list)
    progress: bool = True


@dataclass
class Prepared:
    """A validated run: its config, its held folder, the checkpoint it resumes (``checkpoint``) or starts from
    (``init``)."""

    run: RunConfig
    folder: RunFolder
    checkpoint: Checkpoint | None = None
    init: Checkpoint | None = None

    @property
    def out(self) -> Path:
        return self.folder.path


def launch(req: RunRequest) -> int:
    """Prepare (:func:`prepare`) and drive the run; -> the exit code, after one line on stderr for a failure.
    The folder is held until this returns."""
    with ExitStack() as stack:
        try:
            prep = prepare(req, stack)
        except USAGE_ERRORS as e:
            print(f"error: {_p(e)}", file=sys.stderr)
            return EXIT_USAGE
        resume = f"diffattn train --out {prep.out} --resume"
        try:
            with QuitOnSecondSignal(hint=lambda: resume_hint(prep.out, resume)):  # a second Ctrl-C quits at once
                outcome = drive(prep.run, prep.folder, checkpoint=prep.checkpoint, init=prep.init,
                                progress=req.progress,
                                on_start=lambda run, model, checkpoint: print(_start_line(run, model, prep.out),
                                                                              file=sys.stderr))
        except BaseException as e:  # drive left the folder as it found it if the run never started
            code = exit_code(e)
            storage = code == EX_IOERR or (isinstance(e, TrainingInterrupted) and e.save_error is not None)
            if code is None or (storage and not main_rank()):  # rank 0 says what was kept
                raise
            if main_rank() or code in (EXIT_USAGE, EXIT_DIVERGED):
                print(failure_line(e, code, prep.out, resume), file=sys.stderr)
            return code
        if main_rank():
            _done(outcome, prep.out)
        return 0


def _start_line(run: RunConfig, model: torch.nn.Module, out: Path) -> str:
    m, t, threads, world = run.model, run.train, torch.get_num_threads(), setup_distributed().world
    what = (f"classifier: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {m.vocab_size}, "
            f"{run.classify.num_classes} classes" if run.task == "classify"
            else f"LM: {model.num_params():,} parameters, vocab {m.vocab_size}")
    r = run.retrofit
    if r.active:
        layers = [i for i, a in enumerate(m.layer_attention or [m.attention] * m.n_layers) if a == r.to]
        what += (f", retrofitted from standard over {r.steps} steps ({r.shape}), layers "
                 f"{'all' if len(layers) == m.n_layers else layers}")
        if m.diff_heads is not None:
            what += f", heads {sum(map(len, m.diff_heads))} of {m.n_layers * m.n_heads}"
    return (f"training {m.attention} {what}, {t.steps} steps, world size {world}, "
            f"{threads} thread{'' if threads == 1 else 's'}; out {out}")


def _done(outcome: RunOutcome, out: Path) -> None:
    run, res = outcome.run, outcome.result
    if run.task == "classify":
        from diffattn.train.classify import print_summary  # lazy: an LM run need not load the classifier

        print_summary(run, res, outcome.model, outcome.task, out)
        return
    val = f", val loss {res.final_val_loss:.4f}" if res.final_val_loss is not None else ""
    print(f"done: step {res.step}, train loss {res.final_train_loss:.4f}{val}; checkpoint {res.checkpoint}",
          file=sys.stderr)


# ----------------------------------------------------------------------------------------------- preparing
def prepare(req: RunRequest, stack: ExitStack) -> Prepared:
    """Validate a run (new, resumed or started from a checkpoint) and its folder; raises one of
    :data:`~diffattn.train.driver.USAGE_ERRORS`. Nothing is written but the folder's lock: an existing folder is
    held (for as long as ``stack`` is open) before it is read."""
    check_launch_env()  # RANK=abc: one line, before anything is read
    out = _run_folder(Path(req.out)) if req.out else None
    backends.env_backend()  # an invalid DIFFATTN_BACKEND is a usage error, before anything is written
    if req.init_from:
        if req.resume:
            raise ConfigError("--init-from starts a new run and --resume continues one: give one of them")
        init, run = _init_from(req.init_from, req.config, req.overrides)
        out = out or Path("runs") / (Path(req.init_from).name + "-ft")
        check_memory(run)
        folder = stack.enter_context(RunFolder(out, overwrite=req.overwrite, source=req.init_from))
        folder.check()
        prep = Prepared(_fingerprinted(run), folder, init=init)
    elif req.resume:
        prep = _prepare_resume(req, out, stack)
    else:
        config = req.config if req.config is not None or req.task != "classify" else "classify"  # packaged
        if config is None:
            raise ConfigError(f"--config is required (a TOML file or a packaged name: {', '.join(packaged_configs())})")
        run = config if isinstance(config, RunConfig) else load_run_config(config, req.overrides)
        if run.retrofit.active:
            raise ConfigError(f"--retrofit.to {run.retrofit.to} converts a pretrained standard model: give it with "
                              "--init-from SRC")
        check_memory(run)  # before the data is read: its vocabulary may still grow the model
        out = out or Path("runs") / Path(str(config) if not isinstance(config, RunConfig) else "run").stem
        folder = stack.enter_context(RunFolder(out, overwrite=req.overwrite))
        folder.check()
        prep = Prepared(_fingerprinted(run), folder)
    if req.task:
        prep.run = prep.run.replace(task=req.task)
    return prep


def _prepare_resume(req: RunRequest, out: Path | None, stack: ExitStack) -> Prepared:
    if out is None:
        if req.config is None or isinstance(req.config, RunConfig):
            raise ConfigError("--resume needs --out (or --config, for the default out dir)")
        out = Path("runs") / Path(req.config).stem
    if req.overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: choose one")
    # held before it is read: a process still writing this run refuses this one
    folder = stack.enter_context(RunFolder(out, policy="resume"))
    checkpoint = _resume_checkpoint(out)
    if req.config is not None:
        print(f"note: resuming from {checkpoint.path}: its config is used; --config {req.config} is ignored",
              file=sys.stderr)
    run = load_run_config(None, req.overrides, base=checkpoint.run_config)  # the typed config it recorded
    if run.retrofit != checkpoint.run_config.retrofit:  # the model was built for the recorded one
        raise ConfigError(f"cannot resume with other --retrofit.* options: the run was started with "
                          f"{checkpoint.run_config.retrofit}; they are part of the run")
    check_memory(run)
    path_given = any(p[:2] == ["data", "path"] for p, _ in parse_overrides(req.overrides))
    run = run.replace(data=_resume_data(run, path_given))
    folder.check()  # only that the folder can still be written: resuming replaces its outputs
    return Prepared(run, folder, checkpoint=checkpoint)


def _run_folder(out: Path) -> Path:
    """A run is named by its folder; its ``ckpt/`` names it too."""
    return out.parent if out.name == LATEST and (out / MANIFEST).is_file() else out


def _fingerprinted(run: RunConfig) -> RunConfig:
    """The run with its data recorded as an absolute path with its sizes and sha256, so that it resumes from any
    folder and notices if the data changed under it."""
    data = run.data
    if data.path is None or data.synthetic is not None:
        return run
    check_input(data.to_dict(), run.task)  # a FIFO, a binary file, a text too large to read: refused before hashing
    try:
        fp = data_fingerprint(data.path)
    except OSError:
        return run  # building the data reports the missing or unreadable data with its own message
    if data.test_path and Path(data.test_path).is_file():  # a classifier's test file, for `eval` later
        fp["test_path"] = str(Path(data.test_path).expanduser().resolve())
    return run.replace(data=dataclasses.replace(data, fingerprint=fp, path=fp["path"]))


def _resume_data(run: RunConfig, path_given: bool) -> Any:
    """The data a resumed run reads: refused if the recorded data changed, unless --data.path was passed again
    (then it is accepted and recorded)."""
    recorded = run.data.fingerprint
    if path_given:
        new = _fingerprinted(run).data
        if recorded and (new.fingerprint is None or new.fingerprint["files"] != recorded["files"]
                         or new.path != recorded["path"]):
            print(f"note: --data.path given: resuming on {new.path}, which differs from the data the run started "
                  f"with ({recorded['path']}); the new data is recorded in the run", file=sys.stderr)
        return new
    if recorded:
        if not Path(recorded["path"]).exists():  # moved or deleted: passing the old path again cannot help
            raise ConfigError(
                f"cannot resume: the run's data {recorded['path']} no longer exists. If it has moved, pass its new "
                "location: --data.path NEW_PATH (the data found there is recorded in the run).")
        changes = data_changes(recorded)
        if changes:
            raise ConfigError("cannot resume: the data changed since the run started: " + "; ".join(changes[:3])
                              + f". To continue on the data as it is now, pass --data.path {recorded['path']} again.")
    return run.data


def _resume_checkpoint(out: Path) -> Checkpoint:
    """The newest good checkpoint of the run in ``out`` (warnings as lines); ConfigError when there is none,
    saying how to start again a run that stopped before its first checkpoint."""
    if main_rank() and unsaved_run(out):
        toml = out / "resolved.toml"
        again = (f"diffattn train --config {toml} --out {out}" if toml.is_file()
                 else f"the command that started it, with --out {out}")
        raise ConfigError(f"cannot resume: {out} holds no checkpoint (the run stopped before its first save), so "
                          f"there is nothing to continue; start it again with: {again}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint = load_run_checkpoint(out, stream=True)  # weights and optimizer stream in at restore
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except CheckpointError as e:
        raise ConfigError(f"cannot resume: {e}") from e
    return checkpoint


def _init_from(path: str, config: str | RunConfig | None, extra: list[str]) -> tuple[Checkpoint, RunConfig]:
    """(checkpoint, run config) for ``--init-from``: the model is the checkpoint's (a run folder, a convert output,
    a save_pretrained folder or a transformers folder of a family diffattn reads), the data is read with its
    tokenizer, and train/data come from ``config`` (optional) and the overrides."""
    bad = [a for a in extra if a.startswith("--model.")]
    if bad:
        raise ConfigError(f"--init-from takes the model from {path}; model overrides {bad} are not allowed")
    try:  # a save_pretrained or transformers folder (a family's model as it is) too
        init = open_model_folder(path) if is_pretrained_folder(path) else load_checkpoint(resolve_checkpoint_dir(path))
    except CheckpointError as e:
        raise ConfigError(f"--init-from: {e}") from e
    if init.task != "lm":
        raise ConfigError(f"--init-from {path}: a {init.task} checkpoint; only language models can be fine-tuned")
    run = config if isinstance(config, RunConfig) else load_run_config(config, extra)
    if config is not None and run.model_given:
        print(f"note: --init-from {path}: the model section of {config} is ignored", file=sys.stderr)
    train, data, context = run.train, run.data, init.model_config.max_seq_len
    if config is None and train.seq_len > context and not any(a.startswith("--train.seq_len") for a in extra):
        train = dataclasses.replace(train, seq_len=context)  # TrainConfig's default is longer than this model's
    if init.tokenizer is not None:
        data = dataclasses.replace(data, tokenizer=init.tokenizer.kind, vocab_size=None)
    elif data.path and not str(data.path).endswith(".bin"):
        raise ConfigError(f"--init-from {path}: the checkpoint has no tokenizer, so text data cannot be read with "
                          "the model's vocabulary; use a pre-tokenized .bin token file")
    try:  # a retrofit of a model that is not standard, or of layers it does not have: before anything is written
        check_source(init.model_config, run.retrofit)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    every = frozenset(f.name for f in dataclasses.fields(ModelConfig))
    return init, run.replace(task="lm", model=init.model_config, train=train, data=data, model_given=every)
