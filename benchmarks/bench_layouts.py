"""V1's core layouts against the standard core, each call's SDPA backend recorded, the dispatch-table rows they
earn, the model step per layout for the types on V1's core, and the peers (timm, transformers) at equal shapes.
Issue 49's device measurement; ``benchmarks/gpu_suite.py`` runs it (its ``v1_layouts``, ``layout_steps``,
``layout_steps_compiled`` and ``peers`` parts). On CPU it runs at tiny sizes (the suite's test), where the
forced CUDA backends and FlexAttention's backward are rows that say why they did not run.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_attention import fwd_bwd, interleaved_times, med_ms, paired_ratio, print_table
from bench_model import ours, train_step

import diffattn.attention  # noqa: F401  (registers the variants and their kernels)
from diffattn.attention import functional as AF
from diffattn.model.config import ModelConfig, matched_baseline
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends
from diffattn.ops.norm import diff_epilogue, fused_diff_epilogue
from diffattn.ops.wide_v import sdpa_choice

LAYOUTS = ("sdpa", "sdpa_wide", "sdpa_split", "flex_wide")
# (label, diff_attention backend or None for the standard core, SDPA backend forced with sdpa_kernel or None)
VARIANTS = [("std", None, None), ("std flash", None, "FLASH_ATTENTION"), ("std cudnn", None, "CUDNN_ATTENTION"),
            ("V1 sdpa", "sdpa", None), ("V1 sdpa_wide", "sdpa_wide", None),
            ("V1 sdpa_wide cudnn", "sdpa_wide", "CUDNN_ATTENTION"),
            ("V1 sdpa_wide efficient", "sdpa_wide", "EFFICIENT_ATTENTION"), ("V1 sdpa_split", "sdpa_split", None),
            ("V1 sdpa_split flash", "sdpa_split", "FLASH_ATTENTION"), ("V1 flex_wide", "flex_wide", None),
            ("V1 triton", "triton", None)]
SAME_CLASS = {"FLASH_ATTENTION": "std flash", "CUDNN_ATTENTION": "std cudnn"}


@contextlib.contextmanager
def forced(backend: str | None):
    """SDPA restricted to ``backend`` (a torch.nn.attention.SDPBackend name), or as it is."""
    if backend is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        yield


@contextlib.contextmanager
def recording(seen: list[str]):
    """Every F.scaled_dot_product_attention call made inside appends the backend SDPA picks for it."""
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append(sdpa_choice(q, k, v, is_causal=is_causal, attn_mask=attn_mask))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def backends_taken(fn: Callable[[], object], label: str) -> str:
    """The SDPA backends one call of ``fn`` took (e.g. "flash x2"), "flex"/"triton" for those layouts."""
    seen: list[str] = []
    with recording(seen):
        fn()
    if not seen:
        return "flex" if "flex" in label else "triton" if "triton" in label else "none"
    return ", ".join(f"{b} x{seen.count(b)}" for b in dict.fromkeys(seen))


def _variant_fns(label, backend, sdpa_backend, std, v1):
    if backend is None:
        def fn(q, k, v):
            with forced(sdpa_backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fn, std

    def fn1(q, k, v, lam):
        with forced(sdpa_backend):
            return AF.diff_attention(q, k, v, lam, backend=backend)
    return fn1, v1


def layout_table(ts: list[int], repeats: int, h: int, d: int, batch: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[dict, dict]:
    """Causal fwd+bwd of the standard core (2h heads of d) and of every V1 layout (h diff-heads, Q/K d, V 2d),
    each under SDPA's own choice and under the forced backends of :data:`VARIANTS`, per T. Returns (the table,
    {label: {T: fwd+bwd ratio vs the default standard core}}); a variant that cannot run here is a row saying
    why."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows, ratios = [], {}
    for t in ts:
        r = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
        std = [r(batch, 2 * h, t, d) for _ in range(3)]
        v1 = [r(batch, 2 * h, t, d), r(batch, 2 * h, t, d), r(batch, h, t, 2 * d),
              torch.tensor(0.5, device=device, requires_grad=True)]
        timed, took, failed = {}, {}, {}
        for label, backend, sdpa_backend in VARIANTS:
            fn, inputs = _variant_fns(label, backend, sdpa_backend, std, v1)
            try:
                took[label] = backends_taken(lambda fn=fn, inputs=inputs: fwd_bwd(fn, inputs)(), label)
                sync()
            except Exception as e:  # a forced backend or layout that cannot take this call: a row, not a crash
                failed[label] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100] if str(e) else ''}"
                continue
            timed[f"{label} fwd"] = _synced(lambda fn=fn, inputs=inputs: fn(*inputs), sync)
            timed[f"{label} fwd+bwd"] = _synced(fwd_bwd(fn, inputs), sync)
        times = interleaved_times(timed, repeats, warmup=2, min_time=0.02)
        for label, _, sdpa_backend in VARIANTS:
            if label in failed:
                rows.append([str(t), label, "did not run: " + failed[label], "-", "-", "-", "-", "-"])
                continue
            fwd, both = med_ms(times[f"{label} fwd"]), med_ms(times[f"{label} fwd+bwd"])
            ratio = paired_ratio(times, f"{label} fwd+bwd", "std fwd+bwd")
            ratios.setdefault(label, {})[t] = ratio
            same = SAME_CLASS.get(sdpa_backend)
            same_ratio = (f"{paired_ratio(times, f'{label} fwd+bwd', f'{same} fwd+bwd'):.2f}x ({same})"
                          if same and same != label and f"{same} fwd+bwd" in times else "-")
            rows.append([str(t), label, took[label], f"{fwd:.2f}", f"{both - fwd:.2f}", f"{both:.2f}",
                         "-" if label == "std" else f"{ratio:.2f}x", same_ratio])
    title = (f"V1 core layouts vs the standard core, {device.type} {str(dtype).removeprefix('torch.')}, causal, "
             f"B={batch}: {h} diff-heads (q/k {d}, v {2 * d}) vs {2 * h} heads of {d}; each call's SDPA backend "
             "[target V1/std <= 1.6x]")
    return print_table(title, ["T", "variant", "SDPA backend(s)", "fwd ms", "bwd ms", "fwd+bwd ms", "vs std",
                               "vs std, same class"], rows), ratios


def _synced(fn: Callable[[], object], sync: Callable[[], None]) -> Callable[[], None]:
    def step() -> None:
        fn()
        sync()

    return step


def epilogue_ratio(ts: list[int], repeats: int, h: int, d: int, batch: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[dict, float | None]:
    """V1's epilogue (λ, subtraction, per-head norm, scale) eager against one compiled region, fwd+bwd on
    (B, h, T, 2d); returns (the table, geometric mean of compiled / eager over T, None if compiled failed)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows, logs = [], []
    for t in ts:
        r = lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
        inputs = [r(batch, h, t, 2 * d), r(batch, h, t, 2 * d), torch.tensor(0.5, device=device),
                  torch.ones(2 * d, device=device, dtype=dtype, requires_grad=True)]
        fns = {"eager": lambda *x: diff_epilogue(*x, 1e-5), "compiled": lambda *x: fused_diff_epilogue(*x, 1e-5)}
        try:
            timed = {k: _synced(fwd_bwd(f, inputs), sync) for k, f in fns.items()}
            for f in timed.values():
                f()
            times = interleaved_times(timed, repeats, warmup=1, min_time=0.01)
        except Exception as e:  # inductor missing or failing here: the eager epilogue stays
            rows.append([str(t), f"compiled failed: {type(e).__name__}", "-", "-"])
            return print_table("V1 epilogue, eager vs compiled", ["T", "eager ms", "compiled ms", "ratio"], rows), None
        ratio = paired_ratio(times, "compiled", "eager")
        logs.append(math.log(ratio))
        rows.append([str(t), f"{med_ms(times['eager']):.3f}", f"{med_ms(times['compiled']):.3f}", f"{ratio:.2f}x"])
    table = print_table(f"V1 epilogue (λ, subtraction, per-head RMSNorm, scale) fwd+bwd, eager vs one compiled "
                        f"region, B={batch}, {h} heads of {2 * d}", ["T", "eager ms", "compiled ms",
                                                                    "compiled / eager"], rows)
    return table, math.exp(sum(logs) / len(logs))


def dispatch_rows(ratios: dict, epilogue: float | None, device: torch.device, dtype: torch.dtype,
                  source: str) -> list[dict]:
    """The measured row for (this device's capability, dtype): the V1 layout with the lowest geometric mean of
    fwd+bwd / standard core over T, among the layouts as ``auto`` runs them (SDPA's own backend choice), and the
    compiled epilogue where it was faster. In the format of ``diffattn/ops/dispatch.json``."""
    means = {lay: math.exp(statistics.fmean(math.log(x) for x in ratios[f"V1 {lay}"].values()))
             for lay in LAYOUTS if ratios.get(f"V1 {lay}")}
    if not means:
        return []
    best = min(means, key=means.get)
    ts = sorted(ratios[f"V1 {best}"])
    span = lambda lay: "-".join(f"{x:.2f}" for x in (min(ratios[f"V1 {lay}"].values()),
                                                      max(ratios[f"V1 {lay}"].values())))
    measured = (f"fwd+bwd / standard core at T = {ts[0]}-{ts[-1]}: " + ", ".join(
        f"{lay} {span(lay)}x" for lay in means) + (f"; epilogue compiled / eager {epilogue:.2f}x"
                                                   if epilogue is not None else ""))
    row = {"family": "diff", "capability": backends.capability(device), "dtype": str(dtype).removeprefix("torch."),
           "layout": best, "source": source, "measured": measured,
           "epilogue": "compiled" if epilogue is not None and epilogue < 0.95 else "eager"}
    return [row]


# --------------------------------------------------------------------------------------------- model steps
ON_V1_CORE = ("diff", "shared_diff", "dint", "grouped_diff")


def _with_layout(step: Callable[[], None], layout: str | None) -> Callable[[], None]:
    def run() -> None:
        old = os.environ.get(backends.ENV_VAR)
        if layout is not None:
            os.environ[backends.ENV_VAR] = layout
        try:
            step()
        finally:
            if old is None:
                os.environ.pop(backends.ENV_VAR, None)
            else:
                os.environ[backends.ENV_VAR] = old

    return run


def layout_steps(*, device: torch.device, t: int, d_model: int, n_layers: int, n_heads: int, vocab: int,
                 repeats: int, types: tuple[str, ...], layouts: tuple[str, ...], label: str) -> dict:
    """One eager train step (fwd + bwd + AdamW, B=1, bf16 autocast on CUDA) of each type on each V1 layout
    (DIFFATTN_BACKEND around its step; ``diff_v2`` and ``standard`` have none) against its matched baseline,
    all stepped round-robin; tokens/s ratios are paired medians."""
    fns, notes, base_of = {}, {}, {}
    ids = torch.randint(0, vocab, (1, t + 1), device=device)
    for name in types:
        cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, attention=name,
                          max_seq_len=t)
        base_cfg = matched_baseline(cfg) if name != "standard" else cfg
        base_key = f"standard ({base_cfg.n_heads} heads)"
        if base_key not in fns:
            fns[base_key] = train_step(TransformerLM(base_cfg).to(device), ids, ours)
            notes[base_key] = backends_taken(fns[base_key], "")
        if name == "standard":  # the baselines are standard models
            continue
        model = TransformerLM(cfg).to(device)
        for lay in (layouts if name in ON_V1_CORE else (None,)):
            key = name if lay is None else f"{name} {lay}"
            step = _with_layout(train_step(model, ids, ours), lay)
            try:
                notes[key] = backends_taken(step, lay or "")
            except Exception as e:  # a layout this device cannot run: a row, not a crash
                notes[key] = f"did not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"
                continue
            fns[key], base_of[key] = step, base_key
    times = interleaved_times(fns, repeats, warmup=1, min_time=0.0)
    rows = []
    for key in notes:
        if key not in times:
            rows.append([key, "-", "-", "-", notes[key]])
            continue
        s = statistics.median(times[key])
        base = base_of.get(key)
        ratio = "-" if base is None else f"{statistics.median(b / a for a, b in zip(times[key], times[base])):.3f}x"
        rows.append([key, f"{1e3 * s:.1f}", f"{t / s:.0f}", ratio, notes[key]])
    return print_table(f"Train step per V1 layout ({label}: T={t}, d_model {d_model}, {n_layers} layers, "
                       f"{n_heads} heads, eager; target >= 0.90x, V2 >= 0.95x)",
                       ["model", "step ms", "tokens/s", "vs matched baseline", "SDPA backends (one step)"], rows)


def layout_steps_compiled(*, device: torch.device, t: int, d_model: int, n_layers: int, n_heads: int, vocab: int,
                          repeats: int, layouts: tuple[str, ...]) -> dict:
    """DIFF and its matched baseline under torch.compile, one layout at a time (the layout is a constant of the
    traced graph, so dynamo's caches are reset between layouts); paired median tokens/s ratios."""
    ids = torch.randint(0, vocab, (1, t + 1), device=device)
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, attention="diff",
                      max_seq_len=t)
    rows = []
    for lay in layouts:
        torch._dynamo.reset()
        old = os.environ.get(backends.ENV_VAR)
        os.environ[backends.ENV_VAR] = lay
        try:
            fns = {"diff": train_step(TransformerLM(cfg).to(device), ids, ours, compile_model=True),
                   "base": train_step(TransformerLM(matched_baseline(cfg)).to(device), ids, ours,
                                      compile_model=True)}
            times = interleaved_times(fns, repeats, warmup=2, min_time=0.0)
            ratio = statistics.median(b / a for a, b in zip(times["diff"], times["base"]))
            rows.append([lay, f"{1e3 * statistics.median(times['diff']):.1f}",
                         f"{1e3 * statistics.median(times['base']):.1f}", f"{ratio:.3f}x"])
        except Exception as e:  # one layout failing to compile costs its row
            rows.append([lay, f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}", "-", "-"])
        finally:
            if old is None:
                os.environ.pop(backends.ENV_VAR, None)
            else:
                os.environ[backends.ENV_VAR] = old
    torch._dynamo.reset()
    return print_table(f"DIFF vs matched baseline compiled, per V1 layout (T={t}, d_model {d_model}, {n_layers} "
                       "layers; target >= 0.90x)", ["layout", "diff step ms", "baseline step ms",
                                                    "diff / baseline tokens/s"], rows)


# --------------------------------------------------------------------------------------------------- peers
def _layer_step(layer: torch.nn.Module, x: torch.Tensor, call: Callable, sync: Callable[[], None]):
    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
            out = call(layer, x)
        out.float().square().mean().backward()
        sync()

    return step


def timm_peer(*, device: torch.device, t: int, d_model: int, n_heads: int, repeats: int, batch: int = 1) -> dict:
    """timm's ``DiffAttention`` layer (bidirectional, vision) against ours at the same width and heads,
    non-causal, fwd+bwd of the layer alone; a missing timm, or a signature this code does not know, is a row."""
    from diffattn.attention.diff import MultiheadDiffAttention

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    x = torch.randn(batch, t, d_model, device=device, requires_grad=True)
    mine = MultiheadDiffAttention(d_model, n_heads, depth=0).to(device)
    fns = {"ours diff layer": _layer_step(mine, x, lambda m, a: m(a, causal=False), sync)}
    notes = {"ours diff layer": f"{sum(p.numel() for p in mine.parameters()):,} params, {n_heads} diff-heads"}
    try:
        from timm.layers.diff_attention import DiffAttention

        theirs = DiffAttention(d_model, num_heads=n_heads).to(device)
        fns["timm DiffAttention"] = _layer_step(theirs, x, lambda m, a: m(a), sync)
        notes["timm DiffAttention"] = (f"{sum(p.numel() for p in theirs.parameters()):,} params, "
                                       f"num_heads={n_heads}")
    except Exception as e:  # not installed, or another API: a line in the results
        notes["timm DiffAttention"] = f"not run: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    times = interleaved_times(fns, repeats, warmup=1, min_time=0.0)
    rows = []
    for name, note in notes.items():
        if name not in times:
            rows.append([name, "-", "-", note])
            continue
        ratio = statistics.median(a / b for a, b in zip(times[name], times["ours diff layer"]))
        rows.append([name, f"{med_ms(times[name]):.2f}", f"{ratio:.2f}x", note])
    return print_table(f"Peer layer: timm DiffAttention vs ours (B={batch}, T={t}, d_model {d_model}, non-causal, "
                       "fwd+bwd)", ["layer", "fwd+bwd ms", "time / ours", "note"], rows)
