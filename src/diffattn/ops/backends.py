"""Which kernel ``backend="auto"`` runs for each attention type, and the self-check that earns a fast kernel
that place.

A *kernel family* is a fast kernel next to a safe path, registered (:func:`register`) by the attention variant
file that owns the op, with the small case its self-check runs (``make_inputs``) and the names of what it
compares (``grad_names``). Today:

* ``diff`` (V1): the fused Triton kernel (``"triton"``) or the padded SDPA call (``"sdpa"``);
* ``distance``: FlexAttention (``"flex"``) or the block loop (``"block"``).

Each attention type declares (:func:`declare_attention`, called by the attention registry's ``@register``) the
family whose choice it follows, or the one op it always runs (``standard``, ``diff_v2``: ``"sdpa"``), so
:func:`describe` and ``diffattn doctor`` list every registered variant without a list here.

On a device type in :data:`CHECK_DEVICE_TYPES` (CUDA), the first time ``auto`` would pick a fast kernel for a
(device, dtype), :func:`self_check` runs a small forward + backward on it and on the safe path against the
float64 safe path, within the tolerances the tests use. The verdict is kept for the process. A failure warns
once, naming the kernel and the error, and ``auto`` takes the safe path from then on. Everywhere else ``auto``
takes the safe path without a check. A kernel registered ``opt_in`` (with the reason: V1's Triton kernel and
FlexAttention's DA, each slower than its safe path on an H200) is never ``auto``'s pick; it runs when named.

``DIFFATTN_BACKEND=auto|sdpa|triton|flex|block`` overrides ``auto`` (no self-check) for the family the named
backend belongs to; the other family keeps ``auto``. A forced fast kernel that cannot run here at all (not
installed, wrong device) is a :class:`BackendError` (a ValueError); a call it cannot take (a float mask,
tensor offsets) still goes to the safe path, as under ``auto``.

Under torch.compile the choice is a constant: traced code only reads the cache (:func:`choose`), never runs a
check; with no verdict cached yet it takes the safe path. :func:`describe` (called eagerly, e.g. at the start
of training) runs the checks first so a compiled model sees them.

The kernels and the attention types register themselves from their attention variants
(:mod:`diffattn.attention.diff`, :mod:`diffattn.attention.distance`, the registry's ``@register``): this module
imports nothing of the package, at import time or later (the dependency points from the variants to the ops),
so what it lists is what the attention package has registered by the time it is asked (a model built, the
registry imported).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffattn.untrusted import Refused

ENV_VAR = "DIFFATTN_BACKEND"
CHOICES = ("auto", "sdpa", "triton", "flex", "block")
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
_FAMILIES: dict[str, Kernel] = {}
_RESULTS: dict[tuple[str, str, torch.dtype], CheckResult] = {}
# attention type -> (kernel family it follows or None, the op it runs when it has no family)
_TYPES: dict[str, tuple[str | None, str]] = {}


def register(kernel: Kernel) -> None:
    """Make ``kernel`` the fast kernel of its family (its attention variant's module does this at import)."""
    if len(kernel.grad_names) < 2:
        raise ValueError(f"kernel {kernel.name!r}: grad_names must name the output and each input's gradient")
    _KERNELS[kernel.name] = kernel
    _FAMILIES[kernel.family] = kernel


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
    """The small case of ``family``'s self-check (its kernel's ``make_inputs``)."""
    if family not in _FAMILIES:
        raise ValueError(f"no kernel family {family!r}; registered: {sorted(_FAMILIES)}")
    return _FAMILIES[family].make_inputs(torch.device(device), dtype)


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
def _pick(family: str, device: torch.device, dtype: torch.dtype, *, run_checks: bool) -> str:
    kernel = _FAMILIES.get(family)
    if kernel is None:
        raise ValueError(f"no kernel family {family!r} is registered (known: {sorted(_FAMILIES)})")
    forced = env_backend()
    if forced == kernel.safe:
        return forced
    if forced == kernel.name:
        why = kernel.available(device)
        if why is not None:
            raise BackendError(f"{ENV_VAR}={forced}: {why}")
        return forced
    if (device.type not in CHECK_DEVICE_TYPES or dtype not in CHECKED_DTYPES or kernel.opt_in
            or kernel.available(device)):
        return kernel.safe
    if run_checks:
        return kernel.name if self_check(kernel.name, device, dtype).ok else kernel.safe
    res = _RESULTS.get((kernel.name, str(device), dtype))
    return kernel.name if res is not None and res.ok else kernel.safe


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
    kernel = next(k for k in _KERNELS.values() if name in (k.name, k.safe))
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
