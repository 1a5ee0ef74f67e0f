"""``diffattn train``: train a model (language model or classifier) from a TOML config.

Also run as ``python -m diffattn train ...`` and, for DDP/FSDP2, ``torchrun --nproc_per_node N -m diffattn train ...``.
The loop itself is :func:`diffattn.train.loop.train`; this module reads the arguments, validates the config, the
data and the run folder, claims the folder and reports the outcome.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from diffattn.cli.threads import add_threads_argument, torch_threads
from diffattn.data.fingerprint import data_changes, data_fingerprint
from diffattn.data.lm import make_source
from diffattn.fileio import EX_IOERR, WRITE_FAILURES, RunLock, atomic_write, io_error_in, io_error_line
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends
from diffattn.train.checkpoint import MANIFEST, Checkpoint, CheckpointError, load_checkpoint
from diffattn.train.config import (
    ConfigError,
    TrainConfig,
    load_run_config,
    packaged_configs,
    parse_overrides,
    resolve_model_config,
    to_toml,
)
from diffattn.train.distributed import setup_distributed
from diffattn.train.loop import NonFiniteLossError, train_lm
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

DESCRIPTION = "Train a model (language model or classifier) from a TOML config."

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="run config: a TOML file or a packaged name ("
        + ", ".join(packaged_configs())
        + "); when resuming, the checkpoint's config is used instead",
    )
    p.add_argument(
        "--out",
        help="run folder (checkpoints in OUT/ckpt, metrics.csv, resolved.toml, tb/); default runs/<config name>",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in OUT (OUT may also be OUT/ckpt)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run in OUT (default: refuse)")
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the weights, model config and tokenizer of the checkpoint DIR (e.g. a `diffattn "
        "convert` output); a fresh run (step 0, new optimizer); --config is optional (train/data sections)",
    )
    p.add_argument("--task", choices=("lm", "classify"), help="override the config's task")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar or per-step lines (start, eval, checkpoint and final lines remain)")
    add_threads_argument(p)
    p.epilog = (
        "Any config field can be overridden: --model.d_model 256 --train.steps 100 --data.path f.txt "
        "(also --section.field=value)."
    )
    p.set_defaults(_accepts_extra=True)


def _run_folder(out: Path) -> Path:
    """A run is named by its folder; its ``ckpt/`` names it too."""
    return out.parent if out.name == LATEST and (out / MANIFEST).is_file() else out


def _fingerprint_data(cfg: dict[str, Any]) -> None:
    """Record the data as an absolute path with its sizes and sha256, so the run resumes from any folder and
    notices if the data changed under it."""
    data = cfg["data"]
    if data.get("path") is None or data.get("synthetic") is not None:
        return
    try:
        data["fingerprint"] = data_fingerprint(data["path"])
    except OSError:
        return  # make_source reports the missing or unreadable data with its own message
    if data.get("test_path") and Path(data["test_path"]).is_file():  # a classifier's test file, for `eval` later
        data["fingerprint"]["test_path"] = str(Path(data["test_path"]).expanduser().resolve())
    data["path"] = data["fingerprint"]["path"]


def _check_resume_data(cfg: dict[str, Any], path_given: bool) -> None:
    """On resume: refuse if the recorded data changed, unless --data.path was passed again (then accept it)."""
    data = cfg["data"]
    recorded = data.get("fingerprint")
    if path_given:
        old = recorded["path"] if recorded else None
        _fingerprint_data(cfg)
        new = data.get("fingerprint")
        if recorded and (new is None or new["files"] != recorded["files"] or new["path"] != old):
            print(f"note: --data.path given: resuming on {data['path']}, which differs from the data the run "
                  f"started with ({old}); the new data is recorded in the run", file=sys.stderr)
        return
    if recorded:
        if not Path(recorded["path"]).exists():  # moved or deleted: passing the old path again cannot help
            raise ConfigError(
                f"cannot resume: the run's data {recorded['path']} no longer exists. If it has moved, pass its new "
                "location: --data.path NEW_PATH (the data found there is recorded in the run)."
            )
        changes = data_changes(recorded)
        if changes:
            raise ConfigError(
                "cannot resume: the data changed since the run started: " + "; ".join(changes[:3])
                + f". To continue on the data as it is now, pass --data.path {recorded['path']} again."
            )


def run(args: argparse.Namespace) -> int:
    """``diffattn train`` on ``--threads`` torch threads (the start line says how many)."""
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """``diffattn train``. Validate first, create second: the config, the data, the checkpoint to resume or start
    from and the output folder are all checked before anything is written; the run folder is claimed (an old
    run removed with --overwrite, the folder created) only once the data has been read. A command that fails
    before its first checkpoint removes what it wrote, so no run folder without a checkpoint is left behind.

    The run folder is held (:func:`~diffattn.train.rundir.lock_run_dir`) from before it is read until the command
    ends, so a second command on it is refused. A storage failure (a full or read-only disk) is one line naming
    the path, what was kept and how to continue, with exit 74."""
    lock = _Hold()
    try:
        try:
            cfg, out, ck, init = _validate(args, lock)
        except (ConfigError, RunDirError, backends.BackendError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        claim = _Claim(out, overwrite=bool(args.overwrite), source=getattr(args, "init_from", None),
                       resume=ck is not None, lock=lock)
        try:
            with QuitOnSecondSignal(hint=lambda: _resume_hint(out)):  # a second Ctrl-C quits at once, mid-step too
                rc = _run_task(args, cfg, out, ck, init, claim)
        except TrainingInterrupted as e:  # only one whose checkpoint could not be written comes this far
            claim.release()
            if e.save_error is None or not _main_rank():
                raise
            print(_io_line(e.save_error, out, prefix=f"interrupted ({signal.Signals(e.signum).name}) after step "
                                                      f"{e.step}, but its checkpoint could not be saved: "),
                  file=sys.stderr)
            return e.exit_code
        except BaseException as e:
            claim.release()
            err = io_error_in(e) if isinstance(e, Exception) else None
            if err is None or not _main_rank():
                raise
            print(_io_line(err, out), file=sys.stderr)
            return EX_IOERR
        if rc != 0:
            claim.release()
        return rc
    finally:
        lock.release()


def _validate(args: argparse.Namespace, lock: _Hold) -> tuple[dict[str, Any], Path, Checkpoint | None,
                                                              Checkpoint | None]:
    """(run config, run folder, checkpoint to resume, checkpoint to start from) from the arguments; raises
    ConfigError / RunDirError / BackendError. Nothing is written but the folder's lock (an existing folder is
    held before it is read)."""
    extra = list(getattr(args, "_extra", []) or [])
    out = _run_folder(Path(args.out)) if args.out else None
    ck: Checkpoint | None = None
    init: Checkpoint | None = None
    backends.env_backend()  # an invalid DIFFATTN_BACKEND is a usage error, before anything is written
    if getattr(args, "init_from", None):
        if args.resume:
            raise ConfigError("--init-from starts a new run and --resume continues one: give one of them")
        init, cfg = _init_from(args.init_from, args.config, extra)
        out = out or Path("runs") / (Path(args.init_from).name + "-ft")
        _fingerprint_data(cfg)
        lock.hold(out)
        _check_out(out, args.overwrite, source=args.init_from)
    elif args.resume:
        if out is None:
            if args.config is None:
                raise ConfigError("--resume needs --out (or --config, for the default out dir)")
            out = Path("runs") / Path(args.config).stem
        if args.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other: choose one")
        lock.hold(out)  # before reading: a process still writing this run refuses this one
        ck = _resume_checkpoint(out)
        if args.config is not None:
            print(f"note: resuming from {ck.path}: its config is used; --config {args.config} is ignored",
                  file=sys.stderr)
        cfg = load_run_config(None, extra, base=dict(ck.run_config))
        _check_resume_data(cfg, path_given=any(p[:2] == ["data", "path"] for p, _ in parse_overrides(extra)))
        _check_out(out, True)  # only that the folder can still be written: resuming replaces its outputs
    else:
        if args.config is None and args.task == "classify":
            args.config = "classify"  # the packaged default: diffattn/configs/classify.toml
        if args.config is None:
            raise ConfigError(
                "--config is required (a TOML file or a packaged name: "
                + ", ".join(packaged_configs())
                + ")"
            )
        cfg = load_run_config(args.config, extra)
        out = out or Path("runs") / Path(args.config).stem
        _fingerprint_data(cfg)
        lock.hold(out)
        _check_out(out, args.overwrite)
    if args.task:
        cfg["task"] = args.task
    return cfg, out, ck, init


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


def _resume_hint(out: Path) -> str:
    if (out / LATEST / MANIFEST).is_file():
        return f"resume with: diffattn train --out {out} --resume"
    return f"no checkpoint was written in {out}"


def _run_task(args: argparse.Namespace, cfg: dict[str, Any], out: Path, ck: Checkpoint | None,
              init: Checkpoint | None, claim: _Claim) -> int:
    if cfg["task"] == "classify":
        from diffattn.train.classify import run_classify  # lazy: an LM run need not load the classifier

        return int(run_classify(cfg, out, resume=bool(args.resume), progress=not args.no_progress,
                                before_training=claim) or 0)
    return _run_lm(cfg, out, ck, progress=not args.no_progress, init=init, claim=claim)


def _main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 touches the folder


def _check_out(out: Path, overwrite: bool, source: str | None = None) -> None:
    """Validate the run folder (see :func:`diffattn.rundir.check_output_dir`) without changing anything; a run
    that stopped before its first checkpoint may be started again (the folder is held: it is not running)."""
    if _main_rank():
        check_output_dir(out, overwrite=overwrite, source=source, restart_unsaved=True)


def _io_line(err: OSError, out: Path | None, prefix: str = "error: ") -> str:
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
    what this command wrote if no checkpoint came of it."""

    def __init__(self, out: Path, *, overwrite: bool, source: str | None = None, resume: bool = False,
                 lock: _Hold | None = None):
        self.out, self.overwrite, self.source, self.resume = out, overwrite, source, resume
        self.lock = lock or _Hold()
        self.claimed = False
        self.created: Path | None = None

    def __call__(self) -> None:
        if self.claimed or self.resume or not _main_rank():  # a resumed run's folder is its own already
            return
        self.created = first_missing(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock.hold(self.out)
        removed = claim_run_dir(self.out, overwrite=self.overwrite, source=self.source, restart_unsaved=True)
        self.claimed = True
        if removed and self.overwrite:
            print(f"note: --overwrite: removed the previous run in {self.out} "
                  f"({', '.join(p.name for p in removed)})", file=sys.stderr)
        elif removed:
            print(f"note: {self.out} held a run stopped before its first checkpoint (nothing to resume); starting "
                  f"it again (replaced {', '.join(p.name for p in removed)})", file=sys.stderr)

    def release(self) -> None:
        if self.claimed and release_run_dir(self.out, created=self.created, lock=self.lock.lock):
            self.lock.lock = None
            print(f"note: removed what this run wrote in {self.out}: it failed before its first checkpoint",
                  file=sys.stderr)
        self.claimed = False


def _init_from(path: str, config: str | None, extra: list[str]) -> tuple[Checkpoint, dict[str, Any]]:
    """(checkpoint, run config) for ``--init-from``: the model section is the checkpoint's, the data is read
    with the checkpoint's tokenizer, and train/data come from ``config`` (optional) and the overrides."""
    bad = [a for a in extra if a.startswith("--model.")]
    if bad:
        raise ConfigError(f"--init-from takes the model from {path}; model overrides {bad} are not allowed")
    try:
        init = load_checkpoint(resolve_checkpoint_dir(path))
    except CheckpointError as e:
        raise ConfigError(f"--init-from: {e}") from e
    if init.task != "lm":
        raise ConfigError(f"--init-from {path}: a {init.task} checkpoint; only language models can be fine-tuned")
    cfg = load_run_config(config, extra)
    if config is not None and cfg["model"]:
        print(f"note: --init-from {path}: the model section of {config} is ignored", file=sys.stderr)
    cfg["task"] = "lm"
    cfg["model"] = init.model_config.to_dict()
    context = init.model_config.max_seq_len
    if config is None and cfg["train"]["seq_len"] > context and not any(a.startswith("--train.seq_len") for a in extra):
        cfg["train"]["seq_len"] = context  # TrainConfig's default is longer than this model's context
    data_path = str(cfg["data"].get("path") or "")
    if init.tokenizer is not None:
        cfg["data"]["tokenizer"] = init.tokenizer.kind
        cfg["data"].pop("vocab_size", None)
    elif data_path and not data_path.endswith(".bin"):
        raise ConfigError(f"--init-from {path}: the checkpoint has no tokenizer, so text data cannot be read with "
                          "the model's vocabulary; use a pre-tokenized .bin token file")
    return init, cfg


def _run_lm(cfg: dict[str, Any], out: Path, ck: Checkpoint | None, progress: bool,
            init: Checkpoint | None = None, claim: Any = None) -> int:
    tcfg = TrainConfig(**cfg["train"])
    d = setup_distributed()
    try:
        try:
            given = ck.tokenizer if ck is not None else init.tokenizer if init is not None else None
            source, tokenizer = make_source(cfg["data"], tcfg.seq_len, tokenizer=given, seed=tcfg.seed)
            vocab = getattr(tokenizer, "vocab_size", None) or getattr(source, "vocab_size", None)
            mcfg = resolve_model_config(cfg, vocab)
        except (ConfigError, ValueError, OSError) as e:
            if isinstance(e, OSError) and e.errno in WRITE_FAILURES:
                raise  # writing the token cache failed: a storage failure (run() says so, exit 74), not bad data
            print(f"error: {e}", file=sys.stderr)
            return 2
        cfg["model"] = mcfg.to_dict()
        if init is not None and ck is None:
            torch.manual_seed(tcfg.seed)
            model = TransformerLM(mcfg)
            model.load_state_dict(init.state_dict, strict=True)
        else:
            # Shapes only: the loop allocates the model (each rank its FSDP2 shard) and initialises it in place
            # from torch.manual_seed(train.seed): the weights of TransformerLM(mcfg) built after that seed.
            with torch.device("meta"):
                model = TransformerLM(mcfg)
        if d.main:
            threads = torch.get_num_threads()
            if claim is not None:
                try:
                    claim()  # the inputs are valid: now the folder may be changed
                except RunDirError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            out.mkdir(parents=True, exist_ok=True)
            atomic_write(out / "resolved.toml", to_toml(cfg))
            print(
                f"training {mcfg.attention} LM: {model.num_params():,} parameters, vocab {mcfg.vocab_size}, "
                f"{tcfg.steps} steps, world size {d.world}, {threads} thread{'' if threads == 1 else 's'}; out {out}",
                file=sys.stderr,
            )
        try:
            res = train_lm(
                model,
                source,
                tcfg,
                out_dir=out,
                progress=progress,
                run_config=cfg,
                tokenizer=tokenizer,
                resume=ck if ck is not None else False,
            )
        except TrainingInterrupted as e:
            if e.save_error is not None:
                raise  # run() says what was kept instead
            if d.main:
                if e.checkpoint is not None:
                    print(f"saved checkpoint at step {e.step}; resume with: diffattn train --out {out} --resume",
                          file=sys.stderr)
                else:
                    print(f"interrupted after step {e.step}", file=sys.stderr)
            return e.exit_code
        except NonFiniteLossError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if d.main:
            val = f", val loss {res.final_val_loss:.4f}" if res.final_val_loss is not None else ""
            print(
                f"done: step {res.step}, train loss {res.final_train_loss:.4f}{val}; checkpoint {res.checkpoint}",  # noqa: E501
                file=sys.stderr,
            )
        return 0
    finally:
        if d.initialized_here:
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """The ``train`` command on its own (same arguments as ``diffattn train``)."""
    p = argparse.ArgumentParser(prog="diffattn train", description=DESCRIPTION)
    add_arguments(p)
    args, extra = p.parse_known_args(argv)
    args._extra = extra
    return run(args)
