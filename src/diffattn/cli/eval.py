"""Evaluate a checkpoint: perplexity, needles, attention noise, outliers, quantization; classifiers: accuracy, macro-F1.

``diffattn eval CKPT``: the command line of :mod:`diffattn.eval.suite`. CKPT is a run folder, a checkpoint, a
converted model, a save_pretrained folder, or a comparison folder (each model in it, or the one named by
``--model``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from diffattn.cli.options import add_checkpoint_choice, usage_error
from diffattn.cli.threads import add_threads_argument, torch_threads
from diffattn.data.classification import ClassifyDataError, read_split_file
from diffattn.data.fingerprint import data_changes
from diffattn.data.lm import make_source
from diffattn.eval.format import count, format_classification, format_results
from diffattn.eval.needles import task_from_run_config
from diffattn.eval.quantization import DEFAULT_BITS
from diffattn.eval.suite import WHATS, evaluate_model
from diffattn.eval.windows import default_seq_len, estimate, fit_window, progress, run_sample, windows_read
from diffattn.fileio import EX_IOERR, atomic_write, io_error_line
from diffattn.interop.hub import is_pretrained_folder, open_model_folder
from diffattn.train.checkpoint import MANIFEST, CheckpointError
from diffattn.train.classify import classification_metrics, encode_texts, predict, prepare_data
from diffattn.train.config import DataConfig
from diffattn.train.run_checkpoints import LATEST, best_note, model_runs, pick_checkpoint, resolve_checkpoint_dir
from diffattn.train.rundir import OutputError, check_output_file


def parse_what(s: str) -> list[str]:
    items = [w.strip() for w in s.split(",") if w.strip()]
    bad = [w for w in items if w not in WHATS]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"--what: unknown item(s) {bad or s!r}; choose from {','.join(WHATS)}"
        )
    return items


def parse_bits(s: str) -> list[int]:
    try:
        out = [int(b) for b in s.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be comma-separated integers, got {s!r}") from None
    if not out or any(b < 2 or b > 24 for b in out):
        raise argparse.ArgumentTypeError(f"--bits must be integers in [2, 24], got {s!r}")
    return out


_NO_DEFAULT = "%(default).0s"  # the help says what the default is; this keeps "(default: None)" from being added


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_dir", metavar="checkpoint",
                   help="a run folder (diffattn train --out DIR) or its ckpt/ folder, a converted model (diffattn "
                        "convert --out DIR), a save_pretrained folder, or a comparison folder (diffattn compare "
                        "--out DIR: each model in it, or the one named by --model)")
    p.add_argument("--model", metavar="NAME", default=None,
                   help="in a comparison folder, evaluate only this model (its folder name under runs/ or cells/)"
                        + _NO_DEFAULT)
    p.add_argument("--what", type=parse_what, default=None,
                   help="language models, comma-separated: " + ",".join(WHATS) + " (default: all; needle and noise "
                        "need a model trained on the synthetic needle task). A classifier always reports "
                        "accuracy and macro-F1" + _NO_DEFAULT)
    p.add_argument("--data", "--data.path", dest="data", default=None, metavar="FILE",
                   help="what to evaluate on instead of the data recorded in the checkpoint: a language model's "
                        "text or .bin token file (read with its tokenizer; needed for a converted model, which "
                        "records none), or a classifier's .csv/.jsonl file (default: the run's validation split "
                        "and test file)" + _NO_DEFAULT)
    p.add_argument("--bits", type=parse_bits, default=list(DEFAULT_BITS), help="quantization bit widths")
    p.add_argument("--samples", type=int, default=32, help="sequences per (depth, length) needle cell")
    p.add_argument("--batches", type=int, default=None,
                   help="batches for perplexity (default: a run on its own data reads its training evaluations' "
                        "sample, train.eval_batches batches; else 8)" + _NO_DEFAULT)
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per batch for perplexity, outliers and quantization (default: a run on its "
                        "own data, its training evaluations' rows; else 16)" + _NO_DEFAULT)
    p.add_argument("--seq-len", type=int, default=None, metavar="T",
                   help="tokens per window of a language model's data (default: the run's training length; a "
                        "model that records none, such as a converted one, gets the longest window up to its "
                        "context that a CPU evaluates in about a minute)" + _NO_DEFAULT)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the needle evaluation sequences and of the outlier batch (perplexity always "
                        "reads the same batches, drawn with a fixed seed)")
    add_checkpoint_choice(p, "evaluate")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of tables")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="also write the results as JSON to this file (its folder must exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (without it: refused)")
    add_threads_argument(p)


class EvalError(ValueError):
    """A checkpoint cannot be evaluated as asked (one line; the command exits 2)."""


def _targets(path: str, model: str | None) -> list[tuple[str | None, Path]]:
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


def _no_data_message(ck) -> str:
    conv = (ck.train_state or {}).get("converted_from")
    made = (f"it was made by diffattn convert from {conv.get('source')}" if isinstance(conv, dict)
            else "it records no training data")
    tok = ("read with the model's tokenizer" if ck.tokenizer is not None
           else "the model has no tokenizer, so a pre-tokenized .bin token file (python -m diffattn.data TEXT OUT.bin)")
    return (f"{ck.path}: nothing to evaluate on ({made}): give the data with --data FILE ({tok}), "
            "e.g. diffattn eval " + f"{ck.path} --data input.txt --what ppl,outliers,quant")


def _lm_source(ck, args, needs: bool, seq_len: int):
    """(batch source or None, data config shown in the title) for a language model."""
    data_cfg = dict(ck.run_config.get("data") or {})
    if not needs:
        return None, data_cfg
    if args.data:
        if ck.tokenizer is None and not str(args.data).endswith(".bin"):
            raise EvalError(f"--data {args.data}: {ck.path} has no tokenizer, so a text file cannot be read with "
                            "the model's vocabulary; give a pre-tokenized .bin token file")
        data_cfg = {"path": args.data}
        if ck.tokenizer is not None:
            data_cfg["tokenizer"] = getattr(ck.tokenizer, "kind", "char")
    elif not data_cfg.get("path") and not data_cfg.get("synthetic"):
        raise EvalError(_no_data_message(ck))
    elif data_cfg.get("path") and not Path(data_cfg["path"]).exists():
        raise EvalError(f"{ck.path}: the data it was trained on, {data_cfg['path']}, does not exist any more; "
                        "give the data to evaluate on with --data FILE")
    elif data_cfg.get("fingerprint"):
        _check_data_unchanged(ck, data_cfg["fingerprint"])
    data_cfg.pop("fingerprint", None)
    source, _ = make_source(data_cfg, seq_len, tokenizer=ck.tokenizer, seed=args.seed)
    return source, data_cfg


def _check_data_unchanged(ck, fingerprint: dict) -> None:
    """Refuse, as resume does, to evaluate on the run's data when it changed since training: the validation split
    would be other text, and the figures not the run's. ``--data FILE`` evaluates on the data as it is now."""
    changes = data_changes(fingerprint)
    if changes:
        raise EvalError(f"{ck.path}: the data changed since the run trained on it ({'; '.join(changes[:3])}), so its "
                        "validation split is not the run's any more; to evaluate on the data as it is now, give it "
                        f"with --data {fingerprint['path']}")


def _eval_lm(ck, args) -> tuple[dict, str]:
    """Results and their text tables for a language-model checkpoint."""
    model = ck.build_model()
    rc = ck.run_config
    train_len = int((rc.get("train") or {}).get("seq_len") or 0)
    task = task_from_run_config(rc, train_len or ck.model_config.max_seq_len)
    what = list(args.what or WHATS)
    if task is None:
        skipped = [w for w in what if w in ("needle", "noise")]
        if skipped and args.what:
            print(f"note: skipping {skipped}: the checkpoint was not trained on the synthetic needle task",
                  file=sys.stderr)
        what = [w for w in what if w not in skipped]
        if not what:
            raise EvalError(f"{ck.path}: nothing to evaluate: needle and noise need a model trained on the "
                            "synthetic needle task; ask for ppl, outliers or quant")
    needs = "ppl" in what or (task is None and ("quant" in what or "outliers" in what))
    shape = _windows(ck, args, model, what, train_len)
    source, data_cfg = _lm_source(ck, args, needs, 1 if shape["defaulted"] else shape["seq_len"])
    if shape["defaulted"] and source is not None:  # the default window, no longer than the data allows
        source = fit_window(source, shape["seq_len"])
        shape["seq_len"] = source.seq_len
    big = source is not None and not data_cfg.get("synthetic")
    if big:
        line, seconds = estimate(model, what, shape["windows"], shape["seq_len"], shape["batch_size"])
        print(line, file=sys.stderr, flush=True)
    with progress(model, shape["windows"], seconds) if big else contextlib.nullcontext():
        res = evaluate_model(model, what=what, task=task, source=source, bits=args.bits,
                             ppl_batches=shape["batches"], batch_size=shape["batch_size"], n_samples=args.samples,
                             seed=args.seed, ppl_seed=shape["ppl_seed"])
    if "ppl" in res and source is not None:
        res["ppl"].update(seq_len=shape["seq_len"], run_sample=shape["sample"])
    mc = ck.model_config
    data = data_cfg.get("synthetic") or data_cfg.get("path") or "?"
    title = f"{ck.path}: {mc.attention} attention, {count(mc.n_layers, 'layer')}, d_model {mc.d_model}; data {data}"
    text = format_results(res, title=title, synthetic=bool(data_cfg.get("synthetic")),
                          ppl_batches=shape["batches"], batch_size=shape["batch_size"])
    return res, text


def _windows(ck, args, model, what: list[str], train_len: int) -> dict:
    """The windows a language model's evaluation reads: window length, batches, rows, and the seed of ppl's
    batches. A run on its own data reads its training evaluations' sample unless --batches/--batch-size/--seq-len
    ask for another (``sample``: that run's record, and whether this is the same sample)."""
    recorded = None if args.data else run_sample(ck.train_state, ck.run_config)
    batches = args.batches or (recorded["batches"] if recorded else 8)
    batch_size = args.batch_size or (recorded["batch_size"] if recorded else 16)
    windows = windows_read(what, ppl_batches=batches, batch_size=batch_size, bits=args.bits)
    seq_len = args.seq_len or train_len or default_seq_len(model, windows)
    same = bool(recorded) and args.batches is None and args.batch_size is None and seq_len == recorded["seq_len"]
    if recorded:
        recorded = {**recorded, "same": same}
    return {"seq_len": seq_len, "batches": batches, "batch_size": batch_size, "windows": windows,
            "ppl_seed": recorded["seed"] if same else None, "sample": recorded,
            "defaulted": not (args.seq_len or train_len)}


def _eval_classifier(ck, args) -> tuple[dict, str]:
    """Accuracy and macro-F1 of a classifier checkpoint (``diffattn train --task classify``) on the run's own
    validation split and test file (as recorded in its config), or on ``--data``."""
    if args.what:
        print("note: a classifier checkpoint: reporting accuracy and macro-F1 (--what applies to language models)",
              file=sys.stderr)
    labels = list((ck.run_config.get("classify") or {}).get("labels") or [])
    if not labels:
        raise EvalError(f"{ck.path}: classifier checkpoint without classify.labels in its config")
    if ck.tokenizer is None or isinstance(ck.tokenizer, dict):
        raise EvalError(f"{ck.path}: classifier checkpoint without a usable tokenizer")
    data = dict(ck.run_config.get("data") or {})
    max_len = ck.model_config.max_seq_len
    model = ck.build_model()
    splits: dict[str, tuple] = {}
    try:
        if args.data:
            rows = read_split_file({**data, "path": args.data}, "path")
            unknown = sorted({lab for lab, _ in rows} - set(labels))
            if unknown:
                raise EvalError(f"--data {args.data}: labels {unknown} are not among the model's {labels}")
            index = {lab: i for i, lab in enumerate(labels)}
            ids, mask = encode_texts([t for _, t in rows], ck.tokenizer, max_len)
            splits[str(args.data)] = (ids, mask, torch.tensor([index[lab] for lab, _ in rows]))
        else:
            path = data.get("path")
            if not path or not Path(path).is_file():
                raise EvalError(f"{ck.path}: its training file {path} does not exist any more; give the rows to "
                                "evaluate on with --data FILE (.csv or .jsonl)")
            if data.get("fingerprint"):
                _check_data_unchanged(ck, data["fingerprint"])
            test = data.get("test_path")
            recorded = (data.get("fingerprint") or {}).get("test_path")  # absolute, so eval works from anywhere
            if test and not Path(test).is_file() and recorded and Path(recorded).is_file():
                test = data["test_path"] = recorded
            if test and not Path(test).is_file():
                print(f"note: the run's test file {test} does not exist (here); scoring the validation split only",
                      file=sys.stderr)
                data.pop("test_path")
            cd = prepare_data(DataConfig.from_dict(data), max_len, tokenizer=ck.tokenizer, labels=labels)
            splits["validation"] = (cd.val_ids, cd.val_mask, cd.val_y)
            if cd.test_y is not None:
                splits[f"test ({data['test_path']})"] = (cd.test_ids, cd.test_mask, cd.test_y)
    except ClassifyDataError as e:
        raise EvalError(str(e)) from e
    out = {}
    for name, (ids, mask, y) in splits.items():
        m = (classification_metrics(predict(model, ids, mask), y, len(labels)) if len(y)
             else {"accuracy": None, "macro_f1": None})
        out[name] = {"rows": int(len(y)), **m}
    res = {"classify": {"labels": labels, "splits": out}}
    mc = ck.model_config
    title = (f"{ck.path}: classifier, {mc.attention} attention, {count(mc.n_layers, 'layer')}, d_model {mc.d_model}; "
             f"{len(labels)} classes")
    return res, format_classification(res, title=title)


def evaluate_checkpoint(ckpt_dir: str | Path, args: argparse.Namespace) -> tuple[dict, str]:
    """Load ``ckpt_dir`` (a checkpoint or save_pretrained folder) and evaluate it as ``diffattn eval`` does:
    (results dict, text tables)."""
    ck = open_model_folder(ckpt_dir)
    note = best_note(ckpt_dir, (ck.train_state or {}).get("step")) if ck.train_state else None
    if note:
        print(note, file=sys.stderr)
    if ck.task not in ("lm", "classify"):
        raise EvalError(f"{ck.path} holds a {ck.task} (no language-model head, no classifier head): nothing to "
                        "evaluate")
    return _eval_classifier(ck, args) if ck.task == "classify" else _eval_lm(ck, args)


def run(args: argparse.Namespace) -> int:
    """``diffattn eval`` on ``--threads`` torch threads."""
    with torch_threads(getattr(args, "threads", 0)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # validate everything first: the arguments, the checkpoint(s) and the output file, before any evaluation
    if args.data is not None and not Path(args.data).exists():
        return usage_error(f"--data file {args.data!r} does not exist")
    sizes = (args.batches, args.batch_size, getattr(args, "seq_len", None))
    if args.samples < 1 or any(v is not None and v < 1 for v in sizes):
        return usage_error("--samples, --batches, --batch-size and --seq-len must be >= 1")
    try:
        targets = [(name, pick_checkpoint(d, getattr(args, "checkpoint", "last")))
                   for name, d in _targets(args.checkpoint_dir, getattr(args, "model", None))]
        if args.out:
            for _, d in targets:
                check_output_file(args.out, overwrite=getattr(args, "overwrite", False), what="eval",
                                  inside_forbidden=d)
    except (EvalError, CheckpointError, OutputError) as e:
        return usage_error(str(e))
    results: dict = {}
    texts: list[str] = []
    for name, d in targets:
        if name is not None:
            print(f"evaluating {name} ({d})", file=sys.stderr, flush=True)
        try:
            res, text = evaluate_checkpoint(d, args)
        except (ValueError, FileNotFoundError) as e:  # CheckpointError and EvalError are ValueErrors
            return usage_error(f"{name}: {e}" if name is not None else str(e))
        if name is None:
            results = res
        else:
            results.setdefault("models", {})[name] = res
        texts.append(text if name is None else f"== {name}\n{text}")
    text = json.dumps(results, indent=2)
    if args.json:
        print(text)
    else:
        print("\n\n".join(texts))
    if args.out:
        try:
            atomic_write(args.out, text + "\n")  # a failed write leaves no partial file to block the rerun
        except OSError as e:
            print(io_error_line(e, kept=f"the results printed above (no partial {args.out} is left)",
                                then="run the same command again"), file=sys.stderr)
            return EX_IOERR
    return 0
