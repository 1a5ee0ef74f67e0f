"""Which kernel ``backend="auto"`` runs for each attention type, and the self-check that earns a fast kernel
that place.

A *kernel family* is a safe path and the fast kernels (layouts) beside it, each registered (:func:`register`) by
the attention variant file that owns the op, with the small case its self-check runs (``make_inputs``) and the
names of what it compares (``grad_names``). Today:

* ``diff`` (V1's core): the padded SDPA call (``"sdpa"``, safe); both maps in one SDPA call with V at 2d
  (``"sdpa_wide"``: cuDNN / memory-efficient SDPA); V cut into halves for flash (``"sdpa_split"``); FlexAttention
  with V at 2d (``"flex_wide"``); the fused Triton kernel (``"triton"``);
* ``distance``: FlexAttention (``"flex"``) or the block loop (``"block"``).

**The dispatch table.** ``auto`` runs a fast kernel only where a *measured* row names it: ``dispatch.json`` beside
this module, rows keyed by (family, device capability such as ``sm_90``, dtype), each naming the layout that won
there and the results file it came from (``benchmarks/gpu_suite.py``'s ``v1_layouts`` part writes them in this
format). A (capability, dtype) with no row takes the safe path: a kernel never measured on a device never becomes
the default there. ``explain`` (and ``diffattn doctor``) says which row, or that there is none.

Each attention type declares (:func:`declare_attention`, called by the attention registry's ``@register``) the
family whose choice it follows, or the one op it always runs (``standard``, ``diff_v2``: ``"sdpa"``), so
:func:`describe` and ``diffattn doctor`` list every registered variant without a list here.

On a device type in :data:`CHECK_DEVICE_TYPES` (CUDA), the first time a row would make ``auto`` pick a fast kernel
for a (device, dtype), :func:`self_check` runs a small forward + backward on it and on the safe path against the
float64 safe path, within the tolerances the tests use. The verdict is kept for the process. A failure warns
once, naming the kernel and the error, and ``auto`` takes the safe path from then on. Everywhere else ``auto``
takes the safe path without a check. A kernel registered ``opt_in`` (with the reason: V1's Triton kernel and
FlexAttention's DA, each slower than its safe path on an H200) is never ``auto``'s pick, a row naming it
notwithstanding; it runs when named.

``DIFFATTN_BACKEND=auto|<any registered kernel or safe path>`` overrides ``auto`` (no self-check) for the family
the named backend belongs to; the other family keeps ``auto``. A forced fast kernel that cannot run here at all (not
installed, wrong device) is a :class:`BackendError` (a ValueError); a call it cannot take (a float mask,
tensor offsets) still goes to the safe path, as under ``auto``.

Under torch.compile the choice is a constant: traced code only reads the cache (:func:`choose`), never runs a
check; with no verdict cached yet it takes the safe path. :func:`describe` (called eagerly, e.g. at the start
of training) runs the checks first so a compiled model sees them.

The kernels and the attention types register themselves from their attention variants
(:mod:`diffattn.attention.diff`, :mod:`diffattn.attention.distance`, the registry's ``@register``): this module
imports nothing of the package but its dispatch table's reader (:mod:`diffattn.ops.dispatch_table`), at import time
or later (the dependency points from the variants to the ops), so what it lists is what the attention package has
registered by the time it is asked (a model built, the registry imported).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# the table's reader is part of this module's face (Row, parse_rows, capability: doctor, the GPU suite, tests)
from diffattn.ops.dispatch_table import DISPATCH_FILE, Row, capability, parse_rows, shipped_table  # noqa: F401
from diffattn.system.untrusted import Refused

ENV_VAR = "DIFFATTN_BACKEND"
EPILOGUE_VAR = "DIFFATTN_EPILOGUE"
CHOICES = ("auto", "sdpa", "sdpa_wide", "sdpa_split", "flex_wide", "triton", "flex", "block")
# device types where auto may pick a fast kernel (after its self-check); tests add "cpu" to exercise the logic
CHECK_DEVICE_TYPES: set[str] = {"cuda"}
CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Kernel:
    """A fast kernel and its safe path. ``run(backend, inputs)`` calls the op with ``backend`` forced on the
    tensors of ``make_inputs(device, dtype)`` (the self-check's small causal case: tensors in ``dtype``, scalar
    parameters in fp32, drawn from a private generator); ``grad_names`` name the output and the gradient of each
    input, in order (e.g. ``("out", "dq", "dk", "dv", "dlam")``); ``available(device)`` says why it cannot run
    on that device, or None. ``opt_in``, when set, is why ``auto`` never picks it (measured slower than its safe
    path on a device, say): it runs only when asked for by name."""

    name: str
    safe: str
    family: str
    run: Callable[[str, list[Tensor]], Tensor]
    available: Callable[[torch.device], str | None]
    make_inputs: Callable[[torch.device, torch.dtype], list[Tensor]]
    grad_names: tuple[str, ...]
    opt_in: str | None = None


@dataclass
class CheckResult:
    """One self-check: ``ok``; ``error`` (why not); ``seconds`` of the whole check; ``err`` / ``allowed`` max |Δ|
    per output and gradient against float64."""

    kernel: str
    device: str
    dtype: str
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    err: dict[str, float] = field(default_factory=dict)
    allowed: dict[str, float] = field(default_factory=dict)


class BackendError(Refused):
    """DIFFATTN_BACKEND is invalid, or names a kernel that cannot run here (a usage error: exit 2 in the CLI)."""


_KERNELS: dict[str, Kernel] = {}
_FAMILIES: dict[str, list[Kernel]] = {}  # family -> its fast kernels, in registration order
_RESULTS: dict[tuple[str, str, torch.dtype], CheckResult] = {}
# attention type -> (kernel family it follows or None, the op it runs when it has no family)
_TYPES: dict[str, tuple[str | None, str]] = {}


def register(kernel: Kernel) -> None:
    """Add ``kernel`` to its family's fast kernels (its attention variant's module does this at import); a kernel
    of the same name is replaced."""
    if len(kernel.grad_names) < 2:
        raise ValueError(f"kernel {kernel.name!r}: grad_names must name the output and each input's gradient")
    fam = _FAMILIES.setdefault(kernel.family, [])
    if fam and fam[0].safe != kernel.safe:
        raise ValueError(f"kernel {kernel.name!r}: family {kernel.family!r}'s safe path is {fam[0].safe!r}")
    _FAMILIES[kernel.family] = [k for k in fam if k.name != kernel.name] + [kernel]
    _KERNELS[kernel.name] = kernel


def family_kernels(family: str) -> list[Kernel]:
    """The fast kernels of ``family``; a ValueError naming the known ones when there is no such family."""
    if not _FAMILIES.get(family):
        raise ValueError(f"no kernel family {family!r} is registered (known: {sorted(_FAMILIES)})")
    return list(_FAMILIES[family])


def families() -> list[str]:
    """Every registered kernel family, in name order."""
    return sorted(_FAMILIES)


def safe_path(family: str) -> str:
    """The name of ``family``'s safe path (e.g. "sdpa", "block")."""
    return family_kernels(family)[0].safe


def kernels() -> list[Kernel]:
    """Every registered fast kernel, in the order the attention modules registered them."""
    return list(_KERNELS.values())


def declare_attention(name: str, family: str | None, op: str = "sdpa") -> None:
    """Attention type ``name`` follows kernel ``family``'s choice, or (``family`` None) always runs ``op``.
    The attention registry calls this for every ``@register``ed variant."""
    _TYPES[name] = (family, op)


def forget_attention(name: str) -> None:
    """Undo :func:`declare_attention` (a variant removed from the registry, e.g. by a test)."""
    _TYPES.pop(name, None)


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result``, without its import of ``torch._dynamo`` (a second of start-up
    for every command, and the place a Ctrl-C then landed): that decorator only sets this attribute, which
    dynamo reads when it meets the call. tests/ops/test_backends.py checks it against the installed torch."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def reset() -> None:
    """Forget every self-check verdict (tests; a changed environment)."""
    _RESULTS.clear()


# ------------------------------------------------------------------------------------------- dispatch table
_TABLE_OVERRIDE: list[tuple[Row, ...]] = []  # tests (and the suite's dry runs) swap the table in


def table() -> tuple[Row, ...]:
    """The dispatch table ``auto`` reads (``dispatch.json``, or what :func:`use_table` put in its place)."""
    return _TABLE_OVERRIDE[-1] if _TABLE_OVERRIDE else shipped_table()


def use_table(rows: list[Row] | None) -> None:
    """Make ``rows`` the dispatch table (None: back to the shipped ``dispatch.json``); forgets the verdicts."""
    _TABLE_OVERRIDE.clear()
    if rows is not None:
        _TABLE_OVERRIDE.append(tuple(rows))
    reset()


def measured_row(family: str, device: torch.device | str, dtype: torch.dtype) -> Row | None:
    """The table's row for (``family``, the device's capability, ``dtype``), or None."""
    cap, dt = capability(device), str(dtype).removeprefix("torch.")
    return next((r for r in table() if (r.family, r.capability, r.dtype) == (family, cap, dt)), None)


# ---------------------------------------------------------------------------------------------- env override
@assume_constant_result
def env_backend() -> str:
    """The value of DIFFATTN_BACKEND ("auto" when unset); anything else than :data:`CHOICES` is a
    :class:`BackendError`."""
    raw = os.environ.get(ENV_VAR, "").strip()
    value = raw.lower() or "auto"
    if value not in CHOICES:
        raise BackendError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}; got {raw!r}")
    return value


# ------------------------------------------------------------------------------------------------ self-check
def check_inputs(family: str, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """The small case of ``family``'s self-check (its first kernel's ``make_inputs``)."""
    return family_kernels(family)[0].make_inputs(torch.device(device), dtype)


def random_inputs(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, ...]], seed: int = 0
                  ) -> list[Tensor]:
    """Standard-normal tensors of ``shapes`` in ``dtype`` on ``device``, drawn from a private generator (the
    global RNG is left alone): the q/k/v of a kernel's self-check case."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def _fwd_bwd(kernel: Kernel, backend: str, inputs: list[Tensor], go: Tensor) -> list[Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = kernel.run(backend, leaves)
    grads = torch.autograd.grad(out, leaves, go.to(device=out.device, dtype=out.dtype), allow_unused=True)
    return [out.detach(), *(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))]


def _tolerance(dtype: torch.dtype) -> float:
    # tests/test_triton.py: fp32 within 1e-5 of float64 (relative to the largest value); half precision within
    # 4 eps of it, or twice what the safe op itself loses in that dtype
    return 1e-5 if dtype in (torch.float32, torch.float64) else 4 * torch.finfo(dtype).eps


def compare(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """max |Δ| of the fast kernel's output and gradients against the safe path in float64, and what is allowed:
    max(tolerance · max(1, |largest value|), 2 · the safe path's own error in ``dtype``). Raises on failure."""
    inputs = kernel.make_inputs(device, dtype)
    g = torch.Generator().manual_seed(1)
    shape = kernel.run(kernel.safe, inputs).shape
    go = torch.randn(*shape, generator=g).to(device)
    got = _fwd_bwd(kernel, kernel.name, inputs, go)
    exact = _fwd_bwd(kernel, kernel.safe, [x.double() for x in inputs], go)
    own = _fwd_bwd(kernel, kernel.safe, inputs, go)
    names = list(kernel.grad_names)
    err, allowed = {}, {}
    for n, a, e, s in zip(names, got, exact, own):
        scale = e.abs().max().item()
        err[n] = (a.double() - e).abs().max().item()
        allowed[n] = max(_tolerance(dtype) * max(1.0, scale), 2 * (s.double() - e).abs().max().item())
    bad = [n for n in names if not err[n] <= allowed[n]]  # NaN fails too
    if bad:
        raise AssertionError("mismatch against the float64 " + kernel.safe + " path: " + ", ".join(
            f"{n} max|Δ| {err[n]:.2e} > {allowed[n]:.2e}" for n in bad))
    return err, allowed


def self_check(name: str, device: torch.device | str, dtype: torch.dtype) -> CheckResult:
    """Run (once per process and (device, dtype)) the self-check of kernel ``name`` ("triton" or "flex").

    Runs eagerly whatever the caller's context: grad on, autocast and inference mode off. On failure warns once
    (RuntimeWarning) naming the kernel, the device and the error. Returns the cached :class:`CheckResult`.
    """
    if name not in _KERNELS:
        raise ValueError(f"no kernel {name!r} is registered ({sorted(_KERNELS)}): the attention variants register "
                         "their kernels when diffattn.attention is imported")
    kernel = _KERNELS[name]
    device = torch.device(device)
    key = (name, str(device), dtype)
    if key in _RESULTS:
        return _RESULTS[key]
    t0 = time.perf_counter()
    res = CheckResult(kernel=name, device=str(device), dtype=str(dtype).removeprefix("torch."), ok=True)
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            res.err, res.allowed = compare(kernel, device, dtype)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as e:  # any failure (compile error, launch error, wrong numbers) means: do not use it
        lines = str(e).strip().splitlines()
        res.ok, res.error = False, f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]
        warnings.warn(f"diffattn: the {name} attention kernel failed its self-check on {device} {res.dtype} "
                      f"({res.error}); using the {kernel.safe} path instead", RuntimeWarning, stacklevel=3)
    res.seconds = time.perf_counter() - t0
    _RESULTS[key] = res
    return res


# --------------------------------------------------------------------------------------------------- choice
def _why_not(family: str, device: torch.device, dtype: torch.dtype) -> tuple[str | None, str]:
    """(the fast kernel the table makes ``auto``'s candidate, or None; why, in words)."""
    safe = safe_path(family)
    dt = str(dtype).removeprefix("torch.")
    if device.type not in CHECK_DEVICE_TYPES or dtype not in CHECKED_DTYPES:
        return None, (f"the safe path ({safe}): no measured row is read on {device.type} (auto picks fast kernels on "
                      f"{'/'.join(sorted(CHECK_DEVICE_TYPES))} only)")
    row = measured_row(family, device, dtype)
    if row is None:
        return None, f"no measurement for {capability(device)}/{dt}: safe path ({safe})"
    cite = f"measured row {row.capability}/{row.dtype} ({row.source}{': ' + row.measured if row.measured else ''})"
    if row.layout == safe:
        return None, f"{safe}: {cite}"
    kernel = _KERNELS.get(row.layout)
    if kernel is None or kernel.family != family:
        return None, f"the safe path ({safe}): the {cite} names {row.layout!r}, no kernel of this family"
    if kernel.opt_in:
        return None, f"the safe path ({safe}): the {cite} names {row.layout}, which is opt-in ({kernel.opt_in})"
    why = kernel.available(device)
    if why is not None:
        return None, f"the safe path ({safe}): the {cite} names {row.layout}, unavailable here ({why})"
    return row.layout, f"{row.layout}: {cite}"


def _pick(family: str, device: torch.device, dtype: torch.dtype, *, run_checks: bool) -> str:
    safe = safe_path(family)
    forced = env_backend()
    if forced == safe:
        return forced
    kernel = _KERNELS.get(forced)
    if kernel is not None and kernel.family == family:
        why = kernel.available(device)
        if why is not None:
            raise BackendError(f"{ENV_VAR}={forced}: {why}")
        return forced
    name, _ = _why_not(family, device, dtype)
    if name is None:
        return safe
    if run_checks:
        return name if self_check(name, device, dtype).ok else safe
    res = _RESULTS.get((name, str(device), dtype))
    return name if res is not None and res.ok else safe


def explain(family: str, device: torch.device | str, dtype: torch.dtype | str) -> str:
    """Which kernel ``auto`` runs for ``family`` here and why: the table's row (and its source), or "no
    measurement for sm_XX/dtype: safe path"; a failed self-check or DIFFATTN_BACKEND is said too."""
    device, dtype = torch.device(device), _as_dtype(dtype)
    forced = env_backend()
    if forced != "auto" and (forced == safe_path(family) or forced in {k.name for k in family_kernels(family)}):
        return f"{forced}: forced by {ENV_VAR}"
    name, why = _why_not(family, device, dtype)
    if name is not None and not self_check(name, device, dtype).ok:
        return f"the safe path ({safe_path(family)}): {name} failed its self-check; {why}"
    return why


def epilogue(family: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """"compiled" when the measured row in force for (``family``, device, dtype) says V1's epilogue (λ, the
    subtraction, the per-head norm and scale) runs as one compiled region, else "eager". DIFFATTN_EPILOGUE
    (eager|compiled) overrides it (the benchmarks measure both)."""
    raw = os.environ.get(EPILOGUE_VAR, "").strip().lower()
    if raw in ("eager", "compiled"):
        return raw
    if raw not in ("", "auto"):
        raise BackendError(f"{EPILOGUE_VAR} must be one of auto, eager, compiled; got {raw!r}")
    device = torch.device(device)
    if device.type not in CHECK_DEVICE_TYPES:
        return "eager"
    row = measured_row(family, device, dtype)
    return row.epilogue if row is not None else "eager"


@assume_constant_result
def _pick_cached(family: str, device: str, dtype: torch.dtype) -> str:
    return _pick(family, torch.device(device), dtype, run_checks=False)


def choose(family: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``auto`` runs for kernel ``family`` (e.g. "diff", "distance") on tensors of ``device`` and ``dtype``.

    Eagerly, the first call on a checked device runs the self-check; under torch.compile only the cache is read.
    """
    if torch.compiler.is_compiling():
        return _pick_cached(family, str(device), dtype)
    return _pick(family, torch.device(device), dtype, run_checks=True)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return got


def describe(device: torch.device | str, dtype: torch.dtype | str = torch.float32) -> dict[str, str]:
    """{attention type: backend ``auto`` runs} for plain causal calls (no mask) on ``device`` / ``dtype``, for
    every registered attention type, in name order.

    Runs the self-checks this needs, eagerly; so call it before compiling a model.
    """
    device, dtype = torch.device(device), _as_dtype(dtype)
    return {a: choose(fam, device, dtype) if fam is not None else op for a, (fam, op) in sorted(_TYPES.items())}


def describe_line(device: torch.device | str, dtype: torch.dtype | str = torch.float32) -> str:
    """One log line: ``attention backends (cuda:0, bfloat16): standard sdpa, diff triton, ...``."""
    dtype = _as_dtype(dtype)
    picks = describe(device, dtype)
    failed = [r for r in _RESULTS.values() if not r.ok and r.device == str(torch.device(device))]
    note = "".join(f"; {r.kernel} failed its self-check ({r.error})" for r in failed)
    forced = env_backend()
    src = f" [{ENV_VAR}={forced}]" if forced != "auto" else ""
    return (f"attention backends ({torch.device(device)}, {str(dtype).removeprefix('torch.')}){src}: "
            + ", ".join(f"{a} {b}" for a, b in picks.items()) + note)


def time_backend(name: str, device: torch.device | str, dtype: torch.dtype, repeats: int = 3) -> float:
    """Median seconds of one forward + backward of backend ``name`` (any of sdpa, triton, flex, block) on the
    self-check's small case. Raises what the backend raises."""
    device = torch.device(device)
    kernel = next((k for k in _KERNELS.values() if name in (k.name, k.safe)), None)
    if kernel is None:
        raise ValueError(f"no backend {name!r} is registered")
    inputs = kernel.make_inputs(device, dtype)
    go = None
    times = []
    with torch.inference_mode(False), torch.enable_grad():
        for _ in range(repeats + 1):  # the first call warms up (and compiles)
            t0 = time.perf_counter()
            leaves = [x.detach().clone().requires_grad_() for x in inputs]
            out = kernel.run(name, leaves)
            go = torch.ones_like(out) if go is None else go
            out.backward(go)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2] if repeats else times[0]


def results() -> list[CheckResult]:
    """Every self-check verdict of this process."""
    return list(_RESULTS.values())
