"""A run from a config, prepared and launched: what ``diffattn train`` does, for a language model and a classifier
alike.

:func:`prepare` validates before anything is written: the run config (a new run from ``--config``, a resumed run
from its checkpoint, or a fresh run started from a checkpoint's weights with ``--init-from``), the data (recorded
by fingerprint, so a resumed run notices a change), the checkpoint and the run folder, which it holds
(:func:`~diffattn.train.rundir.lock_run_dir`) from before reading it until the command ends. :func:`launch` then
builds the data and the model, claims the folder (an old run removed with ``overwrite``), writes
``resolved.toml`` and runs the one training loop (:func:`diffattn.train.loop.train`). A run that fails before its
first checkpoint removes what it wrote.

Every outcome is one exit code (:func:`exit_code`): 0 done; 2 a usage error (config, data, folder, checkpoint:
one line); 3 a NaN/inf loss; 130 / 143 Ctrl-C / SIGTERM (the step in flight is saved; if that save fails, one line
says which checkpoint is kept); 74 a storage failure (one line naming the path, what was kept and how to continue).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffattn.data.classification import ClassifyDataError
from diffattn.data.fingerprint import data_changes, data_fingerprint
from diffattn.data.lm import DataError, make_source
from diffattn.fileio import EX_IOERR, WRITE_FAILURES, Refused, RunLock, atomic_write, io_error_in, io_error_line
from diffattn.fileio import printable as _p
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends
from diffattn.train.checkpoint import MANIFEST, Checkpoint, CheckpointError, load_checkpoint
from diffattn.train.config import ConfigError, RunConfig, load_run_config, packaged_configs, parse_overrides
from diffattn.train.distributed import check_launch_env, env_int, setup_distributed
from diffattn.train.loop import TrainResult, train
from diffattn.train.preflight import check_memory, previous_resolved
from diffattn.train.run_checkpoints import (
    LATEST,
    checkpoint_step,
    load_run_checkpoint,
    previous_checkpoints,
    resolve_checkpoint_dir,
)
from diffattn.train.rundir import (
    RunDirError,
    check_output_dir,
    claim_run_dir,
    first_missing,
    lock_run_dir,
    release_run_dir,
    unsaved_run,
)
from diffattn.train.signals import QuitOnSecondSignal, TrainingInterrupted
from diffattn.train.state import NonFiniteLossError
from diffattn.train.toml_writer import to_toml

EXIT_USAGE, EXIT_DIVERGED = 2, 3
# A failure of the inputs (config, data, folder, checkpoint): one line, exit 2, whenever it happens.
USAGE_ERRORS = (ConfigError, DataError, ClassifyDataError, CheckpointError, RunDirError, backends.BackendError,
                Refused)  # Refused: a folder leading outside itself, a model too large, RANK=abc


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
    """A validated run: its config, folder, the checkpoint it resumes (``ck``) or starts from (``init``)."""

    run: RunConfig
    out: Path
    ck: Checkpoint | None = None
    init: Checkpoint | None = None


def exit_code(e: BaseException, building: bool = False) -> int | None:
    """The exit code a run that raised ``e`` ends with; None when ``e`` is no expected failure (it propagates).
    ``building``: raised while the data and model were built (a ValueError or a read error is bad input)."""
    if isinstance(e, TrainingInterrupted):  # the user stopped it: its signal's code, even if the save failed
        return e.exit_code
    if isinstance(e, NonFiniteLossError):
        return EXIT_DIVERGED
    if isinstance(e, USAGE_ERRORS) or (building and isinstance(e, ValueError)):
        return EXIT_USAGE
    if building and isinstance(e, OSError) and e.errno not in WRITE_FAILURES:
        return EXIT_USAGE  # the data cannot be read; writing the token cache failing is a storage failure
    if isinstance(e, Exception) and io_error_in(e) is not None:
        return EX_IOERR
    return None


def _say(e: BaseException, code: int, out: Path | None) -> None:
    """The one line of a failure (``code`` from :func:`exit_code`)."""
    if isinstance(e, TrainingInterrupted) and e.save_error is not None:
        print(_io_line(e.save_error, out, prefix=f"interrupted ({signal.Signals(e.signum).name}) after step "
                                                 f"{e.step}, but its checkpoint could not be saved: "), file=sys.stderr)
    elif isinstance(e, TrainingInterrupted):
        print(f"saved checkpoint at step {e.step}; resume with: diffattn train --out {out} --resume"
              if e.checkpoint is not None else f"interrupted after step {e.step}", file=sys.stderr)
    elif code == EX_IOERR:
        print(_io_line(io_error_in(e), out), file=sys.stderr)
    else:
        print(f"error: {_p(e)}", file=sys.stderr)


def launch(req: RunRequest) -> int:
    """Prepare (:func:`prepare`), build, claim the folder and train; -> the exit code (:func:`exit_code`), after
    one line on stderr for a failure. The folder is held until this returns."""
    hold = _Hold()
    try:
        try:
            prep = prepare(req, hold)
        except USAGE_ERRORS as e:
            print(f"error: {_p(e)}", file=sys.stderr)
            return EXIT_USAGE
        claim = _Claim(prep.out, overwrite=bool(req.overwrite), source=req.init_from, resume=prep.ck is not None,
                       hold=hold)
        try:
            with QuitOnSecondSignal(hint=lambda: _resume_hint(prep.out)):  # a second Ctrl-C quits at once
                return _launch(prep, claim, progress=req.progress)
        except BaseException as e:
            claim.release()
            code = exit_code(e, building=claim.building)
            if code == EXIT_USAGE and claim.resolved is not None:  # a refused resume leaves its folder as it was
                atomic_write(prep.out / "resolved.toml", claim.resolved)
            storage = code == EX_IOERR or (isinstance(e, TrainingInterrupted) and e.save_error is not None)
            if code is None or (storage and not _main_rank()):  # rank 0 says what was kept
                raise
            if _main_rank() or code in (EXIT_USAGE, EXIT_DIVERGED):
                _say(e, code, prep.out)
            return code
    finally:
        hold.release()


def _launch(prep: Prepared, claim: _Claim, progress: bool) -> int:
    d = setup_distributed()
    try:
        run, out = prep.run, prep.out
        if run.task == "classify":
            from diffattn.train.classify import build_classifier  # lazy: an LM run need not load the classifier

            run, model, task, tokenizer = build_classifier(run, prep.ck)
        else:
            run, model, task, tokenizer = _build_lm(run, prep.ck, prep.init)
        check_memory(run)  # the vocabulary and classes are known now
        claim.building = False
        if d.main:
            claim()  # the inputs are valid: now the folder may be changed
            out.mkdir(parents=True, exist_ok=True)
            claim.resolved = previous_resolved(out) if claim.resume else None
            atomic_write(out / "resolved.toml", to_toml(run.to_dict()))
            print(_start_line(run, model, d.world, out), file=sys.stderr)
        res = train(model, task, run.train, out_dir=out, progress=progress, run_config=run, tokenizer=tokenizer,
                    resume=prep.ck if prep.ck is not None else False)
        if d.main:
            _done(run, res, model, task, out)
        return 0
    finally:
        if d.initialized_here:
            torch.distributed.destroy_process_group()


def _start_line(run: RunConfig, model: torch.nn.Module, world: int, out: Path) -> str:
    m, t, threads = run.model, run.train, torch.get_num_threads()
    what = (f"classifier: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {m.vocab_size}, "
            f"{run.classify.num_classes} classes" if run.task == "classify"
            else f"LM: {model.num_params():,} parameters, vocab {m.vocab_size}")
    return (f"training {m.attention} {what}, {t.steps} steps, world size {world}, "
            f"{threads} thread{'' if threads == 1 else 's'}; out {out}")


def _done(run: RunConfig, res: TrainResult, model: torch.nn.Module, task: Any, out: Path) -> None:
    if run.task == "classify":
        from diffattn.train.classify import print_summary  # lazy, as above

        print_summary(run, res, model, task, out)
        return
    val = f", val loss {res.final_val_loss:.4f}" if res.final_val_loss is not None else ""
    print(f"done: step {res.step}, train loss {res.final_train_loss:.4f}{val}; checkpoint {res.checkpoint}",
          file=sys.stderr)


def _build_lm(run: RunConfig, ck: Checkpoint | None, init: Checkpoint | None) -> tuple[RunConfig, Any, Any, Any]:
    """(run with its model resolved, model, batch source, tokenizer) of a language model run."""
    tcfg = run.train
    given = ck.tokenizer if ck is not None else init.tokenizer if init is not None else None
    # the data layer reads the [data] section as a mapping (it knows no run config)
    source, tokenizer = make_source(run.data.to_dict(), tcfg.seq_len, tokenizer=given, seed=tcfg.seed)
    run = run.resolve_model(getattr(tokenizer, "vocab_size", None) or getattr(source, "vocab_size", None))
    if init is not None and ck is None:
        torch.manual_seed(tcfg.seed)
        model = TransformerLM(run.model)
        model.load_state_dict(init.state_dict, strict=True)
    else:
        # Shapes only: the loop allocates the model (each rank its FSDP2 shard) and initialises it in place
        # from torch.manual_seed(train.seed): the weights of TransformerLM(run.model) built after that seed.
        with torch.device("meta"):
            model = TransformerLM(run.model)
    return run, model, source, tokenizer


# ----------------------------------------------------------------------------------------------- preparing
def prepare(req: RunRequest, hold: _Hold | None = None) -> Prepared:
    """Validate a run (new, resumed or started from a checkpoint) and its folder; raises one of
    :data:`USAGE_ERRORS`. Nothing is written but the folder's lock (``hold``; an existing folder is held before
    it is read)."""
    hold = hold or _Hold()
    check_launch_env()  # RANK=abc: one line, before anything is read
    out = _run_folder(Path(req.out)) if req.out else None
    backends.env_backend()  # an invalid DIFFATTN_BACKEND is a usage error, before anything is written
    if req.init_from:
        if req.resume:
            raise ConfigError("--init-from starts a new run and --resume continues one: give one of them")
        init, run = _init_from(req.init_from, req.config, req.overrides)
        out = out or Path("runs") / (Path(req.init_from).name + "-ft")
        check_memory(run)
        prep = Prepared(_fingerprinted(run), out, init=init)
        hold.hold(out)
        _check_out(out, req.overwrite, source=req.init_from)
    elif req.resume:
        prep = _prepare_resume(req, out, hold)
    else:
        config = req.config if req.config is not None or req.task != "classify" else "classify"  # packaged
        if config is None:
            raise ConfigError(f"--config is required (a TOML file or a packaged name: {', '.join(packaged_configs())})")
        run = config if isinstance(config, RunConfig) else load_run_config(config, req.overrides)
        check_memory(run)  # before the data is read: its vocabulary may still grow the model
        out = out or Path("runs") / Path(str(config) if not isinstance(config, RunConfig) else "run").stem
        prep = Prepared(_fingerprinted(run), out)
        hold.hold(out)
        _check_out(out, req.overwrite)
    if req.task:
        prep.run = prep.run.replace(task=req.task)
    return prep


def _prepare_resume(req: RunRequest, out: Path | None, hold: _Hold) -> Prepared:
    if out is None:
        if req.config is None or isinstance(req.config, RunConfig):
            raise ConfigError("--resume needs --out (or --config, for the default out dir)")
        out = Path("runs") / Path(req.config).stem
    if req.overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: choose one")
    hold.hold(out)  # before reading: a process still writing this run refuses this one
    ck = _resume_checkpoint(out)
    if req.config is not None:
        print(f"note: resuming from {ck.path}: its config is used; --config {req.config} is ignored", file=sys.stderr)
    run = load_run_config(None, req.overrides, base=ck.run_config)
    check_memory(run)
    path_given = any(p[:2] == ["data", "path"] for p, _ in parse_overrides(req.overrides))
    run = run.replace(data=_resume_data(run, path_given))
    _check_out(out, True)  # only that the folder can still be written: resuming replaces its outputs
    return Prepared(run, out, ck=ck)


def _run_folder(out: Path) -> Path:
    """A run is named by its folder; its ``ckpt/`` names it too."""
    return out.parent if out.name == LATEST and (out / MANIFEST).is_file() else out


def _fingerprinted(run: RunConfig) -> RunConfig:
    """The run with its data recorded as an absolute path with its sizes and sha256, so that it resumes from any
    folder and notices if the data changed under it."""
    data = run.data
    if data.path is None or data.synthetic is not None:
        return run
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
    if _main_rank() and unsaved_run(out):
        toml = out / "resolved.toml"
        again = (f"diffattn train --config {toml} --out {out}" if toml.is_file()
                 else f"the command that started it, with --out {out}")
        raise ConfigError(f"cannot resume: {out} holds no checkpoint (the run stopped before its first save), so "
                          f"there is nothing to continue; start it again with: {again}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck = load_run_checkpoint(out, stream=True)  # weights and optimizer stream in at restore
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except CheckpointError as e:
        raise ConfigError(f"cannot resume: {e}") from e
    return ck


def _init_from(path: str, config: str | RunConfig | None, extra: list[str]) -> tuple[Checkpoint, RunConfig]:
    """(checkpoint, run config) for ``--init-from``: the model is the checkpoint's, the data is read with the
    checkpoint's tokenizer, and train/data come from ``config`` (optional) and the overrides."""
    bad = [a for a in extra if a.startswith("--model.")]
    if bad:
        raise ConfigError(f"--init-from takes the model from {path}; model overrides {bad} are not allowed")
    try:
        init = load_checkpoint(resolve_checkpoint_dir(path))
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
    every = frozenset(f.name for f in dataclasses.fields(ModelConfig))
    return init, run.replace(task="lm", model=init.model_config, train=train, data=data, model_given=every)


# ------------------------------------------------------------------------------------------- the run folder
def _main_rank() -> bool:
    return env_int("RANK") == 0  # under torchrun only rank 0 touches the folder


def _check_out(out: Path, overwrite: bool, source: str | None = None) -> None:
    """Validate the run folder (:func:`~diffattn.train.rundir.check_output_dir`) without changing anything; a run
    that stopped before its first checkpoint may be started again (the folder is held: it is not running)."""
    if _main_rank():
        check_output_dir(out, overwrite=overwrite, source=source, restart_unsaved=True)


def _resume_hint(out: Path) -> str:
    if (out / LATEST / MANIFEST).is_file():
        return f"resume with: diffattn train --out {out} --resume"
    return f"no checkpoint was written in {out}"


def _io_line(err: OSError | None, out: Path | None, prefix: str = "error: ") -> str:
    """The storage failure of a run as one line: the path and cause, the checkpoint kept, how to continue."""
    kept = None
    if out is not None:
        for cand in (out / LATEST, *previous_checkpoints(out)):
            step = checkpoint_step(cand) if (cand / MANIFEST).is_file() else None
            if step is not None:
                kept = (f"the checkpoint at step {step} ({cand})", f"diffattn train --out {out} --resume")
                break
    kept = kept or ("nothing (no checkpoint had been written)", "run the same command again")
    return io_error_line(err, kept=kept[0], then=kept[1], where=out, prefix=prefix)


class _Hold:
    """The run folder's lock for the whole command (rank 0 only): taken as soon as the folder exists."""

    def __init__(self) -> None:
        self.lock: RunLock | None = None

    def hold(self, out: Path) -> None:
        if self.lock is None and _main_rank() and out.is_dir():
            self.lock = lock_run_dir(out, "diffattn train")

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class _Claim:
    """Claims the run folder once the inputs are validated (creating it and taking its lock, then removing an
    old run with --overwrite or one that stopped before its first checkpoint), and, after a failure, removes
    what this command wrote if no checkpoint came of it. ``building``: the data and model are being built."""

    def __init__(self, out: Path, *, overwrite: bool, source: str | None, resume: bool, hold: _Hold) -> None:
        self.out, self.overwrite, self.source, self.resume, self.hold = out, overwrite, source, resume, hold
        self.claimed, self.building = False, True
        self.created: Path | None = None
        self.resolved: bytes | None = None  # a resumed run's resolved.toml before this command rewrote it

    def __call__(self) -> None:
        if self.claimed or self.resume or not _main_rank():  # a resumed run's folder is its own already
            return
        self.created = first_missing(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.hold.hold(self.out)
        removed = claim_run_dir(self.out, overwrite=self.overwrite, source=self.source, restart_unsaved=True)
        self.claimed = True
        if removed and self.overwrite:
            print(f"note: --overwrite: removed the previous run in {self.out} "
                  f"({', '.join(p.name for p in removed)})", file=sys.stderr)
        elif removed:
            print(f"note: {self.out} held a run stopped before its first checkpoint (nothing to resume); starting "
                  f"it again (replaced {', '.join(p.name for p in removed)})", file=sys.stderr)

    def release(self) -> None:
        if self.claimed and release_run_dir(self.out, created=self.created, lock=self.hold.lock):
            self.hold.lock = None
            print(f"note: removed what this run wrote in {self.out}: it failed before its first checkpoint",
                  file=sys.stderr)
        self.claimed = False
