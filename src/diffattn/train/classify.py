"""Text classification: train a TransformerClassifier (any attention, bidirectional) on a CSV or JSONL file.

CONTRACT (called by ``diffattn train --task classify``):
  run_classify(cfg: dict, out_dir: Path, resume: bool = False, progress: bool = True) -> int

Input: ``cfg["data"]``: ``path`` (the training file), optionally ``test_path`` and the column options
``text_columns``, ``label_column``, ``no_header``, and ``val_fraction``, ``split_seed``; see
:mod:`diffattn.data.classification` for the file layouts, labels and the stratified validation split. The label set is
saved in the checkpoint as ``run_config["classify"]["labels"]``, so id i always means labels[i].

The tokenizer (``data.tokenizer``, char by default) is fit on the training rows only, never on validation or
test rows; the char tokenizer then has an id for unseen characters. Texts are truncated to
``model.max_seq_len`` and right-padded with a padding mask (padded keys are masked in attention and left out
of mean pooling). Training uses ``make_optimizer`` and ``lr_at`` from :mod:`diffattn.train.optim`, with gradient
clipping; every ``eval_every`` steps and at the end the validation accuracy and macro-F1 are computed,
appended to ``out_dir/metrics.jsonl`` and a checkpoint is written to ``out_dir/ckpt``
(``run_config["task"] = "classify"``, ``run_config["classify"] = {"pooling", "num_classes", "labels"}``,
optimizer and data-sampler state for ``resume``). With ``data.test_path`` the final step also scores the test
file: ``test_accuracy`` and ``test_macro_f1`` in the last metrics row, the checkpoint's train state and the
printed summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from diffattn.data.classification import (  # noqa: F401 (re-exported: the reading API predates textcls_data)
    ClassifyDataError,
    label_set,
    read_examples,
    read_split_file,
    stratified_split,
)
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerClassifier

CKPT_DIR = "ckpt"
METRICS = "metrics.jsonl"
LM_ONLY_DATA_KEYS = ("synthetic", "params")


def encode_texts(texts: list[str], tokenizer, max_len: int) -> tuple[Tensor, Tensor]:
    """Token ids (N, L) right-padded with 0 and the padding mask (N, L) bool (True = token), L <= max_len."""
    seqs = [tokenizer.encode(t)[:max_len] for t in texts]
    width = max(1, max(len(s) for s in seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


# ------------------------------------------------------------------------------------------------ metrics
def classification_metrics(pred: Tensor, target: Tensor, num_classes: int) -> dict[str, float]:
    """Accuracy and macro-F1 of integer predictions.

    Per class c: F1_c = 2·TP / (2·TP + FP + FN); macro-F1 averages F1_c over the classes that occur in the
    targets or the predictions (a class absent from both has no defined F1 and is left out).
    """
    pred, target = pred.long().flatten(), target.long().flatten()
    if pred.numel() == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan")}
    f1s = []
    for c in range(num_classes):
        tp = int(((pred == c) & (target == c)).sum())
        fp = int(((pred == c) & (target != c)).sum())
        fn = int(((pred != c) & (target == c)).sum())
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": float((pred == target).float().mean()), "macro_f1": sum(f1s) / len(f1s)}


@torch.no_grad()
def predict(model: TransformerClassifier, ids: Tensor, mask: Tensor, batch_size: int = 256) -> Tensor:
    """Predicted class ids (N,)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = [model(ids[i:i + batch_size].to(dev), mask[i:i + batch_size].to(dev)).argmax(-1).cpu()
           for i in range(0, len(ids), batch_size)]
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- training
@dataclasses.dataclass
class ClassifyData:
    labels: list[str]
    tokenizer: Any
    train_ids: Tensor
    train_mask: Tensor
    train_y: Tensor
    val_ids: Tensor
    val_mask: Tensor
    val_y: Tensor
    test_ids: Tensor | None = None
    test_mask: Tensor | None = None
    test_y: Tensor | None = None


def prepare_data(cfg: dict, max_len: int, tokenizer=None, labels: list[str] | None = None) -> ClassifyData:
    """Read and label ``cfg["data"]["path"]``, split it (stratified, ``data.split_seed``), fit the tokenizer
    on the training rows unless one is given, and encode train, validation and the test file if any."""
    from diffattn.tokenizer import build_tokenizer

    data = cfg.get("data") or {}
    if not data.get("path"):
        raise ClassifyDataError("classification needs data.path (a .csv or .jsonl file)")
    lm_only = [k for k in LM_ONLY_DATA_KEYS if data.get(k)]
    if lm_only:
        raise ClassifyDataError(f"data.{lm_only[0]} applies to language models; classification reads data.path")
    examples = read_split_file(data, "path")
    found = label_set([lab for lab, _ in examples])
    if labels is None:
        labels = found
    else:
        unknown = sorted(set(found) - set(labels))
        if unknown:
            raise ClassifyDataError(f"labels {unknown} are not in the saved label set {labels}")
    index = {lab: i for i, lab in enumerate(labels)}
    y = torch.tensor([index[lab] for lab, _ in examples], dtype=torch.long)
    frac = data.get("val_fraction")
    seed = data.get("split_seed")
    tr, va = stratified_split(y.tolist(), 0.1 if frac is None else float(frac), 0 if seed is None else int(seed))
    texts = [t for _, t in examples]
    if tokenizer is None:  # fit on the training rows only: validation and test text must not leak into it
        tokenizer = build_tokenizer(data.get("tokenizer") or "char", "\n".join(texts[i] for i in tr),
                                    data.get("vocab_size"), unk=True)
    ids, mask = encode_texts(texts, tokenizer, max_len)
    tr_t, va_t = torch.tensor(tr, dtype=torch.long), torch.tensor(va, dtype=torch.long)
    out = ClassifyData(labels, tokenizer, ids[tr_t], mask[tr_t], y[tr_t], ids[va_t], mask[va_t], y[va_t])
    if data.get("test_path"):
        test = read_split_file(data, "test_path")
        unknown = sorted({lab for lab, _ in test} - set(labels))
        if unknown:
            raise ClassifyDataError(f"{data['test_path']}: test labels {unknown} do not occur in the training"
                                    f" file {data['path']} (labels {labels})")
        out.test_ids, out.test_mask = encode_texts([t for _, t in test], tokenizer, max_len)
        out.test_y = torch.tensor([index[lab] for lab, _ in test], dtype=torch.long)
    return out


def _model_config(cfg: dict, vocab_size: int) -> ModelConfig:
    m = dict(cfg.get("model") or {})
    m["vocab_size"] = vocab_size
    m["causal"] = False
    return ModelConfig.from_dict(m)


def train_classifier(cfg: dict, out_dir: Path | None, *, resume: bool = False, progress: bool = True,
                     before_training: Callable[[], None] | None = None) -> dict[str, Any]:
    """Train as :func:`run_classify` does and return {"history", "val_accuracy", "val_macro_f1",
    "test_accuracy", "test_macro_f1" (None without data.test_path), "test_rows", "step", "labels", "model",
    "data" (the ClassifyData)}. ``before_training`` is called once the data and config are validated, before
    the first step (``diffattn train`` claims its run folder there).
    Errors raise (ClassifyDataError, CheckpointError, ValueError)."""
    from diffattn.train.checkpoint import load_checkpoint, save_checkpoint
    from diffattn.train.config import TrainConfig
    from diffattn.train.optim import lr_at, make_optimizer
    from diffattn.train.signals import StopSignals, TrainingInterrupted

    tcfg = TrainConfig(**(cfg.get("train") or {}))
    ccfg = dict(cfg.get("classify") or {})
    pooling = ccfg.get("pooling", "mean")
    out = Path(out_dir) if out_dir is not None else None
    ck = None
    if resume:
        if out is None:
            raise ValueError("resume needs out_dir (the checkpoint is read from out_dir/ckpt)")
        ck = load_checkpoint(out / CKPT_DIR)
    model_max = int((cfg.get("model") or {}).get("max_seq_len", ModelConfig.max_seq_len))
    saved_labels = (ck.run_config.get("classify") or {}).get("labels") if ck else None  # keep the id mapping
    data = prepare_data(cfg, model_max, tokenizer=ck.tokenizer if ck else None,
                        labels=list(saved_labels) if saved_labels else None)
    num_classes = len(data.labels)
    if ccfg.get("num_classes") not in (None, num_classes):
        raise ClassifyDataError(f"classify.num_classes is {ccfg['num_classes']} but the data has "
                                f"{num_classes} classes {data.labels}")
    mcfg = _model_config(cfg, data.tokenizer.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(tcfg.seed)
    model = TransformerClassifier(mcfg, num_classes, pooling).to(device)
    optimizer = make_optimizer(model, tcfg)
    gen = torch.Generator().manual_seed(tcfg.seed + 1)
    step0, history = 0, []
    if ck is not None:
        model.load_state_dict(ck.state_dict)
        if ck.optimizer_state is not None:
            optimizer.load_state_dict(ck.optimizer_state)
        if "data" in ck.rng:
            gen.set_state(ck.rng["data"])
        step0 = int(ck.train_state.get("step", 0))
        history = list(ck.train_state.get("history", []))
    run_config = {**cfg, "task": "classify", "model": mcfg.to_dict(), "train": dataclasses.asdict(tcfg),
                  "classify": {**ccfg, "pooling": pooling, "num_classes": num_classes, "labels": data.labels}}
    n_train = len(data.train_y)
    if before_training is not None:
        before_training()

    def evaluate(step: int, train_loss: float | None) -> dict[str, Any]:
        m = (classification_metrics(predict(model, data.val_ids, data.val_mask), data.val_y, num_classes)
             if len(data.val_y) else {"accuracy": None, "macro_f1": None})
        row = {"step": step, "train_loss": train_loss, "val_accuracy": m["accuracy"],
               "val_macro_f1": m["macro_f1"], "lr": lr_at(max(step - 1, 0), tcfg)}
        if data.test_y is not None and step >= tcfg.steps:  # the fixed test file: scored once, at the end
            t = classification_metrics(predict(model, data.test_ids, data.test_mask), data.test_y, num_classes)
            row.update({"test_accuracy": t["accuracy"], "test_macro_f1": t["macro_f1"]})
        history.append(row)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / METRICS, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        if progress:
            acc = "n/a" if m["accuracy"] is None else f"{m['accuracy']:.4f}"
            f1 = "n/a" if m["macro_f1"] is None else f"{m['macro_f1']:.4f}"
            test = (f"  test accuracy {row['test_accuracy']:.4f}  test macro-F1 {row['test_macro_f1']:.4f}"
                    if "test_accuracy" in row else "")
            print(f"step {step}: train loss {train_loss if train_loss is None else round(train_loss, 4)}  "
                  f"val accuracy {acc}  val macro-F1 {f1}{test}", file=sys.stderr)
        return row

    def checkpoint(step: int, row: dict[str, Any] | None) -> None:
        if out is None:
            return
        row = row or {}
        state = {"step": step, "history": history, "val_accuracy": row.get("val_accuracy"),
                 "val_macro_f1": row.get("val_macro_f1"), "test_accuracy": row.get("test_accuracy"),
                 "test_macro_f1": row.get("test_macro_f1")}
        save_checkpoint(out / CKPT_DIR, model, run_config=run_config, tokenizer=data.tokenizer,
                        optimizer=optimizer, train_state=state, rng={"data": gen.get_state()})

    model.train()
    row = history[-1] if history else None
    loss_sum, loss_n, t0 = 0.0, 0, time.perf_counter()
    with StopSignals() as stop:
        for step in range(step0, tcfg.steps):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, tcfg)
            idx = torch.randint(n_train, (tcfg.batch_size,), generator=gen)
            ids, mask, y = data.train_ids[idx], data.train_mask[idx], data.train_y[idx]
            width = max(1, int(mask.sum(1).max()))  # drop all-padding columns of this batch
            logits = model(ids[:, :width].to(device), mask[:, :width].to(device))
            loss = F.cross_entropy(logits, y.to(device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training loss at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()
            loss_sum, loss_n = loss_sum + loss.item(), loss_n + 1
            done = step + 1
            if (tcfg.eval_every and done % tcfg.eval_every == 0) or done == tcfg.steps:
                row = evaluate(done, loss_sum / loss_n)
                loss_sum, loss_n = 0.0, 0
                if tcfg.ckpt_every == 0 or done == tcfg.steps:
                    checkpoint(done, row)
            elif tcfg.ckpt_every and done % tcfg.ckpt_every == 0 and row is not None:
                checkpoint(done, row)
            if stop.signum:  # Ctrl-C / SIGTERM: keep this step's work, then stop
                if out is not None:
                    checkpoint(done, row)
                raise TrainingInterrupted(stop.signum, done, out / CKPT_DIR if out is not None else None)
    if row is None:  # nothing to train (resumed a finished run): evaluate what there is
        row = evaluate(step0, None)
    if progress:
        print(f"done: {tcfg.steps - step0} steps in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return {"history": history, "val_accuracy": row["val_accuracy"], "val_macro_f1": row["val_macro_f1"],
            "test_accuracy": row.get("test_accuracy"), "test_macro_f1": row.get("test_macro_f1"),
            "test_rows": None if data.test_y is None else len(data.test_y),
            "step": max(step0, tcfg.steps), "labels": data.labels, "model": model, "data": data}


def run_classify(cfg: dict, out_dir: Path, resume: bool = False, progress: bool = True,
                 before_training: Callable[[], None] | None = None) -> int:
    """``diffattn train --task classify``: train, print the final val metrics, return an exit status
    (0 ok; 2 with a one-line error for bad data or config). ``before_training``: see :func:`train_classifier`."""
    from diffattn.train.checkpoint import CheckpointError
    from diffattn.train.signals import TrainingInterrupted

    try:
        res = train_classifier(cfg, Path(out_dir), resume=resume, progress=progress,
                               before_training=before_training)
    except TrainingInterrupted as e:
        print(f"saved checkpoint at step {e.step}; resume with: diffattn train --out {out_dir} --resume",
              file=sys.stderr)
        return e.exit_code
    except (ClassifyDataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    acc, f1 = res["val_accuracy"], res["val_macro_f1"]
    parts = []
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):
        parts.append(f"trained {res['step']} steps (no validation split)")
    else:
        parts.append(f"val accuracy {acc:.4f}  val macro-F1 {f1:.4f}")
    if res["test_accuracy"] is not None:
        test_path = (cfg.get("data") or {}).get("test_path")
        parts.append(f"test accuracy {res['test_accuracy']:.4f}  test macro-F1 {res['test_macro_f1']:.4f}"
                     f" ({res['test_rows']} rows of {test_path})")
    print("; ".join(parts) + f"  ({len(res['labels'])} classes); checkpoint in {Path(out_dir) / CKPT_DIR}")
    return 0
