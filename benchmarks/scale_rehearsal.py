"""A real-size rehearsal on a CPU: the packaged diff_830m and base_830m at their real width, depth and heads, with
a 32k BPE vocabulary trained on a real corpus, trained, saved and resumed through ``diffattn train``.

    python benchmarks/scale_rehearsal.py --out docs/results/scale      # ~1 h on 2 cores; ~13 GB of RAM per model
    python benchmarks/scale_rehearsal.py --out /tmp/r --quick          # the same on tiny_baseline-sized models

What it does, one big model at a time (each part in a fresh process, in sequence):

1. corpus: tinyshakespeare (``../shared/data``) + the GNU info manuals of this machine (``/usr/share/info``,
   decompressed, info control bytes removed) + the READMEs, NEWS files and ``*.txt`` of ``/usr/share/doc``;
   tokenized once with a 32,000-entry byte-level BPE (``python -m diffattn.data DIR tokens.bin --tokenizer bpe
   --vocab-size 32000``).
2. parameters of the six packaged paper configs, counted on the meta device, next to the paper's sizes.
3. per model: ``diffattn train`` (meta-device build, ``train.activation_checkpointing full``, fp32, batch 1 ×
   seq_len 512, 6 steps, checkpoints at steps 5 and 6): the loss of each step, step seconds, the peak resident
   memory of each step and of each save, checkpoint size and seconds; then the step-5 checkpoint is made the
   newest and ``diffattn train --resume`` runs step 6 again (the loss must equal the uninterrupted one), with
   the load's seconds and peak; then 2 steps without checkpointing (library call, no saves) for the peak.
4. the planner's prediction (:mod:`diffattn.train.plan`) next to every measured peak.

Peaks are the process's VmHWM, reset (/proc/self/clear_refs) before each measured phase, with glibc's mmap
threshold fixed (see benchmarks/bench_memory.py), minus the process's resident size before the model existed.
Results: ``<out>/rehearsal.json`` and ``<out>/README.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# beside the checkout (../shared), or beside the worktrees' parent (/work/wt/<name> -> /work/shared)
SHAKESPEARE = next((p for p in (ROOT.parent / "shared", ROOT.parent.parent / "shared")
                    if (p / "data" / "tinyshakespeare.txt").is_file()), ROOT.parent / "shared") / "data" / \
    "tinyshakespeare.txt"
MB, GB = 2**20, 2**30
SIX = ["diff_830m", "base_830m", "diff_1.4b", "base_1.4b", "diff_3b", "base_3b"]
PAPER = {"diff_830m": "830M (1536, 24 layers, 8 DIFF heads)", "base_830m": "830M baseline (16 heads)",
         "diff_1.4b": "1.4B (2048, 24 layers, 8 DIFF heads)", "base_1.4b": "1.4B baseline (16 heads)",
         "diff_3b": "3B (3072, 28 layers, 12 DIFF heads)", "base_3b": "3B baseline (24 heads)"}


def _status(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024
    import torch

    return (f"{model}, {os.cpu_count()} cores, {mem / GB:.0f} GiB RAM (shared with other jobs), Linux "
            f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


# ------------------------------------------------------------------------------------------------ corpus


def build_corpus(folder: Path) -> dict:
    """The three text files of the corpus in ``folder`` (kept if present); -> {file: (bytes, sha256)}."""
    folder.mkdir(parents=True, exist_ok=True)
    info, docs = folder / "gnu-info.txt", folder / "usr-share-doc.txt"
    if not (folder / "tinyshakespeare.txt").exists():
        shutil.copy(SHAKESPEARE, folder / "tinyshakespeare.txt")
    strip = bytes.maketrans(b"", b"")
    if not info.exists():
        parts = [gzip.open(p).read() for p in sorted(Path("/usr/share/info").glob("*.gz"))]
        info.write_bytes(b"".join(parts).translate(strip, b"\x00\x08\x1f\x7f"))
    if not docs.exists():
        pat = re.compile(r"^(readme|news).*|.*\.txt(\.gz)?$", re.IGNORECASE)
        files = sorted(p for p in Path("/usr/share/doc").rglob("*")
                       if p.is_file() and pat.match(p.name) and ".htm" not in p.name.lower())
        with open(docs, "wb") as out:
            for p in files:
                try:
                    raw = gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()
                    raw.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue  # a binary or non-UTF-8 file: not plain text
                out.write(raw.translate(strip, b"\x00\x08\x1f\x7f"))
    return {p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.glob("*.txt"))}


# ------------------------------------------------------------------------------------------------ children


def _instrument(log: list) -> None:
    """Record each training step, save, restore and model materialisation: seconds and peak memory."""
    from diffattn.train import checkpointing, loop, parallelize, step

    def timed(kind, fn):
        def wrapper(*a, **kw):
            _reset_peak()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            log.append({"kind": kind, "seconds": time.perf_counter() - t0, "peak": _status("VmHWM"),
                        "rss": _status("VmRSS")})
            return out
        return wrapper

    step.TrainStep.__call__ = timed("step", step.TrainStep.__call__)
    checkpointing.Saver.save = timed("save", checkpointing.Saver.save)
    loop.restore = timed("restore", loop.restore)
    parallelize.materialize = timed("materialize", parallelize.materialize)


def child_train(argv: list[str], resume_from: int | None = None) -> dict:
    """``diffattn train ARGV`` in this process, instrumented; with ``resume_from`` the checkpoint of that step
    is made the run's newest first (the later one set aside) and the run resumes from it."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    import torch

    torch.set_num_threads(2)
    from diffattn.cli.train import main

    log: list = []
    _instrument(log)
    out = Path(argv[argv.index("--out") + 1])
    if resume_from is not None:
        (out / "ckpt").rename(out / "ckpt-set-aside")
        (out / f"ckpt-step-{resume_from}").rename(out / "ckpt")
    base = _status("VmRSS")
    t0 = time.perf_counter()
    rc = main(argv)
    return {"rc": rc, "base": base, "seconds": time.perf_counter() - t0, "log": log,
            "ckpt_bytes": sum(f.stat().st_size for f in (out / "ckpt").iterdir()) if (out / "ckpt").is_dir() else 0}


def child_plain(config: str, tokens: str, steps: int, seq_len: int, mode: str) -> dict:
    """``steps`` steps through the library's loop with no run folder (no saves): the training peak alone."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    import torch

    torch.set_num_threads(2)
    from diffattn.configs.run_config import load_run_config, resolve_model_config
    from diffattn.data.lm import make_source
    from diffattn.model.transformer import TransformerLM
    from diffattn.train.loop import train

    log: list = []
    _instrument(log)
    cfg = load_run_config(config, _overrides(tokens, steps, seq_len, mode))
    source, _ = make_source(cfg.data.to_dict(), seq_len)
    mcfg = resolve_model_config(cfg, source.vocab_size)
    base = _status("VmRSS")
    with torch.device("meta"):
        model = TransformerLM(mcfg)
    res = train(model, source, cfg.train, progress=False, quiet=True)
    return {"base": base, "log": log, "losses": [r["train_loss"] for r in res.history]}


def child_interleaved(configs: list[str], seq_len: int, rounds: int, vocab: int) -> dict:
    """DIFF against baseline throughput without running both whole models (which do not fit together here):
    one block of each config at full width, and the shared head (final norm, tied head, loss), each timed
    forward + backward with full checkpointing, round-robin (the order rotates each round). A model's step is
    n_layers blocks + the head; the ratio of tokens/s is the ratio of those sums, per round, median. Left out,
    being the same for both models: the embedding lookup and AdamW's update (so the ratio is a little further
    from 1 than a whole step's would be)."""
    import torch

    torch.set_num_threads(2)
    from diffattn.configs.run_config import load_run_config, resolve_model_config
    from diffattn.model.blocks import Block
    from diffattn.ops.norm import RMSNorm
    from diffattn.ops.rope import RotaryEmbedding
    from diffattn.train.loss import cross_entropy

    torch.manual_seed(0)
    cfgs = [resolve_model_config(load_run_config(c), vocab) for c in configs]
    blocks = [Block(c, 0).train() for c in cfgs]
    for b in blocks:
        b.checkpointing = "full"
    ropes = [RotaryEmbedding(b.attn.rope_dim, seq_len, c.rope_theta, c.rope) for b, c in zip(blocks, cfgs)]
    d = cfgs[0].d_model
    norm, head = RMSNorm(d), torch.nn.Linear(d, vocab, bias=False)
    x = torch.randn(1, seq_len, d)
    ids = torch.randint(0, vocab, (1, seq_len))
    pos = torch.arange(seq_len)

    def run_block(i):
        xi = x.clone().requires_grad_()
        blocks[i](xi, ropes[i](pos), pos, None, True).sum().backward()

    def run_head():
        xi = x.clone().requires_grad_()
        cross_entropy(head(norm(xi)), ids).backward()

    jobs = {"block0": lambda: run_block(0), "block1": lambda: run_block(1), "head": run_head}
    for f in jobs.values():
        f()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in jobs}
    names = list(jobs)
    for r in range(rounds):
        for k in names[r % 3:] + names[:r % 3]:
            t0 = time.perf_counter()
            jobs[k]()
            times[k].append(time.perf_counter() - t0)
    n = cfgs[0].n_layers
    ratios = [(n * b1 + h) / (n * b0 + h) for b0, b1, h in zip(times["block0"], times["block1"], times["head"])]
    return {"times": times, "ratio": statistics.median(ratios), "configs": configs, "rounds": rounds}


def _overrides(tokens: str, steps: int, seq_len: int, mode: str) -> list[str]:
    return ["--data.path", tokens, "--train.steps", str(steps), "--train.seq_len", str(seq_len),
            "--train.batch_size", "1", "--train.grad_accum", "1", "--train.dtype", "float32",
            "--train.activation_checkpointing", mode, "--train.warmup_steps", "2", "--train.eval_every", "0",
            "--train.log_every", "1", "--train.ckpt_every", "5", "--train.deterministic", "true",
            "--train.seed", "1234"]


def _child(kind: str, **kw) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps({"kind": kind, **kw})],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"child {kind} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ parts


def param_table(vocabs: tuple[int, ...]) -> list[dict]:
    from diffattn.configs.run_config import load_run_config, resolve_model_config
    from diffattn.train.plan import count_params

    rows = []
    for name in SIX:
        row: dict = {"config": name, "paper": PAPER[name]}
        for v in vocabs:
            c = count_params(resolve_model_config(load_run_config(name), v))
            row[f"total@{v}"] = c["total"]
            row["non_embedding"] = c["total"] - c["embeddings"]
        rows.append(row)
    return rows


def predicted(config: str, tokens_vocab: int, seq_len: int, mode: str) -> float:
    from diffattn.configs.run_config import load_run_config, resolve_model_config
    from diffattn.train.plan import plan

    cfg = load_run_config(config, [f"--train.seq_len={seq_len}"])
    p = plan(resolve_model_config(cfg, tokens_vocab), batch_size=1, seq_len=seq_len, world=1,
             activation_checkpointing=mode, dtype="float32", fused_optimizer=False)
    return p.layouts["ddp"].peak


def rehearse(config: str, tokens: str, work: Path, steps: int, seq_len: int, vocab: int) -> dict:
    out = work / config
    if out.exists():
        shutil.rmtree(out)
    argv = ["--config", config, "--out", str(out), "--no-progress", *_overrides(tokens, steps, seq_len, "full")]
    print(f"[{config}] training {steps} steps with full checkpointing ...", flush=True)
    run = _child("train", argv=argv)
    metrics = _metrics(out / "metrics.csv")
    shutil.copy(out / "metrics.csv", out / "metrics-uninterrupted.csv")
    print(f"[{config}] resuming from step {steps - 1} ...", flush=True)
    resumed = _child("train", argv=["--out", str(out), "--resume", "--no-progress"], resume_from=steps - 1)
    after = _metrics(out / "metrics.csv")
    shutil.rmtree(out / "ckpt-set-aside", ignore_errors=True)
    print(f"[{config}] 2 steps without checkpointing ...", flush=True)
    plain = _child("plain", config=config, tokens=tokens, steps=2, seq_len=seq_len, mode="none")
    size = run["ckpt_bytes"]
    shutil.rmtree(out, ignore_errors=True)  # ~12 GB per checkpoint: keep the logs only
    return {"config": config, "train": run, "resume": resumed, "no_ac": plain, "losses": metrics,
            "resumed_losses": after, "checkpoint_bytes": size,
            "planned": {m: predicted(config, vocab, seq_len, m) for m in ("full", "none")}}


def _metrics(path: Path) -> list[dict]:
    from diffattn.train.runlog import read_metrics

    return [{"step": int(r["step"]), "train_loss": r["train_loss"]} for r in read_metrics(path)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for rehearsal.json and README.md (required)")
    p.add_argument("--work", default="/tmp/diffattn-rehearsal", help="corpus, tokens and run folders")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="tiny models (tiny / tiny_baseline), 4 steps: smoke run")
    p.add_argument("--ratio-only", action="store_true", help="only (re)measure the interleaved DIFF/baseline "
                                                               "throughput and add it to OUT/rehearsal.json")
    p.add_argument("--rounds", type=int, default=7, help="rounds of the interleaved throughput timing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        kind = spec.pop("kind")
        children = {"train": child_train, "plain": child_plain, "interleaved": child_interleaved}
        res = children[kind](**spec)
        print(json.dumps(res))
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    if args.ratio_only:
        res = json.loads((out / "rehearsal.json").read_text())
        res["interleaved"] = _interleaved(res, args)
        _write(out, res)
        return 0
    work = Path(args.work)
    res: dict = {"machine": _machine(), "command": " ".join(["python", "benchmarks/scale_rehearsal.py",
                                                             *(argv if argv is not None else sys.argv[1:])])}
    res["corpus"] = build_corpus(work / "corpus")
    tokens = work / "tokens.bin"
    vocab = 32000
    if not tokens.exists():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "diffattn.data", str(work / "corpus"), str(tokens), "--tokenizer",
                        "bpe", "--vocab-size", str(vocab)], check=True, env={**os.environ, "PYTHONPATH":
                                                                               str(ROOT / "src")})
        res["tokenize_seconds"] = time.perf_counter() - t0
    res["tokens"] = json.loads(tokens.with_suffix(".json").read_text())["num_tokens"]
    res["params"] = param_table((vocab, 100288))
    configs, steps = (["tiny", "tiny_baseline"], 6) if args.quick else (["diff_830m", "base_830m"], args.steps)
    seq_len = min(args.seq_len, 128) if args.quick else args.seq_len
    res["runs"] = [rehearse(c, str(tokens), work, steps, seq_len, vocab) for c in configs]
    res["tokens_per_s_ratio"] = _median_step(res["runs"][1]) / _median_step(res["runs"][0])
    res["interleaved"] = _interleaved(res, args)
    _write(out, res)
    return 0


def _interleaved(res: dict, args) -> dict:
    configs = [r["config"] for r in res["runs"]]
    seq_len = min(args.seq_len, 128) if args.quick else args.seq_len
    print(f"interleaved throughput of {configs[0]} and {configs[1]} blocks ...", flush=True)
    got = _child("interleaved", configs=configs, seq_len=seq_len, rounds=args.rounds, vocab=32000)
    got["command"] = " ".join(["python", "benchmarks/scale_rehearsal.py", *sys.argv[1:]])
    return got


def _write(out: Path, res: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rehearsal.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "README.md").write_text(report(res))
    print(f"wrote {out / 'rehearsal.json'} and README.md")


# ------------------------------------------------------------------------------------------------ on a device


def device_rehearsal(device, configs: list[str], seq_lens: list[int], cases: list[tuple[str, bool]], *,
                     batch_size: int = 1, steps: int = 3, dtype: str = "bfloat16", vocab: int = 32000) -> dict:
    """In this process, on ``device``: each packaged config at each seq_len and each (checkpointing mode,
    compile) case, built on the meta device and trained ``steps`` steps through the loop on random tokens;
    loss per step, tokens/s (median over steps after the first), the peak memory of a step above what the case
    found allocated (``torch.cuda.max_memory_allocated`` less ``memory_allocated`` before the model was built,
    after a garbage collection; "-" on CPU), that held memory itself, and the planner's prediction. Rows as
    strings. The H200's first run reported the raw peak: its later rows carried up to 4.9 GiB that earlier cases
    of the process had left allocated (docs/results/gpu/README.md)."""
    import torch

    from diffattn.ops import backends

    rows = [_device_case(device, name, t, mode, compiled, batch_size, steps, dtype, vocab)
            for name in configs for t in seq_lens for mode, compiled in cases]
    picked = backends.describe(device, getattr(torch, dtype))["diff"]
    return {"title": f"Rehearsal on {device.type} ({dtype}, batch {batch_size}, {steps} steps, random tokens, "
                     f"vocab {vocab}; DIFF attention runs on {picked})",
            "header": ["config", "T", "checkpointing", "compile", "losses", "tokens/s", "peak GiB", "planned GiB",
                       "held before GiB"],
            "rows": rows}


def _device_case(device, name: str, t: int, mode: str, compiled: bool, batch_size: int, steps: int, dtype: str,
                 vocab: int) -> list[str]:
    import torch

    from diffattn.configs.run_config import load_run_config, resolve_model_config
    from diffattn.model.transformer import TransformerLM
    from diffattn.train import step as step_mod
    from diffattn.train.loop import train
    from diffattn.train.plan import plan

    cuda = device.type == "cuda"
    cfg = load_run_config(name, [f"--model.max_seq_len={t}", f"--train.seq_len={t}",
                                 f"--train.batch_size={batch_size}", "--train.grad_accum=1",
                                 f"--train.steps={steps}", "--train.eval_every=0", "--train.warmup_steps=1",
                                 "--train.log_every=1", f"--train.dtype={dtype}",
                                 f"--train.activation_checkpointing={mode}", f"--train.compile={compiled}"])
    mcfg = resolve_model_config(cfg, vocab)
    peaks, times = [], []
    real = step_mod.TrainStep.__call__
    held = _held(cuda)

    def timed(self, *a, **kw):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = real(self, *a, **kw)
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        times.append(time.perf_counter() - t0)
        return out

    step_mod.TrainStep.__call__ = timed
    try:
        with torch.device("meta"):
            model = TransformerLM(mcfg)
        res = train(model, _RandomTokens(vocab, t), cfg.train, progress=False, quiet=True)
    finally:
        step_mod.TrainStep.__call__ = real
        model = None  # noqa: F841 (the next case must not find this one's weights allocated)
        _held(cuda)
    planned = plan(mcfg, batch_size=batch_size, seq_len=t, activation_checkpointing=mode, dtype=dtype,
                   fused_optimizer=cuda).layouts["ddp"].peak
    tps = batch_size * t / statistics.median(times[1:] if len(times) > 1 else times)
    return [name, str(t), mode, "on" if compiled else "off", " ".join(f"{r['train_loss']:.3f}" for r in res.history),
            f"{tps:.0f}", f"{(max(peaks[1:] or peaks) - held) / GB:.2f}" if peaks else "-", f"{planned / GB:.2f}",
            f"{held / GB:.2f}" if cuda else "-"]


def _held(cuda: bool) -> int:
    """Bytes still allocated on the device after a garbage collection (0 on CPU): what a finished case left
    (a model caught in a reference cycle, an exception's frames) is freed here, and what stays is reported."""
    import gc

    import torch

    gc.collect()
    if not cuda:
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated())


class _RandomTokens:
    def __init__(self, vocab_size: int, seq_len: int):
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def get_batch(self, split: str, batch_size: int, generator):
        import torch

        x = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=generator)
        return x[:, :-1], x[:, 1:]


def _median_step(run: dict) -> float:
    """Median seconds of the uninterrupted run's steps after the first (which allocates AdamW's state)."""
    steps = [e["seconds"] for e in run["train"]["log"] if e["kind"] == "step"]
    return statistics.median(steps[1:] if len(steps) > 1 else steps)


def _join(values, fmt: str) -> str:
    return ", ".join(fmt.format(v) for v in values)


def report(res: dict) -> str:
    lines = ["# Real-size rehearsal on a CPU", "", f"Machine: {res['machine']}.", "",
             f"Command: `{res['command']}`", "", "## Parameters of the packaged paper configs (meta device)", "",
             "| config | paper | ours, vocab 32,000 | ours, vocab 100,288 | without embeddings |",
             "|---|---|---|---|---|"]
    for r in res["params"]:
        lines.append(f"| {r['config']} | {r['paper']} | {r['total@32000']:,} | {r['total@100288']:,} | "
                     f"{r['non_embedding']:,} |")
    corpus = ", ".join(f"{k} {v[0] / MB:.1f} MB" for k, v in res["corpus"].items())
    a, b = res["runs"][0]["config"], res["runs"][1]["config"]
    lines += ["", "## Training, saving and resuming", "", f"Corpus: {res['tokens']:,} tokens ({corpus}). Tokens/s "
              f"of {a} over {b}: {res['tokens_per_s_ratio']:.3f} (median step seconds after the first, one run "
              "each, in sequence)."]
    if "interleaved" in res:
        it = res["interleaved"]
        lines.append(f"Interleaved (one block of each at full width and the shared head, forward + backward with "
                     f"full checkpointing, {it['rounds']} rounds, order rotating, `{it['command']}`): "
                     f"{it['ratio']:.3f}.")
    lines.append("")
    for run in res["runs"]:
        lines += _run_lines(run)
    return "\n".join(lines) + "\n"


def _run_lines(run: dict) -> list[str]:
    tr = run["train"]
    steps = [e for e in tr["log"] if e["kind"] == "step"]
    saves = [e for e in tr["log"] if e["kind"] == "save"]
    restore = next(e for e in run["resume"]["log"] if e["kind"] == "restore")
    noac = [e for e in run["no_ac"]["log"] if e["kind"] == "step"]
    again = {r["step"]: r["train_loss"] for r in run["resumed_losses"]}
    last = run["losses"][-1]
    same = "equal" if again.get(last["step"]) == last["train_loss"] else "DIFFERENT"
    save_txt = ", ".join(f"{e['seconds']:.1f} s (peak {(e['peak'] - tr['base']) / GB:.2f} GiB)" for e in saves)
    return [f"### {run['config']}", "",
            f"- loss per step: {_join([r['train_loss'] for r in run['losses']], '{:.4f}')}",
            f"- step seconds: {_join([e['seconds'] for e in steps], '{:.1f}')} (median after the first: "
            f"{_median_step(run):.1f})",
            f"- peak per step with full checkpointing (above the process before the model): "
            f"{_join([(e['peak'] - tr['base']) / GB for e in steps], '{:.2f}')} GiB; planned "
            f"{run['planned']['full'] / GB:.2f} GiB",
            f"- peak per step without checkpointing: "
            f"{_join([(e['peak'] - run['no_ac']['base']) / GB for e in noac], '{:.2f}')} GiB; planned "
            f"{run['planned']['none'] / GB:.2f} GiB",
            f"- saves at steps 5 and 6: {save_txt}; checkpoint {run['checkpoint_bytes'] / GB:.2f} GiB on disk",
            f"- resume: load {restore['seconds']:.1f} s, peak {(restore['peak'] - run['resume']['base']) / GB:.2f} "
            f"GiB; step {last['step']} resumed loss {again.get(last['step'])!r} vs uninterrupted "
            f"{last['train_loss']!r}: {same}", ""]


if __name__ == "__main__":
    sys.exit(main())
