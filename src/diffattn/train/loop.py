"""Training: AdamW, warmup + cosine, clipping, accumulation, AMP, checkpoints, exact resume, DDP/FSDP2.

CONTRACT (used by compare.py and classify.py; keep these names and signatures):
  TrainConfig            dataclass below
  make_optimizer(model, tcfg) -> torch.optim.AdamW   weight decay on matrices (dim >= 2) only
  lr_at(step, tcfg) -> float                          linear warmup then cosine to min_lr
  train_lm(model, source, tcfg, *, out_dir=None, progress=True) -> TrainResult
      source: a diffattn.data.lm.BatchSource; loss = cross-entropy over targets, ignore_index=-100
  TrainResult.history: list of dicts {"step", "train_loss", "val_loss" (or None), "lr", "tokens_per_s"}

Also here: ``train_lm(..., run_config=None, tokenizer=None, resume=False)`` and the ``diffattn train``
command. The run-config machinery lives in :mod:`diffattn.train.config`, the optimizer and schedule in
:mod:`diffattn.train.optim`, the torchrun set-up in :mod:`diffattn.train.distributed`; their names are re-exported here.

Data and exact resume: every step draws ONE global batch of ``batch_size · grad_accum · world_size``
rows from a ``torch.Generator`` seeded with ``tcfg.seed``; micro-batch m on rank r takes rows
``(m·world + r)·b ...``. So 2 processes × batch b see exactly the data of 1 process × batch 2b, and
grad_accum 2 × b that of 1 × 2b. The loss is the token-summed cross-entropy divided by the number of target
tokens of the whole global batch, so the gradient is the same mean in every layout. The generator state is
checkpointed with the weights, optimizer and torch RNG, so a resumed run continues bit-for-bit
(use ``deterministic = true``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import random
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from diffattn.model.transformer import ModelConfig, TransformerLM, set_lambda_scale
from diffattn.ops import backends
from diffattn.train.checkpoint import (
    LATEST,
    MANIFEST,
    PREVIOUS,
    Checkpoint,
    CheckpointError,
    checkpoint_step,
    load_checkpoint,
    load_run_checkpoint,
    prune_checkpoints,
    resolve_checkpoint_dir,
    save_checkpoint,
)
from diffattn.train.config import (  # noqa: F401  (re-exported: the public names of `diffattn.train.loop` before the split)
    SECTIONS,
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_path,
    load_run_config,
    normalize_config,
    packaged_configs,
    parse_overrides,
    resolve_model_config,
    to_toml,
)
from diffattn.train.diagnostics import (
    DiagnosticsLog,
    attention_diagnostics,
    early_diagnostics,
    grad_group_norms,
    probe_batch,
)
from diffattn.train.distributed import (
    DistInfo,
    all_reduce_max,
    all_reduce_sum,
    as_float,
    autocast_for,
    device_for,
    full_state,
    load_full_state,
    micro_rows,
    setup_distributed,
    wrap_model,
)
from diffattn.train.optim import lr_at, make_optimizer  # noqa: F401  (re-exported)
from diffattn.train.rundir import (
    RunDirError,
    check_output_dir,
    claim_run_dir,
    data_changes,
    data_fingerprint,
    first_missing,
    release_run_dir,
)
from diffattn.train.signals import StopSignals, TrainingInterrupted

# --------------------------------------------------------------------------------------------- training loop


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the last good checkpoint was left untouched."""


def eta_seconds(elapsed_here_s: float, steps_here: int, steps_left: int) -> float:
    """Seconds left at the rate of the steps run in this process. After a resume the checkpoint's elapsed time
    covers steps this process never ran, so dividing it by this process's steps made the ETA many times too
    long."""
    return elapsed_here_s / max(steps_here, 1) * max(steps_left, 0)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


@dataclass
class TrainResult:
    history: list[dict[str, Any]]
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    best_val_loss: float | None = None
    elapsed_s: float = 0.0
    checkpoint: Path | None = None  # the last checkpoint written, if any

    @property
    def final_train_loss(self) -> float | None:
        return self.history[-1]["train_loss"] if self.history else None

    @property
    def final_val_loss(self) -> float | None:
        vals = [h["val_loss"] for h in self.history if h.get("val_loss") is not None]
        return vals[-1] if vals else None


METRIC_FIELDS = (
    "step",
    "train_loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_seen",
    "tokens_per_s",
    "elapsed_s",
)


def token_loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed cross-entropy over target tokens (targets == -100 ignored). logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )


@torch.no_grad()
def evaluate_loss(
    fwd: nn.Module,
    source: Any,
    tcfg: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    dist_info: DistInfo | None = None,
    autocast=None,
) -> float:
    """Mean token cross-entropy over ``eval_batches`` global validation batches (``batch_size · grad_accum ·
    world`` rows each, processed in micro-batches of ``batch_size`` per rank) drawn from a fixed-seed
    generator: every evaluation of a run sees the same data, whatever the accumulation / world-size layout."""
    d = dist_info or DistInfo()
    g = torch.Generator().manual_seed(tcfg.seed + 1_000_003)
    b, accum = tcfg.batch_size, tcfg.grad_accum
    was_training = fwd.training
    fwd.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for _ in range(tcfg.eval_batches):
            x, y = source.get_batch("val", b * accum * d.world, g)
            for m in range(accum):
                xb, yb = micro_rows(x, m, d, b).to(device), micro_rows(y, m, d, b).to(device)
                with autocast or nullcontext():
                    total += token_loss_sum(fwd(xb), yb).double()
                count += (yb != -100).sum()
    finally:
        fwd.train(was_training)
    all_reduce_sum(total, d)
    all_reduce_sum(count, d)
    if count.item() == 0:
        raise ValueError("validation batches contain no target tokens (all targets are -100)")
    return (total / count).item()


def _rng_state(gen: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """RNG states as uint8 tensors (+ the few scalars of python/numpy state, for JSON)."""
    rng = {"data": gen.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    pv, pkey, pgauss = random.getstate()
    rng["python"] = torch.from_numpy(np.asarray(pkey, dtype=np.uint32).view(np.uint8).copy())
    nkind, nkey, npos, nhas, ncached = np.random.get_state()
    rng["numpy"] = torch.from_numpy(np.asarray(nkey, dtype=np.uint32).view(np.uint8).copy())
    meta = {"python": [pv, pgauss], "numpy": [nkind, int(npos), int(nhas), float(ncached)]}
    return rng, meta


def _set_rng_state(gen: torch.Generator, rng: dict[str, Tensor], meta: dict[str, Any]) -> None:
    gen.set_state(rng["data"])
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])
    if "python" in rng and "python" in meta:
        words = tuple(int(w) for w in rng["python"].numpy().view(np.uint32))
        random.setstate((meta["python"][0], words, meta["python"][1]))
    if "numpy" in rng and "numpy" in meta:
        kind, pos, has, cached = meta["numpy"]
        np.random.set_state((kind, rng["numpy"].numpy().view(np.uint32).copy(), pos, has, cached))


def _write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=METRIC_FIELDS, extrasaction="ignore")
        w.writeheader()
        for row in history:
            w.writerow({k: ("" if row.get(k) is None else repr(row[k])) for k in METRIC_FIELDS})


def _append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=METRIC_FIELDS, extrasaction="ignore").writerow(
            {k: ("" if row.get(k) is None else repr(row[k])) for k in METRIC_FIELDS}
        )


def read_metrics(path: str | os.PathLike) -> list[dict[str, float | None]]:
    """metrics.csv -> list of dicts (empty cells -> None)."""
    with open(path, newline="") as f:
        return [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]


_tb_notice_shown = False


def _tensorboard(out_dir: Path, purge_step: int | None):
    """A SummaryWriter on ``out_dir/tb``, or None when TensorBoard cannot be imported: it is optional, so training
    goes on, and one line per process says why there is no tb/ (a study or compare trains many models)."""
    global _tb_notice_shown
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as e:  # not installed, or broken (e.g. a protobuf mismatch raises other errors than ImportError)
        if not _tb_notice_shown:
            _tb_notice_shown = True
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"note: TensorBoard logging is off (no {out_dir / 'tb'}): cannot import torch.utils.tensorboard "
                  f"({reason}); `pip install tensorboard` turns it on", file=sys.stderr, flush=True)
        return None
    return SummaryWriter(str(out_dir / "tb"), purge_step=purge_step)


def _default_run_config(model: nn.Module, tcfg: TrainConfig) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    return {
        "task": "lm",
        "model": cfg.to_dict() if isinstance(cfg, ModelConfig) else {},
        "train": dataclasses.asdict(tcfg),
    }


def train_lm(
    model: nn.Module,
    source: Any,
    tcfg: TrainConfig,
    *,
    out_dir: str | os.PathLike | None = None,
    progress: bool = True,
    run_config: dict | None = None,
    tokenizer: Any = None,
    resume: bool | Checkpoint = False,
    quiet: bool = False,
) -> TrainResult:
    """Train a language model ``model(input_ids (B, T)) -> logits (B, T, V)`` on ``source``.

    With ``out_dir``: checkpoints in ``out_dir/ckpt`` (every ``ckpt_every`` steps, at each evaluation, at the
    end; the ``keep_checkpoints - 1`` previous ones stay as ``out_dir/ckpt-step-<N>``), ``metrics.csv`` and
    TensorBoard events (if tensorboard imports). ``resume=True`` continues from the newest good checkpoint in
    ``out_dir`` (or pass a loaded :class:`Checkpoint`). Under torchrun the model is wrapped in DDP or FSDP2
    (``tcfg.parallel``); only rank 0 writes.

    Output (stderr, rank 0): with ``progress`` a bar on a terminal, else one line per ``log_every`` steps; in
    every mode but ``quiet``, a line at each evaluation and checkpoint. SIGINT/SIGTERM finish the step in flight,
    write a checkpoint and raise :class:`TrainingInterrupted`. A NaN/inf loss or gradient norm raises
    :class:`NonFiniteLossError` without touching the last checkpoint. The model is trained in place.
    """
    d = setup_distributed()
    device = device_for(d)
    if tcfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if tcfg.compile or "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # The public call imports torch._inductor.config (seconds of start-up) only to set inductor's own
            # flag, which matters only for compiled code; nothing is compiled here: set the ATen flag alone.
            torch._C._set_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    out = Path(out_dir) if out_dir is not None else None
    ckpt_dir = out / "ckpt" if out is not None else None
    run_config = run_config if run_config is not None else _default_run_config(model, tcfg)
    run_config = {**run_config, "train": dataclasses.asdict(tcfg)}
    if "model" not in run_config and isinstance(getattr(model, "config", None), ModelConfig):
        run_config["model"] = model.config.to_dict()  # checkpoints are saved from state dicts: record it here
    autocast, need_scaler = autocast_for(device, tcfg.dtype)

    ck: Checkpoint | None = None
    if isinstance(resume, Checkpoint):
        ck = resume
    elif resume:
        if ckpt_dir is None:
            raise ValueError("train_lm: resume=True needs out_dir (the checkpoint is read from out_dir/ckpt)")
        ck = load_run_checkpoint(out)

    model.to(device)
    wrapped = wrap_model(model, tcfg.parallel, d, device)
    optimizer = make_optimizer(model, tcfg)
    scaler = torch.amp.GradScaler("cuda") if need_scaler else None
    gen = torch.Generator().manual_seed(tcfg.seed)
    state: dict[str, Any] = {
        "step": 0,
        "tokens_seen": 0,
        "best_val_loss": None,
        "history": [],
        "elapsed_s": 0.0,
    }
    if ck is not None:
        load_full_state(model, optimizer, ck)
        state.update({k: ck.train_state[k] for k in state if k in ck.train_state})
        if ck.rng:
            _set_rng_state(gen, ck.rng, ck.train_state.get("rng_meta", {}))
        if scaler is not None and ck.train_state.get("scaler"):
            scaler.load_state_dict(ck.train_state["scaler"])
        # The data order depends only on the seed, the sequence length and the global batch (rows per step),
        # so a run may resume at another world size / accumulation with the same global batch.
        old = ck.train_state.get("train_config", {})
        old_rows = old.get("batch_size", 0) * old.get("grad_accum", 1) * ck.train_state.get("world_size", 1)
        changed = [k for k in ("seq_len", "seed") if k in old and old[k] != getattr(tcfg, k)]
        if old and old_rows != tcfg.batch_size * tcfg.grad_accum * d.world:
            changed.append("global batch (batch_size · grad_accum · world_size)")
        if changed and d.main:
            warnings.warn(f"resuming with a changed {changed}: the data order differs from the original run",
                          stacklevel=2)
    fwd = torch.compile(wrapped) if tcfg.compile else wrapped
    wrapped.train()

    history: list[dict[str, Any]] = list(state["history"])
    start = int(state["step"])
    metrics = tb = None
    if out is not None and d.main:
        out.mkdir(parents=True, exist_ok=True)
        metrics = out / "metrics.csv"
        _write_metrics(metrics, history)  # on resume this drops rows logged after the checkpoint
        tb = _tensorboard(out, purge_step=start + 1 if start else None)
    # DIFF diagnostics at each evaluation, on one probe batch fixed for the whole run (diagnostics.csv)
    probe = (probe_batch(source, seed=tcfg.seed) if isinstance(model, TransformerLM)
             and (tcfg.eval_every or tcfg.diag_early_steps) else None)
    diag_log = DiagnosticsLog(out / "diagnostics.csv", start) if probe is not None and metrics is not None else None

    b, accum, world = tcfg.batch_size, tcfg.grad_accum, d.world
    tokens_per_step = b * accum * world * tcfg.seq_len
    last_ckpt: Path | None = ck.path if ck is not None else None
    bar = None
    interactive = progress and d.main and sys.stderr.isatty()

    def say(msg: str) -> None:
        if quiet or not d.main:
            return
        if bar is not None and not bar.disable:
            bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    say(backends.describe_line(device, tcfg.dtype))  # runs the kernels' self-checks eagerly, before compile
    if ck is not None:
        say(f"resuming from step {start} of {tcfg.steps} ({ck.path})")

    def save(step: int, announce: bool = True) -> None:
        nonlocal last_ckpt
        if ckpt_dir is None:
            return
        msd, osd = full_state(model, optimizer)
        if d.main:
            # The checkpoint being replaced stays as ckpt-step-<N> (a fallback if the newest is ever corrupt).
            prev = checkpoint_step(ckpt_dir) if tcfg.keep_checkpoints > 1 and ckpt_dir.is_dir() else None
            keep_as = out / f"{PREVIOUS}{prev}" if prev is not None and prev != step else None
            rng, rng_meta = _rng_state(gen)
            ts = {
                **state,
                "history": history,
                "rng_meta": rng_meta,
                "world_size": world,
                "train_config": dataclasses.asdict(tcfg),
                "scaler": scaler.state_dict() if scaler is not None else None,
            }
            save_checkpoint(
                ckpt_dir,
                msd,
                run_config=run_config,
                tokenizer=tokenizer,
                optimizer=osd,
                train_state=ts,
                rng=rng,
                keep_previous_as=keep_as,
            )
            prune_checkpoints(out, tcfg.keep_checkpoints)
            last_ckpt = ckpt_dir
            if announce:
                say(f"saved checkpoint at step {step}")
        if world > 1:
            import torch.distributed as dist

            dist.barrier()

    def diverged(what: str, value: float, step: int) -> NonFiniteLossError:
        where = (
            f"the last good checkpoint {last_ckpt} (step {checkpoint_step(last_ckpt) or '?'}) is left untouched"
            if last_ckpt is not None
            else "no checkpoint was written"
        )
        return NonFiniteLossError(
            f"non-finite {what} ({value}) at step {step}: training stopped; {where}. "
            "Try a lower lr, a smaller grad_clip, more warmup, or float32."
        )

    if interactive:
        bar = tqdm(total=tcfg.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)
    window_tokens, window_time, ema = 0, 0.0, None
    elapsed_here = 0.0  # training time of this process alone (the ETA's rate; state's includes resumed runs)
    stop = StopSignals()
    try:
        stop.__enter__()
        for step in range(start, tcfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if tcfg.lambda_warmup_steps:
                set_lambda_scale(model, min(1.0, step / tcfg.lambda_warmup_steps))
            x, y = source.get_batch("train", b * accum * world, gen)
            n_tokens = int((y != -100).sum())
            if n_tokens == 0:
                raise ValueError(f"step {step + 1}: the training batch has no target tokens (all -100)")
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for m in range(accum):
                xb, yb = micro_rows(x, m, d, b).to(device), micro_rows(y, m, d, b).to(device)
                last = m == accum - 1
                if world > 1 and hasattr(wrapped, "no_sync") and not last:
                    sync = wrapped.no_sync()
                else:
                    sync = nullcontext()
                    if world > 1 and hasattr(wrapped, "set_requires_gradient_sync"):
                        wrapped.set_requires_gradient_sync(last)
                with sync:
                    with autocast:
                        ls = token_loss_sum(fwd(xb), yb)
                    # DDP/FSDP average gradients over ranks: scale by world so the result is sum / n_tokens.
                    loss = ls * (world / n_tokens)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                loss_sum += ls.detach().double()
            train_loss = all_reduce_sum(loss_sum, d).item() / n_tokens
            if not math.isfinite(train_loss):
                raise diverged("training loss", train_loss, step + 1)
            if scaler is not None:
                scaler.unscale_(optimizer)
            early = probe is not None and step < tcfg.diag_early_steps and (step + 1) % tcfg.log_every == 0
            grads = grad_group_norms(model) if early else {}  # raw gradients, before clipping
            gnorm = as_float(
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
                )
            )
            if not math.isfinite(gnorm) and scaler is None:
                raise diverged("gradient norm", gnorm, step + 1)
            if scaler is not None:
                scaler.step(optimizer)  # skips the update on inf/nan gradients and lowers the scale
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            state["step"] = step + 1
            state["tokens_seen"] += tokens_per_step
            state["elapsed_s"] += dt
            elapsed_here += dt
            window_tokens += tokens_per_step
            window_time += dt
            ema = train_loss if ema is None else 0.9 * ema + 0.1 * train_loss

            done = step + 1 == tcfg.steps
            do_eval = tcfg.eval_every > 0 and ((step + 1) % tcfg.eval_every == 0 or done)
            do_ckpt = ckpt_dir is not None and (
                do_eval or done or (tcfg.ckpt_every > 0 and (step + 1) % tcfg.ckpt_every == 0)
            )
            val_loss = None
            if do_eval:
                val_loss = evaluate_loss(fwd, source, tcfg, device=device, dist_info=d, autocast=autocast)
                if not math.isfinite(val_loss):
                    raise diverged("validation loss", val_loss, step + 1)
                if state["best_val_loss"] is None or val_loss < state["best_val_loss"]:
                    state["best_val_loss"] = val_loss
            if (do_eval or early) and probe is not None:
                diag = attention_diagnostics(model, probe)
                if early:
                    diag = {**diag, **early_diagnostics(model, probe), **grads}
                if diag_log is not None:
                    diag_log.append(step + 1, diag)
                if tb is not None:
                    for k, v in diag.items():
                        tb.add_scalar(f"diag/{k}", v, step + 1)
            if (step + 1) % tcfg.log_every == 0 or do_eval or done:
                row = {
                    "step": step + 1,
                    "train_loss": train_loss,
                    "val_loss": val_loss,
                    "lr": lr,
                    "grad_norm": gnorm,
                    "tokens_seen": state["tokens_seen"],
                    "tokens_per_s": window_tokens / max(window_time, 1e-9),
                    "elapsed_s": state["elapsed_s"],
                }
                history.append(row)
                window_tokens, window_time = 0, 0.0
                if metrics is not None:
                    _append_metrics(metrics, row)
                if tb is not None:
                    for k in ("train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
                        if row[k] is not None:
                            tb.add_scalar(k, row[k], step + 1)
                if progress and not interactive:
                    eta = eta_seconds(elapsed_here, step + 1 - start, tcfg.steps - step - 1)
                    say(f"step {step + 1}/{tcfg.steps} | loss {train_loss:.4f} | lr {lr:.2e} | "
                        f"{row['tokens_per_s']:,.0f} tok/s | elapsed {_fmt_duration(state['elapsed_s'])} | "
                        f"ETA {_fmt_duration(eta)}")
            if val_loss is not None:
                say(f"eval at step {step + 1}: val loss {val_loss:.4f} (best {state['best_val_loss']:.4f})")
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{ema:.4f}", "tok/s": f"{tokens_per_step / max(dt, 1e-9):,.0f}"}
                if state["best_val_loss"] is not None:
                    post["val"] = f"{state['best_val_loss']:.4f}"
                bar.set_postfix(post, refresh=False)
            signum = stop.signum
            if world > 1:  # every rank stops at the same step, or the collectives of the next one would hang
                flag = all_reduce_max(torch.tensor([signum], device=device), d)
                signum = int(flag.item())
            # On a signal the save is silent: the caller prints the one line (what was saved, how to resume).
            if do_ckpt or signum:
                save(step + 1, announce=not signum)
            if signum:
                raise TrainingInterrupted(signum, step + 1, last_ckpt if ckpt_dir is not None else None)
    finally:
        stop.__exit__()
        if bar is not None:
            bar.close()
        if tb is not None:
            tb.close()
    return TrainResult(
        history=history,
        step=state["step"],
        tokens_seen=state["tokens_seen"],
        best_val_loss=state["best_val_loss"],
        elapsed_s=state["elapsed_s"],
        checkpoint=last_ckpt,
    )


# ------------------------------------------------------------------------------------------------- command


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
        changes = data_changes(recorded)
        if changes:
            raise ConfigError(
                "cannot resume: the data changed since the run started: " + "; ".join(changes[:3])
                + f". To continue on the data as it is now, pass --data.path {recorded['path']} again."
            )


def run(args: argparse.Namespace) -> int:
    """``diffattn train``. Validate first, create second: the config, the data, the checkpoint to resume or start
    from and the output folder are all checked before anything is written; the run folder is claimed (an old
    run removed with --overwrite, the folder created) only once the data has been read. A command that fails
    before its first checkpoint removes what it wrote, so no run folder without a checkpoint is left behind."""
    extra = list(getattr(args, "_extra", []) or [])
    out = _run_folder(Path(args.out)) if args.out else None
    ck: Checkpoint | None = None
    init: Checkpoint | None = None
    try:
        backends.env_backend()  # an invalid DIFFATTN_BACKEND is a usage error, before anything is written
        if getattr(args, "init_from", None):
            if args.resume:
                raise ConfigError("--init-from starts a new run and --resume continues one: give one of them")
            init, cfg = _init_from(args.init_from, args.config, extra)
            out = out or Path("runs") / (Path(args.init_from).name + "-ft")
            _fingerprint_data(cfg)
            _check_out(out, args.overwrite, source=args.init_from)
        elif args.resume:
            if out is None:
                if args.config is None:
                    raise ConfigError("--resume needs --out (or --config, for the default out dir)")
                out = Path("runs") / Path(args.config).stem
            if args.overwrite:
                raise ConfigError("--resume and --overwrite contradict each other: choose one")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ck = load_run_checkpoint(out)
                for w in caught:
                    print(f"warning: {w.message}", file=sys.stderr)
            except CheckpointError as e:
                raise ConfigError(f"cannot resume: {e}") from e
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
            _check_out(out, args.overwrite)
        if args.task:
            cfg["task"] = args.task
    except (ConfigError, RunDirError, backends.BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    claim = _Claim(out, overwrite=bool(args.overwrite), source=getattr(args, "init_from", None), resume=ck is not None)
    try:
        if cfg["task"] == "classify":
            from diffattn.train.classify import run_classify

            rc = int(run_classify(cfg, out, resume=bool(args.resume), progress=not args.no_progress,
                                  before_training=claim) or 0)
        else:
            rc = _run_lm(cfg, out, ck, progress=not args.no_progress, init=init, claim=claim)
    except BaseException:
        claim.release()
        raise
    if rc != 0:
        claim.release()
    return rc


def _main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 touches the folder


def _check_out(out: Path, overwrite: bool, source: str | None = None) -> None:
    """Validate the run folder (see :func:`diffattn.rundir.check_output_dir`) without changing anything."""
    if _main_rank():
        check_output_dir(out, overwrite=overwrite, source=source)


class _Claim:
    """Claims the run folder once the inputs are validated (removing an old run with --overwrite, creating
    the folder), and, after a failure, removes what this command wrote if no checkpoint came of it."""

    def __init__(self, out: Path, *, overwrite: bool, source: str | None = None, resume: bool = False):
        self.out, self.overwrite, self.source, self.resume = out, overwrite, source, resume
        self.claimed = False
        self.created: Path | None = None

    def __call__(self) -> None:
        if self.claimed or self.resume or not _main_rank():  # a resumed run's folder is its own already
            return
        self.created = first_missing(self.out)
        removed = claim_run_dir(self.out, overwrite=self.overwrite, source=self.source, create=True)
        self.claimed = True
        if removed:
            print(f"note: --overwrite: removed the previous run in {self.out} "
                  f"({', '.join(p.name for p in removed)})", file=sys.stderr)

    def release(self) -> None:
        if self.claimed and release_run_dir(self.out, created=self.created):
            print(f"note: removed what this run wrote in {self.out}: it failed before its first checkpoint",
                  file=sys.stderr)


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
    from diffattn.data.lm import make_source

    tcfg = TrainConfig(**cfg["train"])
    d = setup_distributed()
    try:
        try:
            given = ck.tokenizer if ck is not None else init.tokenizer if init is not None else None
            source, tokenizer = make_source(cfg["data"], tcfg.seq_len, tokenizer=given, seed=tcfg.seed)
            vocab = getattr(tokenizer, "vocab_size", None) or getattr(source, "vocab_size", None)
            mcfg = resolve_model_config(cfg, vocab)
        except (ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        cfg["model"] = mcfg.to_dict()
        torch.manual_seed(tcfg.seed)  # identical initial weights on every rank and in every rerun
        model = TransformerLM(mcfg)
        if init is not None and ck is None:
            model.load_state_dict(init.state_dict, strict=True)
        if d.main:
            if claim is not None:
                try:
                    claim()  # the inputs are valid: now the folder may be changed
                except RunDirError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            out.mkdir(parents=True, exist_ok=True)
            (out / "resolved.toml").write_text(to_toml(cfg), encoding="utf-8")
            print(
                f"training {mcfg.attention} LM: {model.num_params():,} parameters, vocab {mcfg.vocab_size}, "
                f"{tcfg.steps} steps, world size {d.world}; out {out}",
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
            import torch.distributed as dist

            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m diffattn.train ...``: the ``train`` command on its own (same arguments)."""
    p = argparse.ArgumentParser(prog="diffattn train", description=__doc__.strip().splitlines()[0])
    add_arguments(p)
    args, extra = p.parse_known_args(argv)
    args._extra = extra
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
