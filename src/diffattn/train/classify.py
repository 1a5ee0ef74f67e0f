"""Text classification: train a TransformerClassifier (any attention, bidirectional) on a CSV or JSONL file.

``diffattn train --task classify`` builds one with :func:`build_classifier` (run, checkpoint resumed or None ->
run with its model resolved, model, :class:`ClassifyTask`, tokenizer) through the run driver
(:mod:`diffattn.train.driver`), which trains it in the one loop.

Input: ``run.data``: ``path`` (the training file), optionally ``test_path`` and the column options
``text_columns``, ``label_column``, ``no_header``, and ``val_fraction``, ``split_seed``; see
:mod:`diffattn.data.classification` for the file layouts, labels and the stratified validation split. The label set is
saved in the checkpoint as its run config's ``classify.labels``, so id i always means labels[i].

The tokenizer (``data.tokenizer``, char by default) is fit on the training rows only, never on validation or
test rows; the char tokenizer then has an id for unseen characters. Texts are truncated to
``model.max_seq_len`` and right-padded with a padding mask (padded keys are masked in attention and left out
of mean pooling). Training runs through the one training loop (:func:`diffattn.train.loop.train`, with a
:class:`ClassifyTask`), so a classifier gets what a language model gets: DDP/FSDP2 under torchrun, AMP
(``train.dtype``), gradient accumulation and clipping, Ctrl-C/SIGTERM safety and exact resume, the same
NonFiniteLossError, ``metrics.csv`` and TensorBoard, and the same log lines. Every ``eval_every`` steps and at the
end the validation loss, accuracy and macro-F1 are computed (columns of ``out_dir/metrics.csv``) and a
checkpoint is written to ``out_dir/ckpt`` (its run config's ``task = "classify"`` and ``classify =
{"pooling", "num_classes", "labels"}``); ``out_dir/resolved.toml`` holds the run config. With
``data.test_path`` the final step also scores the test file: ``test_accuracy`` and ``test_macro_f1`` in the last
metrics row, the checkpoint's train state and the printed summary.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from diffattn.checkpoint.format import Checkpoint
from diffattn.checkpoint.run_folder import LATEST
from diffattn.configs.run_config import DataConfig, RunConfig, TrainConfig
from diffattn.data.classification import ClassifyDataError, label_set, read_split_file, stratified_split
from diffattn.model.tokenizer import build_tokenizer
from diffattn.model.transformer import TransformerClassifier
from diffattn.train.distributed import DistInfo
from diffattn.train.loop import TrainResult
from diffattn.train.loss import cross_entropy

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


def prepare_data(config: DataConfig, max_len: int, tokenizer=None, labels: list[str] | None = None) -> ClassifyData:
    """Read and label ``config.path``, split it (stratified, ``config.split_seed``), fit the tokenizer on the
    training rows unless one is given, and encode train, validation and the test file if any."""
    data = config.to_dict()  # the file readers take the [data] section as a mapping
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


class ClassifyTask:
    """Text classification for the training loop: batches of labelled rows drawn with replacement from the
    training split, the cross-entropy of the class logits, and validation (test, at the last step) accuracy and
    macro-F1. Every rank scores the whole validation split, so all ranks log the same figures."""

    kind = "classify"
    metric_fields = ("val_accuracy", "val_macro_f1", "test_accuracy", "test_macro_f1")
    seed_offset = 1  # the classifier's batches were drawn with train.seed + 1 before it shared the LM loop
    eval_at_end = True  # its final validation (and test) figures are its result, whatever eval_every is
    eval_batch = 256

    def __init__(self, data: ClassifyData) -> None:
        self.data, self.num_classes = data, len(data.labels)

    def get_batch(self, split: str, rows: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        if split != "train":
            raise ValueError(f"ClassifyTask draws training batches only (asked for {split!r})")
        idx = torch.randint(len(self.data.train_y), (rows,), generator=gen)
        return self.data.train_ids[idx], self.data.train_mask[idx], self.data.train_y[idx]

    def count(self, batch: tuple[Tensor, ...]) -> int:
        return len(batch[2])

    def tokens(self, batch: tuple[Tensor, ...]) -> int:
        return int(batch[1].sum())

    def loss(self, model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
        ids, mask, y = batch
        width = max(1, int(mask.sum(1).max()))  # drop all-padding columns of this batch
        return cross_entropy(model(ids[:, :width], mask[:, :width]), y)

    @torch.no_grad()
    def _score(self, model: nn.Module, ids: Tensor, mask: Tensor, y: Tensor, device: Any,
               autocast: Any) -> tuple[float, dict[str, float]]:
        """(mean loss, accuracy and macro-F1) of ``model`` on the rows."""
        was = model.training
        model.eval()
        total, preds = 0.0, []
        try:
            for i in range(0, len(y), self.eval_batch):
                sl = slice(i, i + self.eval_batch)
                with autocast:
                    logits = model(ids[sl].to(device), mask[sl].to(device))
                total += float(cross_entropy(logits, y[sl].to(device)).double())
                preds.append(logits.argmax(-1).cpu())
        finally:
            model.train(was)
        return total / len(y), classification_metrics(torch.cat(preds), y, self.num_classes)

    def evaluate(self, model: nn.Module, train_cfg: TrainConfig, *, step: int, final: bool, device: Any,
                 dist: DistInfo, autocast: Any) -> dict[str, Any]:
        d = self.data
        out: dict[str, Any] = {"val_loss": None, "val_accuracy": None, "val_macro_f1": None}
        if len(d.val_y):
            loss, m = self._score(model, d.val_ids, d.val_mask, d.val_y, device, autocast)
            out.update(val_loss=loss, val_accuracy=m["accuracy"], val_macro_f1=m["macro_f1"])
        if d.test_y is not None and final:  # the fixed test file: scored once, at the end
            _, t = self._score(model, d.test_ids, d.test_mask, d.test_y, device, autocast)
            out.update(test_accuracy=t["accuracy"], test_macro_f1=t["macro_f1"])
        return out

    def eval_line(self, step: int, metrics: dict[str, Any], best_val_loss: float) -> str:
        line = (f"eval at step {step}: val loss {metrics['val_loss']:.4f} (best {best_val_loss:.4f}), "
                f"val accuracy {metrics['val_accuracy']:.4f}, val macro-F1 {metrics['val_macro_f1']:.4f}")
        if metrics.get("test_accuracy") is not None:
            line += f", test accuracy {metrics['test_accuracy']:.4f}, test macro-F1 {metrics['test_macro_f1']:.4f}"
        return line

    def probe(self, train_cfg: TrainConfig) -> Tensor | None:
        d = self.data
        ids, mask = (d.val_ids, d.val_mask) if len(d.val_y) else (d.train_ids, d.train_mask)
        if not len(ids):
            return None
        return ids[:2, : max(1, int(mask[:2].sum(1).max()))]


def final_metrics(task: ClassifyTask, model: nn.Module, res: TrainResult, train_cfg: TrainConfig) -> dict[str, Any]:
    """The metrics of the last evaluation if it scored the final model, else those of the final model now (a
    resumed run that had already finished)."""
    last = res.history[-1] if res.history else None
    if last is not None and last["step"] == res.step and "val_accuracy" in last:
        return last
    device = next(model.parameters()).device
    return task.evaluate(model, train_cfg, step=res.step, final=True, device=device, dist=DistInfo(),
                         autocast=nullcontext())


def build_classifier(run: RunConfig, checkpoint: Checkpoint | None = None
                     ) -> tuple[RunConfig, TransformerClassifier, ClassifyTask, Any]:
    """(run with its model and classify sections resolved, model, task, tokenizer) of a classification run; a
    resumed one (``checkpoint``) keeps its tokenizer and label ids. Raises ClassifyDataError / ValueError (bad
    input)."""
    saved_labels = checkpoint.run_config.classify.labels if checkpoint else None  # keep the id mapping
    data = prepare_data(run.data, run.model.max_seq_len, tokenizer=checkpoint.tokenizer if checkpoint else None,
                        labels=list(saved_labels) if saved_labels else None)
    num_classes = len(data.labels)
    if run.classify.num_classes not in (None, num_classes):
        raise ClassifyDataError(f"classify.num_classes is {run.classify.num_classes} but the data has "
                                f"{num_classes} classes {data.labels}")
    run = run.replace(model=run.model.replace(vocab_size=data.tokenizer.vocab_size, causal=False),
                      classify=dataclasses.replace(run.classify, num_classes=num_classes, labels=data.labels))
    with torch.device("meta"):  # allocated and initialised from torch.manual_seed(train.seed) by the loop
        model = TransformerClassifier(run.model, num_classes, run.classify.pooling)
    return run, model, ClassifyTask(data), data.tokenizer


def _results(task: ClassifyTask, model: nn.Module, res: TrainResult, train_cfg: TrainConfig) -> dict[str, Any]:
    final, data = final_metrics(task, model, res, train_cfg), task.data
    return {"history": res.history, "val_accuracy": final.get("val_accuracy"),
            "val_macro_f1": final.get("val_macro_f1"), "test_accuracy": final.get("test_accuracy"),
            "test_macro_f1": final.get("test_macro_f1"), "test_rows": None if data.test_y is None else len(data.test_y),
            "step": res.step, "labels": data.labels, "model": model, "data": data, "result": res}


def print_summary(run: RunConfig, tr: TrainResult, model: nn.Module, task: ClassifyTask, out: Path) -> None:
    """The LM loop's final line on stderr, then the classifier's figures on stdout."""
    res = _results(task, model, tr, run.train)
    val = f", val loss {tr.final_val_loss:.4f}" if tr.final_val_loss is not None else ""
    loss = f", train loss {tr.final_train_loss:.4f}" if tr.final_train_loss is not None else ""
    print(f"done: step {tr.step}{loss}{val}; checkpoint {tr.checkpoint}", file=sys.stderr)
    acc, f1 = res["val_accuracy"], res["val_macro_f1"]
    parts = []
    if acc is None or (isinstance(acc, float) and math.isnan(acc)):
        parts.append(f"trained {res['step']} steps (no validation split)")
    else:
        parts.append(f"val accuracy {acc:.4f}  val macro-F1 {f1:.4f}")
    if res["test_accuracy"] is not None:
        parts.append(f"test accuracy {res['test_accuracy']:.4f}  test macro-F1 {res['test_macro_f1']:.4f}"
                     f" ({res['test_rows']} rows of {run.data.test_path})")
    print("; ".join(parts) + f"  ({len(res['labels'])} classes); checkpoint in {out / LATEST}")
