"""What ``diffattn doctor`` checks on this machine: library versions, the device, each attention backend (its
availability, its self-check against the safe path, a small forward + backward timed) and one training step of
a one-layer model of each registered attention variant (a new variant's file included, with nothing else to
edit)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
import warnings

import torch

from diffattn.attention.registry import ATTENTION, attention_label
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM
from diffattn.ops import backends

PACKAGES = ("torch", "triton", "transformers", "datasets", "tensorboard")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """{package: version or "not installed"}, plus python, diffattn and CUDA (torch's build)."""
    out = {"python": platform.python_version(), "diffattn": _version("diffattn")}
    out.update({name: _version(name) for name in PACKAGES})
    out["cuda"] = torch.version.cuda or "none (CPU build of torch)"
    return out


def device_line(device: torch.device) -> str:
    threads = f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{device} {p.name} (compute {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB), "
                f"{threads}")
    cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA device"
    return f"{device} ({platform.processor() or platform.machine()}; {cuda}), {threads}"


def backend_status(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per backend: name, available (or why not), self-check verdict, ms of a small fwd+bwd."""
    rows, seen = [], set()
    for kernel in backends.kernels():
        for name, fast in ((kernel.safe, False), (kernel.name, True)):
            if name in seen:  # a family's safe path, listed once beside its first kernel
                continue
            seen.add(name)
            why = kernel.available(device) if fast else None
            row = {"backend": name, "available": why is None, "why": why, "check": "safe path", "ms": None}
            if fast:
                if why is not None:
                    row["check"] = "skipped (unavailable)"
                elif device.type in backends.CHECK_DEVICE_TYPES and dtype in backends.CHECKED_DTYPES:
                    res = backends.self_check(name, device, dtype)
                    row["check"] = "passed" if res.ok else f"failed: {res.error}"
                    if kernel.opt_in:
                        row["check"] += f"; auto does not pick it: {kernel.opt_in}"
                    elif backends.measured_row(kernel.family, device, dtype) is None:
                        row["check"] += "; auto does not pick it: no measured row here"
                else:
                    row["check"] = f"skipped (auto does not use it on {device.type})"
            if why is None:
                try:
                    row["ms"] = 1e3 * backends.time_backend(name, device, dtype)
                except Exception as e:  # a backend that cannot run here: shown, not fatal
                    row["time_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
                    if fast and forward_runs(kernel, name, device, dtype):  # flex on CPU: no backward there
                        row["time_error"] = (f"inference only on {device.type} (no backward here; training uses "
                                             f"{kernel.safe}), so not timed")
            rows.append(row)
    return rows


def one_step_ms(name: str, device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    """Median ms of one forward + backward of a one-layer ``name`` model (d_model 64, 2 heads, 32 tokens)."""
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, max_seq_len=32, attention=name)
    model = TransformerLM(cfg).to(device=device, dtype=dtype)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    with torch.inference_mode(False), torch.enable_grad():
        for _ in range(repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            model(ids).float().logsumexp(-1).mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    timed = sorted(times[1:]) or times
    return 1e3 * timed[len(timed) // 2]


def variant_status(device: torch.device, dtype: torch.dtype, picks: dict[str, str]) -> list[dict]:
    """One row per registered attention type: its label, the op ``auto`` runs for it (``picks``, from
    :func:`backends.describe`), and the ms of a one-layer model's forward + backward, or why it failed."""
    rows = []
    for name in sorted(ATTENTION):
        row = {"attention": name, "label": attention_label(name), "op": picks.get(name, "?"), "ms": None}
        try:
            row["ms"] = one_step_ms(name, device, dtype)
        except Exception as e:  # a variant that cannot run here: shown, and the exit code says so
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
        rows.append(row)
    return rows


def forward_runs(kernel: backends.Kernel, name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether backend ``name`` runs a forward without gradients on the self-check's small case."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. flex's "called without torch.compile": this is only a probe
            kernel.run(name, backends.check_inputs(kernel.family, device, dtype))
    except Exception:  # it cannot run here at all
        return False
    return True
