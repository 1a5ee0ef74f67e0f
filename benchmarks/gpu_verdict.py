"""The verdict at 10⁸ tokens in one device call (issue 49, item 4): ``standard``, ``diff``, ``diff_v2`` and
``gated`` at 33-36M parameters, 2 paired seeds, one learning rate per arm, bf16, on text the device already
has (the Python source of its standard library and site-packages), held out by file; trained and reported by
the library's own study (``diffattn study``: :func:`diffattn.experiments.study.launch.launch`, the one training
loop and run driver), which writes results.json and report.md with the paired 95% intervals.

    PYTHONPATH=src python3 benchmarks/gpu_verdict.py --out $OUT --budget-minutes 8    # on the H200
    PYTHONPATH=src python3 benchmarks/gpu_verdict.py --out /tmp/v --tiny               # CPU rehearsal (tests)

What this script adds to the study, and nothing else: the corpus, the probe that sizes the steps, and the copy
of the results under ``--out``.

- **Corpus**: every ``*.py`` under ``sysconfig``'s stdlib and site-packages folders (regular files of at most
  2 MB, no links followed), ordered by the sha256 of their names so that a size cap samples every package, up
  to ``max_corpus_mb``. A file is held out when its name's sha256 is 0 mod 20 (5% of the files): the record
  corpus (JSON lines, one record per file) lists the training files first, and the validation split is set to
  start before the first held-out file's first token (``val_fraction`` from the exact token counts), so no
  held-out file is trained on. BPE (vocabulary 8192) is fitted on the first ``bpe_sample_mb`` MB, which are
  training files only.
- **Learning rate**: one per arm, from the CPU studies (docs/results/small-scale, docs/results/variants): at
  d_model 128 every arm's best LR was 1.5e-3 or 3e-3, and which of the two flipped between the two texts for
  every arm (V1 1.5e-3 / 3e-3, V2 1.5e-3 / 3e-3, Transformer 3e-3 / 3e-3 and 1.5e-3 at width 32): no arm showed
  an optimum of its own. Each arm therefore gets their geometric mean, 2.1e-3, scaled to d_model as the study's
  default grid scales (×sqrt(128 / d_model)): 1.06e-3 at d_model 512, the same for the four arms (gated was not
  in those studies; it gets the rule too). No bracketing here: the budget holds one LR per arm.
- **Sizing**: ``diffattn plan``'s peak for each arm at the micro-batch (must fit the device), and a throughput
  probe in the same call: a few steps of each arm through the training loop; steps per cell are then the most
  that fit the budget's remainder, capped at ``tokens_per_cell`` (5×10⁷ tokens: 763 steps of 64 × 1024).
  Arithmetic beforehand (``flops_per_token``, 9 layers of d_model 512: 33.1-35.5M parameters, 2.3-2.7×10⁸
  FLOPs a token): 9.8×10¹⁶ FLOPs for the 8 cells of 5×10⁷ tokens; at 790 TFLOP/s (bf16, measured, KINDS.md)
  that is 2.1 min at 100% MFU, 6.9 min at 30%, 10.3 min at 20%, and the budget also pays for the corpus, the
  probe and the report. How much of the peak an eager model of width 512 reaches is not known here (DIFF ran
  at 0.63× its baseline's tokens/s on the H200): 5×10⁷ tokens a cell is borderline in 8 minutes, and the probe
  decides. verdict.json says what was trained
  (``tokens_per_cell`` as run, and ``short_of_target`` when the budget forced fewer). Each cell evaluates
  5 times (the study's default is 10), each with a checkpoint of ~400 MB (and one in best/ when it improves):
  a cell's fixed cost (start, saves, the final validation pass) is taken as 20 s. The tiny rehearsal runs bf16
  autocast too (on the CPU).

Output under ``--out`` (flat, at most 8 files, as the device call returns them): results.json, report.md and
events.log (the study's; the log times each cell, which calibrates the 20 s above), verdict.json (corpus, LR
and why, probe, plan, steps, predicted and spent minutes) and verdict.md (the same, short). The study's own
folder (cells, checkpoints) stays in ``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("optuna") is None:  # the study schedules its cells with Optuna; the H200 lacks it
    sys.exit("error: optuna is not installed (the study schedules its cells with it); on a machine without a "
             "registry carry its wheels: docs/results/gpu/README.md, 'Ready for the device'")

import torch  # noqa: E402

from diffattn.experiments.study.cell import prepare_data  # noqa: E402
from diffattn.experiments.study.launch import StudyRun, launch  # noqa: E402
from diffattn.experiments.study.spec import StudySpec  # noqa: E402
from diffattn.model.transformer import TransformerLM  # noqa: E402
from diffattn.train.loop import train  # noqa: E402
from diffattn.train.plan import GIB, count_params, plan  # noqa: E402

ARMS = ("diff_v2", "gated")  # besides diff and standard, which every study trains
LR_AT_128 = 2.1e-3  # the CPU studies' best LRs at d_model 128 (1.5e-3 and 3e-3), their geometric mean
SIZES = {
    "device": dict(d_model=512, n_layers=9, heads=4, seq_len=1024, batch_size=64, vocab_size=8192,
                   tokens_per_cell=50_000_000, max_corpus_mb=96.0, bpe_sample_mb=16.0, dtype="bfloat16",
                   probe_steps=6, seeds=2, evals=5, cell_s=20.0),
    "tiny": dict(d_model=32, n_layers=1, heads=1, seq_len=16, batch_size=2, vocab_size=300, tokens_per_cell=192,
                 max_corpus_mb=0.2, bpe_sample_mb=0.1, dtype="bfloat16", probe_steps=4, seeds=2, evals=1,
                 cell_s=1.0),
}
HELD_OUT_EVERY = 20
MAX_FILE_BYTES = 2 << 20
REPORT_S = 30.0  # the study's report, the copies, a margin


def lr_for(d_model: int) -> float:
    """The one LR every arm gets (see the module docstring)."""
    return float(f"{LR_AT_128 * math.sqrt(128 / d_model):.3g}")


def held_out(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % HELD_OUT_EVERY == 0


def source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and not any(p == r or r in p.parents for r in roots):
            roots.append(p)
    return roots


def corpus_files(roots: list[Path], max_bytes: int) -> list[tuple[str, Path]]:
    """(name, path) of the ``*.py`` files under ``roots``, ordered by the sha256 of their names, up to
    ``max_bytes``."""
    found = []
    for i, root in enumerate(roots):
        for folder, _dirs, files in os.walk(root):  # os.walk follows no link to a folder
            for f in files:
                p = Path(folder) / f
                if f.endswith(".py") and not p.is_symlink() and p.is_file() and p.stat().st_size <= MAX_FILE_BYTES:
                    found.append((f"{i}/{p.relative_to(root)}", p))
    found.sort(key=lambda x: hashlib.sha256(x[0].encode()).hexdigest())
    out, total = [], 0
    for name, p in found:
        if total >= max_bytes:
            break
        out.append((name, p))
        total += p.stat().st_size
    return out


def write_corpus(files: list[tuple[str, Path]], path: Path) -> dict:
    """The record corpus (one JSON line per file, the training files first) -> what it holds."""
    texts = {"train": [], "val": []}
    for name, p in files:
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if t.strip() and "\x00" not in t:
            texts["val" if held_out(name) else "train"].append((name, t))
    with open(path, "w", encoding="utf-8") as f:
        for split in ("train", "val"):
            for _name, t in texts[split]:
                f.write(json.dumps({"text": t}) + "\n")
    return {"path": str(path), "roots": [str(r) for r in source_roots()],
            **{f"{s}_files": len(v) for s, v in texts.items()},
            **{f"{s}_chars": sum(len(t) for _, t in v) for s, v in texts.items()},
            "val_names": [n for n, _ in texts["val"]][:50], "val_texts": [t for _, t in texts["val"]]}


def make_spec(corpus: Path, size: dict, steps: int, val_fraction: float) -> StudySpec:
    spec = StudySpec.from_dict(dict(
        data=str(corpus), tokenizer="bpe", vocab_size=size["vocab_size"], val_fraction=val_fraction,
        d_model=size["d_model"], n_layers=size["n_layers"], heads=[size["heads"]], variants=list(ARMS),
        lrs=[lr_for(size["d_model"])], seeds=list(range(size["seeds"])), seq_len=size["seq_len"],
        batch_size=size["batch_size"], steps=steps, lr_extensions=0, diag_early_steps=0, dtype=size["dtype"],
        evals=size["evals"]))
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, bpe_sample_mb=size["bpe_sample_mb"]))


def exact_val_fraction(spec: StudySpec, val_texts: list[str]) -> tuple[float, dict]:
    """Tokenize the corpus once (into the token cache: the study's cells read it from there) and set the
    validation split to start before the first held-out file: its fraction from the exact token counts, plus
    one window of margin (a few tokens of the last training file are then neither trained on nor held out by
    file: harmless)."""
    source, tok = prepare_data(spec)
    n = len(source.tokens)
    n_val = sum(len(ids) for ids in tok.encode_batch([t if t.endswith("\n") else t + "\n" for t in val_texts]))
    frac = min(0.5, (n_val + spec.train.seq_len + 1) / n)
    n_train = int(n * (1.0 - frac))
    assert n_train <= n - n_val, (n_train, n, n_val)
    return frac, {"tokens": n, "val_file_tokens": n_val, "train_tokens": n_train, "vocab_size": tok.vocab_size}


def probe(spec: StudySpec, source, vocab: int, steps: int) -> dict[str, float]:
    """Seconds per training step of each arm: ``steps`` steps through the training loop (the cells' own step,
    dtype and batch), the first two left out (allocation, cuBLAS and autotuning warm-up)."""
    out = {}
    for arm in spec.arms():
        tcfg = dataclasses.replace(spec.train_config(spec.lrs[0], 0), steps=steps, eval_every=0, log_every=1,
                                   warmup_steps=1, diag_early_steps=0)
        with torch.device("meta"):
            model = TransformerLM(spec.arm_config(arm, vocab))
        res = train(model, source, tcfg, progress=False, quiet=True)
        el = [r["elapsed_s"] for r in res.history]
        out[arm.name] = (el[-1] - el[1]) / max(1, len(el) - 2)
        del model, res
    return out


def size_steps(spec: StudySpec, per_step: dict[str, float], left_s: float, tokens_per_cell: int,
               cell_s: float = 10.0) -> dict:
    """The steps per cell: the most whose estimate fits ``left_s``, at most ``tokens_per_cell`` tokens. A cell of
    s steps costs s training steps, its evaluations (``eval_passes`` forward passes, a third of a step each) and
    ``cell_s`` (start, a checkpoint at each evaluation, the final validation pass)."""
    seeds, tokens_per_step = len(spec.seeds), spec.train.batch_size * spec.train.seq_len
    target = math.ceil(tokens_per_cell / tokens_per_step)

    def cost(s: int) -> float:
        return seeds * sum(t * (s + spec.eval_passes(s) / 3) + cell_s for t in per_step.values())

    steps = target
    while steps > 10 and cost(steps) > left_s:
        steps = int(steps * 0.95)
    return {"steps": steps, "target_steps": target, "tokens_per_cell": steps * tokens_per_step,
            "short_of_target": steps < target, "predicted_s": cost(steps),
            "tokens_per_s": {a: tokens_per_step / t for a, t in per_step.items()}}


def planned_peaks(spec: StudySpec, vocab: int) -> dict[str, dict]:
    """``diffattn plan`` for each arm at the cells' micro-batch: parameters and the planned peak (GiB)."""
    out = {}
    for arm in spec.arms():
        cfg = spec.arm_config(arm, vocab)
        p = plan(cfg, batch_size=spec.train.batch_size, seq_len=spec.train.seq_len, dtype=spec.train.dtype,
                 fused_optimizer=torch.cuda.is_available())
        out[arm.name] = {"params": count_params(cfg)["total"], "peak_gib": round(p.layouts["ddp"].peak / GIB, 2)}
    return out


def run(out: Path, work: Path, size: dict, budget_s: float) -> dict:
    t0 = time.perf_counter()
    corpus = work / "corpus.jsonl"
    manifest = write_corpus(corpus_files(source_roots(), int(size["max_corpus_mb"] * 2**20)), corpus)
    val_texts = manifest.pop("val_texts")
    spec = make_spec(corpus, size, 10, 0.1)
    frac, tokens = exact_val_fraction(spec, val_texts)
    spec = make_spec(corpus, size, 10, frac)
    source, tok = prepare_data(spec)  # from the token cache
    peaks = planned_peaks(spec, tok.vocab_size)
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0] / GIB
        worst = max(p["peak_gib"] for p in peaks.values())
        if worst > 0.9 * free:
            raise SystemExit(f"error: the plan needs {worst:.1f} GiB, the device has {free:.1f} GiB free")
    per_step = probe(spec, source, tok.vocab_size, size["probe_steps"])
    sizing = size_steps(spec, per_step, budget_s - (time.perf_counter() - t0) - REPORT_S, size["tokens_per_cell"],
                        size["cell_s"])
    spec = spec.with_steps(sizing["steps"])
    study = work / "study"
    t1 = time.perf_counter()
    code = launch(StudyRun(out=study, jobs=1, threads=0, probe_seconds=0, lr_extensions_given=True,
                           progress_s=30.0, argv=["study", "--worker", "--out", str(study)]), lambda: spec)
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "study_exit": code, "corpus": manifest, "tokens": tokens,
            "val_fraction": frac, "lr": spec.lrs[0], "lr_rule": f"{LR_AT_128:g} x sqrt(128 / d_model), every arm",
            "shape": {k: size[k] for k in ("d_model", "n_layers", "heads", "seq_len", "batch_size", "dtype")},
            "plan": peaks, "probe_s_per_step": per_step, "sizing": sizing, "seeds": len(spec.seeds),
            "setup_s": t1 - t0, "study_s": time.perf_counter() - t1, "total_s": time.perf_counter() - t0}
    for name in ("results.json", "report.md", "events.log"):  # events.log: each cell's start and end
        if (study / name).exists():
            shutil.copyfile(study / name, out / name)
    (out / "verdict.json").write_text(json.dumps(info, indent=1, default=str))
    (out / "verdict.md").write_text(summary(info, study))
    return info


def summary(info: dict, study: Path) -> str:
    s, pl = info["sizing"], info["plan"]
    lines = [f"# Verdict run on {info['device']} (torch {info['torch']})", "",
             f"- corpus: {info['corpus']['train_files']:,} training files, {info['corpus']['val_files']:,} held out "
             f"by file; {info['tokens']['tokens']:,} tokens, validation {info['val_fraction']:.4f}",
             f"- shape: {info['shape']}; LR {info['lr']:g} ({info['lr_rule']}); {info['seeds']} seeds",
             f"- steps per cell {s['steps']} ({s['tokens_per_cell']:,} tokens; target {s['target_steps']}"
             + (", SHORT of the target: the budget did not fit it)" if s["short_of_target"] else ")"),
             f"- predicted {s['predicted_s'] / 60:.1f} min of cells; spent {info['study_s'] / 60:.1f} min in the "
             f"study, {info['total_s'] / 60:.1f} min in all; study exit {info['study_exit']}", "",
             "| arm | parameters | planned peak GiB | probe tokens/s |", "|---|---|---|---|"]
    lines += [f"| {a} | {p['params']:,} | {p['peak_gib']} | {s['tokens_per_s'][a]:,.0f} |" for a, p in pl.items()]
    report = study / "report.md"
    lines += ["", "The study's report follows (report.md).", "", report.read_text() if report.exists() else "(none)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where results.json, report.md, verdict.json/md go")
    ap.add_argument("--budget-minutes", type=float, default=8.0, help="the whole run, corpus and probe included")
    ap.add_argument("--work", default=None, help="the study's folder and the corpus (default: a new temp folder)")
    ap.add_argument("--tiny", action="store_true", help="the CPU rehearsal's sizes (tests)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-verdict-"))
    work.mkdir(parents=True, exist_ok=True)
    info = run(out, work, SIZES["tiny" if args.tiny else "device"], args.budget_minutes * 60)
    print(summary(info, work / "study").split("\n\nThe study's report")[0])
    return 0 if info["study_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
