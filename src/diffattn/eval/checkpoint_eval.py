"""``diffattn eval``'s work: evaluate the model in any folder diffattn writes, on the data its run recorded (or
given), with the measures asked for; a comparison folder model by model.

:func:`eval_targets` resolves a folder to the checkpoint folders to evaluate (one, or each model of a comparison
folder); :func:`evaluate_targets` evaluates them (:func:`evaluate_checkpoint` each) and returns the results and
their text tables. A language model is scored by :func:`diffattn.eval.suite.evaluate_model` on the data of its
run config (:class:`~diffattn.configs.run_config.RunConfig`, read back typed from the checkpoint), refused when
that data changed since training; a classifier by accuracy and macro-F1 on its run's validation split and test
file. A checkpoint that cannot be evaluated as asked is an :class:`EvalError` (one line)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffattn.checkpoint.format import MANIFEST, Checkpoint
from diffattn.checkpoint.model_folders import is_pretrained_folder, open_model_folder
from diffattn.checkpoint.run_folder import LATEST, best_note, model_runs, resolve_checkpoint_dir
from diffattn.data.classification import ClassifyDataError, read_split_file
from diffattn.data.fingerprint import data_changes
from diffattn.data.lm import check_input, make_source
from diffattn.eval.format import count, format_classification, format_results
from diffattn.eval.measures import DEFAULT_BITS, WHATS
from diffattn.eval.needles import needle_data_of_run
from diffattn.eval.suite import evaluate_model
from diffattn.eval.windows import default_seq_len, estimate, fit_window, progress, run_sample, windows_read
from diffattn.system.atomic_files import printable
from diffattn.system.untrusted import Refused
from diffattn.train.classify import classification_metrics, encode_texts, predict, prepare_data


class EvalError(Refused):
    """A checkpoint cannot be evaluated as asked (one line; the command exits 2)."""


@dataclass
class EvalOptions:
    """What to evaluate and how (``diffattn eval``'s options): ``what`` the measures of a language model (None:
    all); ``data`` a file to evaluate on instead of the recorded data; the rest sizes and seeds."""

    what: list[str] | None = None
    data: str | None = None
    bits: Sequence[int] = field(default_factory=lambda: list(DEFAULT_BITS))
    samples: int = 32
    batches: int | None = None  # None: the run's own validation sample (on its own data), else 8
    batch_size: int | None = None  # None: as the run's validation sample, else 16
    seq_len: int | None = None  # None: the run's training length, else a window a CPU evaluates in about a minute
    seed: int = 0


def eval_targets(path: str | Path, model: str | None = None) -> list[tuple[str | None, Path]]:
    """[(model name or None, checkpoint folder)]: one for a run or checkpoint folder, one per model (or the one
    named by ``model``) for a comparison folder."""
    p = Path(path)
    runs = {} if (p / MANIFEST).is_file() or (p / LATEST / MANIFEST).is_file() else model_runs(p)
    if not runs:
        if model is not None:
            raise EvalError(f"--model {model}: {path} is not a comparison folder (diffattn compare --out DIR)")
        return [(None, p if is_pretrained_folder(p) else resolve_checkpoint_dir(p))]
    if model is not None:
        if model not in runs:
            raise EvalError(f"--model {model}: {path} holds the models {', '.join(runs)}")
        runs = {model: runs[model]}
    return [(name, resolve_checkpoint_dir(run)) for name, run in runs.items()]


def evaluate_targets(targets: list[tuple[str | None, Path]], opts: EvalOptions) -> tuple[dict, list[str]]:
    """Evaluate each target (a line on stderr before each model of a comparison folder); -> (results: one
    checkpoint's, or {"models": {name: results}}, the text tables of each). Raises ValueError / FileNotFoundError
    (a model's, named) for what cannot be evaluated."""
    results: dict = {}
    texts: list[str] = []
    for name, d in targets:
        if name is not None:
            print(printable(f"evaluating {name} ({d})"), file=sys.stderr, flush=True)
        try:
            res, text = evaluate_checkpoint(d, opts)
        except (ValueError, FileNotFoundError) as e:  # CheckpointError and EvalError are ValueErrors
            if name is None:
                raise
            raise EvalError(f"{name}: {e}") from e
        if name is None:
            results = res
        else:
            results.setdefault("models", {})[name] = res
        texts.append(text if name is None else f"== {name}\n{text}")
    return results, texts


def evaluate_checkpoint(folder: str | Path, opts: EvalOptions) -> tuple[dict, str]:
    """Load ``folder`` (a checkpoint or save_pretrained folder) and evaluate it as ``diffattn eval`` does:
    (results dict, text tables)."""
    checkpoint = open_model_folder(folder)
    note = best_note(folder, (checkpoint.train_state or {}).get("step")) if checkpoint.train_state else None
    if note:
        print(note, file=sys.stderr)
    if checkpoint.task not in ("lm", "classify"):
        raise EvalError(f"{checkpoint.path} holds a {checkpoint.task} (no language-model head, no classifier head): "
                        "nothing to evaluate")
    return _eval_classifier(checkpoint, opts) if checkpoint.task == "classify" else _eval_lm(checkpoint, opts)


def _no_data_message(checkpoint: Checkpoint) -> str:
    conv = (checkpoint.train_state or {}).get("converted_from")
    made = (f"it was made by diffattn convert from {conv.get('source')}" if isinstance(conv, dict)
            else "it records no training data")
    tok = ("read with the model's tokenizer" if checkpoint.tokenizer is not None
           else "the model has no tokenizer, so a pre-tokenized .bin token file (python -m diffattn.data TEXT OUT.bin)")
    return (f"{checkpoint.path}: nothing to evaluate on ({made}): give the data with --data FILE ({tok}), "
            "e.g. diffattn eval " + f"{checkpoint.path} --data input.txt --what ppl,outliers,quant")


def _lm_source(checkpoint: Checkpoint, opts: EvalOptions, needs: bool, seq_len: int) -> tuple[Any, dict]:
    """(batch source or None, the data as the title shows it) for a language model."""
    data = checkpoint.run_config.data
    shown = data.to_dict()
    if not needs:
        return None, shown
    if opts.data:
        if checkpoint.tokenizer is None and not str(opts.data).endswith(".bin"):
            raise EvalError(f"--data {opts.data}: {checkpoint.path} has no tokenizer, so a text file cannot be read "
                            "with the model's vocabulary; give a pre-tokenized .bin token file")
        shown = {"path": opts.data}
        if checkpoint.tokenizer is not None:
            shown["tokenizer"] = getattr(checkpoint.tokenizer, "kind", "char")
    elif not data.path and not data.synthetic:
        raise EvalError(_no_data_message(checkpoint))
    elif data.path and not Path(data.path).exists():
        raise EvalError(f"{checkpoint.path}: the data it was trained on, {data.path}, does not exist any more; "
                        "give the data to evaluate on with --data FILE")
    elif data.fingerprint:
        check_input(shown)  # a FIFO, a binary or a file too large to read whole: refused before it is hashed
        _check_data_unchanged(checkpoint, data.fingerprint)
    shown.pop("fingerprint", None)
    source, _ = make_source(shown, seq_len, tokenizer=checkpoint.tokenizer, seed=opts.seed)
    return source, shown


def _check_data_unchanged(checkpoint: Checkpoint, fingerprint: dict) -> None:
    """Refuse, as resume does, to evaluate on the run's data when it changed since training: the validation split
    would be other text, and the figures not the run's. ``--data FILE`` evaluates on the data as it is now."""
    changes = data_changes(fingerprint)
    if changes:
        raise EvalError(f"{checkpoint.path}: the data changed since the run trained on it ({'; '.join(changes[:3])}), "
                        "so its validation split is not the run's any more; to evaluate on the data as it is now, give "
                        f"it with --data {fingerprint['path']}")


def _eval_lm(checkpoint: Checkpoint, opts: EvalOptions) -> tuple[dict, str]:
    """Results and their text tables for a language-model checkpoint."""
    model = checkpoint.build_model()
    run = checkpoint.run_config
    # the context the run trained at; a model no run trained (converted) records none
    train_len = run.train.seq_len if "train" in run.recorded else 0
    needles = needle_data_of_run(run, train_len or checkpoint.model_config.max_seq_len)
    what = list(opts.what or WHATS)
    if needles is None:
        skipped = [w for w in what if w in ("needle", "noise")]
        if skipped and opts.what:
            print(f"note: skipping {skipped}: the checkpoint was not trained on the synthetic needle task",
                  file=sys.stderr)
        what = [w for w in what if w not in skipped]
        if not what:
            raise EvalError(f"{checkpoint.path}: nothing to evaluate: needle and noise need a model trained on the "
                            "synthetic needle task; ask for ppl, outliers or quant")
    needs = "ppl" in what or (needles is None and ("quant" in what or "outliers" in what))
    shape = _windows(checkpoint, opts, model, what, train_len)
    source, shown = _lm_source(checkpoint, opts, needs, 1 if shape["defaulted"] else shape["seq_len"])
    if shape["defaulted"] and source is not None:  # the default window, no longer than the data allows
        source = fit_window(source, shape["seq_len"])
        shape["seq_len"] = source.seq_len
    big = source is not None and not shown.get("synthetic")
    seconds = 0.0
    if big:
        line, seconds = estimate(model, what, shape["windows"], shape["seq_len"], shape["batch_size"])
        print(line, file=sys.stderr, flush=True)
    with progress(model, shape["windows"], seconds) if big else contextlib.nullcontext():
        res = evaluate_model(model, what=what, task=needles, source=source, bits=opts.bits,
                             ppl_batches=shape["batches"], batch_size=shape["batch_size"], n_samples=opts.samples,
                             seed=opts.seed, ppl_seed=shape["ppl_seed"])
    if "ppl" in res and source is not None:
        res["ppl"].update(seq_len=shape["seq_len"], run_sample=shape["sample"])
    mc = checkpoint.model_config
    data = shown.get("synthetic") or shown.get("path") or "?"
    title = (f"{checkpoint.path}: {mc.attention} attention, {count(mc.n_layers, 'layer')}, d_model {mc.d_model}; "
             f"data {data}")
    text = format_results(res, title=title, synthetic=bool(shown.get("synthetic")), ppl_batches=shape["batches"],
                          batch_size=shape["batch_size"])
    return res, text


def _windows(checkpoint: Checkpoint, opts: EvalOptions, model: Any, what: list[str], train_len: int) -> dict:
    """The windows a language model's evaluation reads: window length, batches, rows, and the seed of ppl's
    batches. A run on its own data reads its training evaluations' sample unless --batches/--batch-size/--seq-len
    ask for another (``sample``: that run's record, and whether this is the same sample)."""
    recorded = None if opts.data else run_sample(checkpoint.train_state, checkpoint.run_config)
    batches = opts.batches or (recorded["batches"] if recorded else 8)
    batch_size = opts.batch_size or (recorded["batch_size"] if recorded else 16)
    windows = windows_read(what, ppl_batches=batches, batch_size=batch_size, bits=opts.bits)
    seq_len = opts.seq_len or train_len or default_seq_len(model, windows)
    same = bool(recorded) and opts.batches is None and opts.batch_size is None and seq_len == recorded["seq_len"]
    if recorded:
        recorded = {**recorded, "same": same}
    return {"seq_len": seq_len, "batches": batches, "batch_size": batch_size, "windows": windows,
            "ppl_seed": recorded["seed"] if same else None, "sample": recorded,
            "defaulted": not (opts.seq_len or train_len)}


def _eval_classifier(checkpoint: Checkpoint, opts: EvalOptions) -> tuple[dict, str]:
    """Accuracy and macro-F1 of a classifier checkpoint (``diffattn train --task classify``) on the run's own
    validation split and test file (as recorded in its config), or on ``--data``."""
    if opts.what:
        print("note: a classifier checkpoint: reporting accuracy and macro-F1 (--what applies to language models)",
              file=sys.stderr)
    labels = list(checkpoint.run_config.classify.labels or [])
    if not labels:
        raise EvalError(f"{checkpoint.path}: classifier checkpoint without classify.labels in its config")
    if checkpoint.tokenizer is None or isinstance(checkpoint.tokenizer, dict):
        raise EvalError(f"{checkpoint.path}: classifier checkpoint without a usable tokenizer")
    model = checkpoint.build_model()
    try:
        splits = _classifier_splits(checkpoint, opts, labels)
    except ClassifyDataError as e:
        raise EvalError(str(e)) from e
    out = {}
    for name, (ids, mask, y) in splits.items():
        m = (classification_metrics(predict(model, ids, mask), y, len(labels)) if len(y)
             else {"accuracy": None, "macro_f1": None})
        out[name] = {"rows": int(len(y)), **m}
    res = {"classify": {"labels": labels, "splits": out}}
    mc = checkpoint.model_config
    title = (f"{checkpoint.path}: classifier, {mc.attention} attention, {count(mc.n_layers, 'layer')}, "
             f"d_model {mc.d_model}; {len(labels)} classes")
    return res, format_classification(res, title=title)


def _classifier_splits(checkpoint: Checkpoint, opts: EvalOptions, labels: list[str]) -> dict[str, tuple]:
    """{split name: (ids, mask, labels)}: ``--data``'s rows, or the run's validation split and test file."""
    data, max_len = checkpoint.run_config.data, checkpoint.model_config.max_seq_len
    if opts.data:
        rows = read_split_file({**data.to_dict(), "path": opts.data}, "path")
        unknown = sorted({lab for lab, _ in rows} - set(labels))
        if unknown:
            raise EvalError(f"--data {opts.data}: labels {unknown} are not among the model's {labels}")
        index = {lab: i for i, lab in enumerate(labels)}
        ids, mask = encode_texts([t for _, t in rows], checkpoint.tokenizer, max_len)
        return {str(opts.data): (ids, mask, torch.tensor([index[lab] for lab, _ in rows]))}
    if not data.path or not Path(data.path).is_file():
        raise EvalError(f"{checkpoint.path}: its training file {data.path} does not exist any more; give the rows to "
                        "evaluate on with --data FILE (.csv or .jsonl)")
    if data.fingerprint:
        _check_data_unchanged(checkpoint, data.fingerprint)
    test = data.test_path
    recorded = (data.fingerprint or {}).get("test_path")  # absolute, so eval works from anywhere
    if test and not Path(test).is_file() and recorded and Path(recorded).is_file():
        test = recorded
    if test and not Path(test).is_file():
        print(f"note: the run's test file {test} does not exist (here); scoring the validation split only",
              file=sys.stderr)
        test = None
    cd = prepare_data(dataclasses.replace(data, test_path=test), max_len, tokenizer=checkpoint.tokenizer, labels=labels)
    splits = {"validation": (cd.val_ids, cd.val_mask, cd.val_y)}
    if cd.test_y is not None:
        splits[f"test ({test})"] = (cd.test_ids, cd.test_mask, cd.test_y)
    return splits
