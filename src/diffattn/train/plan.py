"""A memory and FLOP planner for a training run: parameters by component, FLOPs per token (the attention term
included), and the memory each device needs under DDP and FSDP2, with the largest micro-batch that fits.

Nothing is allocated. Parameters are counted on a meta-device model. Activations are counted by autograd
itself: the model's forward and loss run on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and
dtypes, no data) at the planned shape, and every tensor autograd saves for the backward is recorded, with the
block it belongs to. That is exact for the ops that ran, which are the CPU kernels (SDPA's fused attention:
q, k, v, the output and the log-sum-exp); CUDA's fused SDPA kernels save the same set, while the fused Triton V1
kernel saves one more output-sized tensor per DIFF block (``O2``), which is not counted.

The step's peak is then followed block by block through the backward, where gradients appear while saved
activations are released (see :func:`step_peak`). The per-device terms:

- weights fp32 (4 B/param), gradients fp32 (4), AdamW's two moments (8); DDP also keeps its gradient buckets
  (4: ``gradient_as_bucket_view`` is off); FSDP2 shards all of these by the world size and adds the
  unsharded parameters of the root (embedding, final norm, head) and of two blocks (the one running and the
  one prefetched), and the unsharded gradients of one block before its reduce-scatter;
- activations: what autograd saves per block (with autocast, the half-precision weight copies the matmuls
  save are included: one copy of the matmul weights per device without activation checkpointing, even under
  FSDP2, which all-gathers fp32 parameters here); "full" checkpointing keeps each block's input and
  recomputes one block at a time; "selective" keeps its input and its matmul and attention outputs;
- the backward's working set of a block: its saved activations again (the gradients of its activations),
  and at the loss, the fp32 logits twice (their softmax and its gradient).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from diffattn.attention.registry import ATTENTION
from diffattn.configs.run_config import ConfigError, load_run_config, resolve_model_config
from diffattn.model.blocks import CHECKPOINTING, keeps_output
from diffattn.model.config import ModelConfig
from diffattn.model.parts import COMPONENTS, component_of
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import printable
from diffattn.train.loss import cross_entropy

GIB = 2**30


@dataclass
class Activations:
    """Bytes autograd keeps for one micro-batch: per block (none: everything saved; kept: the matmul and attention
    outputs selective checkpointing keeps; inputs: the block inputs full checkpointing keeps), outside the blocks
    (embedding, final norm, head, loss), and the fp32 logits (a transient of the loss's backward)."""

    saved: list[int]
    kept: list[int]
    inputs: list[int]
    head: int
    logits: int
    # the half-precision copies of each block's parameters that autocast makes (its cache holds them until the
    # forward and loss end, whatever the checkpointing), and the logits alive at the end of the forward
    casts: list[int] = field(default_factory=list)
    forward_logits: int = 0


class _Recorder(TorchDispatchMode):
    """Notes, per block, the bytes of the outputs of the ops selective checkpointing keeps, and of the copies of
    parameters that autocast casts (``params``: the parameters' storages)."""

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None
        self.kept: dict[int, dict[int, int]] = {}
        self.casts: dict[int, dict[int, int]] = {}
        self.params: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.block is None:
            return out
        if keeps_output(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    self.kept.setdefault(self.block, {})[st._cdata] = st.nbytes()
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.params:
            st = out.untyped_storage()
            self.casts.setdefault(self.block, {})[st._cdata] = st.nbytes()
        return out


def count_activations(cfg: ModelConfig, batch_size: int, seq_len: int, dtype: str = "float32") -> Activations:
    """Trace one training forward and loss of ``cfg`` at (batch_size, seq_len) on fake tensors and count what
    autograd saves (see the module docstring). ``dtype``: the autocast dtype ("float32": none). At most three
    blocks are traced (the first, one in the middle, the last: every block has the same shapes), so 10⁶ layers
    take as long as three."""
    n = cfg.n_layers
    acts = _trace(cfg.first_layers(min(n, 3)), batch_size, seq_len, dtype)
    if n > 3:  # the middle blocks save what the second one does
        acts.saved, acts.kept, acts.inputs, acts.casts = ([x[0]] + [x[1]] * (n - 2) + [x[2]]
                                                          for x in (acts.saved, acts.kept, acts.inputs, acts.casts))
    return acts


def _trace(cfg: ModelConfig, batch_size: int, seq_len: int, dtype: str) -> Activations:
    rec = _Recorder()
    saved: dict[int, tuple[int | None, int]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = TransformerLM(cfg)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        rec.params = params
        inputs: list[int] = []

        def enter(i):
            def hook(module, args):
                rec.block = i
                inputs.append(args[0].numel() * args[0].element_size())
            return hook

        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(enter(i))
            b.register_forward_hook(lambda *_: setattr(rec, "block", None))

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params and st._cdata not in saved:
                saved[st._cdata] = (rec.block, st.nbytes())
            return t

        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        amp = torch.autocast("cpu", dtype=getattr(torch, dtype)) if dtype != "float32" else _Null()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec, amp:
            cross_entropy(model(ids), ids)
    n = cfg.n_layers
    per = [sum(b for blk, b in saved.values() if blk == i) for i in range(n)]
    kept = [sum(v for k, v in rec.kept.get(i, {}).items() if k in saved) for i in range(n)]
    casts = [sum(rec.casts.get(i, {}).values()) for i in range(n)]
    logits = batch_size * seq_len * cfg.vocab_size * 4
    # at the end of the forward the head's own output (half precision under autocast) is alive beside its fp32
    # copy that the loss makes
    half = logits // 2 if dtype != "float32" else 0
    return Activations(per, kept, inputs[:n], sum(b for blk, b in saved.values() if blk is None), logits,
                       casts, logits + half)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# ------------------------------------------------------------------------------------------------- params


def count_params(cfg: ModelConfig) -> dict[str, Any]:
    """Parameters by component (tied weights once), the largest block's and the root's (outside the blocks).
    Counted on a one-block model on the meta device, the block's counts times the depth: every block has the
    same shapes, so 10⁶ layers cost one block."""
    n = cfg.n_layers
    with torch.device("meta"):
        model = TransformerLM(cfg.first_layers(1))
    times = {id(p): n for p in model.blocks[0].parameters()}
    counts: dict[str, Any] = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        counts[component_of(name)] += p.numel() * times.get(id(p), 1)
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    counts["block"] = sum(p.numel() for p in model.blocks[0].parameters())
    counts["root"] = counts["total"] - n * counts["block"]
    counts["matmul"] = sum(m.weight.numel() * times.get(id(m.weight), 1) for m in model.modules()
                           if isinstance(m, nn.Linear))
    counts["largest"] = max(p.numel() for p in model.parameters())
    return counts


def flops_per_token(cfg: ModelConfig, seq_len: int, counts: dict[str, Any] | None = None) -> dict[str, float]:
    """Training FLOPs per token: matmuls 6 × (weights of every linear layer, the head included) and attention
    3 × the forward's QKᵀ and P·V (2 FLOPs per multiply-add) over the causal half of the context. ``model`` is
    forward + backward; checkpointing "full" adds one forward (``recompute``)."""
    counts = counts or count_params(cfg)
    context = (seq_len + 1) / 2 if cfg.causal else seq_len
    # each attention type declares its core's cost in its own file (AttentionBase.core_flops_per_token)
    attn_fwd = ATTENTION[cfg.attention].core_flops_per_token(cfg, context) * cfg.n_layers
    matmul_fwd = 2 * counts["matmul"]
    return {"matmul": 3 * matmul_fwd, "attention": 3 * attn_fwd, "model": 3 * (matmul_fwd + attn_fwd),
            "recompute": matmul_fwd + attn_fwd}


# ------------------------------------------------------------------------------------------------- memory


@dataclass
class Memory:
    """Bytes per device for one parallel layout."""

    parallel: str
    weights: float
    grads: float
    optimizer: float
    buffers: float  # DDP's gradient buckets; FSDP2's unsharded parameters and gradients in flight
    activations: float  # kept at the end of the forward
    peak: float  # the step's peak (see step_peak)
    blocks: list[float] = field(default_factory=list)  # activations kept per block

    @property
    def state(self) -> float:
        return self.weights + self.optimizer


# The gradients of a block's activations during its backward, as a multiple of what the block saves (checked
# against measured peaks by benchmarks/bench_memory.py)
WORK = 1.0


def step_peak(acts: Activations, mode: str, block_grads: float, root_grads: float, fixed: float) -> float:
    """The peak of one training step, followed through the backward: at the loss, everything kept, the head's
    activations, the fp32 logits twice (softmax and its gradient) and the root's gradients; then, while block
    i runs its backward, the blocks before it keep what ``mode`` keeps, block i holds its whole saved set
    (recomputed under checkpointing) and ``WORK`` times as much in activation gradients, and the gradients of
    the blocks after it exist. ``fixed``: weights, optimizer state and buffers, there throughout."""
    scaled, grads = _peak_terms(acts, mode, block_grads, root_grads)
    return fixed + float((scaled + grads).max())


def _peak_terms(acts: Activations, mode: str, block_grads: float, root_grads: float) -> tuple[Any, Any]:
    """The candidates for :func:`step_peak` (at the end of the forward, at the loss's backward, then during each
    block's backward) split into what grows with the micro-batch (activations) and what does not (gradients,
    autocast's parameter copies): the peak at b times ``acts``' micro-batch is max(b · scaled + grads).
    Vectorized: 10⁶ blocks take milliseconds.

    The end of the forward: under checkpointing autograd saves no parameter copy, yet autocast's cache holds the
    half-precision copy of every block's parameters until the forward and loss leave autocast (the backward runs
    outside it; each block's recompute re-enters autocast and empties the cache as it leaves) — without
    checkpointing those copies are among the saved tensors already. The logits then: the head's output and the
    loss's fp32 copy."""
    keep = np.asarray(_kept(acts, mode), dtype=np.float64)
    saved = np.asarray(acts.saved, dtype=np.float64)
    n = len(keep)
    before = np.concatenate(([0.0], np.cumsum(keep)[:-1]))  # sum(keep[:i])
    cache = float(sum(acts.casts)) if mode != "none" else 0.0
    scaled = np.concatenate(([keep.sum() + acts.head + acts.forward_logits, keep.sum() + acts.head + 2 * acts.logits],
                             before + (1 + WORK) * saved))
    grads = np.concatenate(([cache, root_grads], (n - 1 - np.arange(n)) * block_grads + root_grads))
    return scaled, grads


def _temp(counts: dict[str, Any], fused: bool) -> float:
    """A non-fused AdamW (CPU) makes a temporary the size of the parameter it updates, two at a time."""
    return 0.0 if fused else 2 * 4 * counts["largest"]


def _kept(acts: Activations, mode: str) -> list[int]:
    if mode == "full":
        return list(acts.inputs)
    if mode == "selective":
        return [k + x for k, x in zip(acts.kept, acts.inputs)]
    return list(acts.saved)


def memory(cfg: ModelConfig, acts: Activations, counts: dict[str, Any], *, world: int, mode: str,
           parallel: str, fused_optimizer: bool = True) -> Memory:
    """Per-device memory of one layout (see the module docstring for the terms)."""
    p, blk, root = counts["total"], counts["block"], counts["root"]
    shard = world if parallel == "fsdp" else 1
    weights, grads, optimizer = 4 * p / shard, 4 * p / shard, 8 * p / shard
    if parallel == "ddp":
        buffers = 4 * p if world > 1 else 0.0
    else:
        buffers = (4 * root + 2 * 4 * blk + 4 * blk) if world > 1 else 0.0
    temp = _temp(counts, fused_optimizer)
    block_grads, root_grads = 4 * blk / shard, 4 * root / shard
    fixed = weights + optimizer + buffers
    peak = step_peak(acts, mode, block_grads, root_grads, fixed)
    peak = max(peak, fixed + grads + temp)  # the optimizer step: every gradient at once
    keep = _kept(acts, mode)
    return Memory(parallel, weights, grads, optimizer, buffers, float(sum(keep) + acts.head), peak,
                  [float(k) for k in keep])


@dataclass
class Plan:
    config: ModelConfig
    batch_size: int
    seq_len: int
    world: int
    mode: str
    dtype: str
    counts: dict[str, Any]
    flops: dict[str, float]
    layouts: dict[str, Memory]
    budget: float | None  # bytes per device
    max_batch: dict[str, int | None]

    def fits(self, parallel: str) -> bool | None:
        return None if self.budget is None else self.layouts[parallel].peak <= self.budget

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return d


def plan(cfg: ModelConfig, *, batch_size: int, seq_len: int, world: int = 1, gpu_memory_gb: float | None = None,
         activation_checkpointing: str = "none", dtype: str = "bfloat16", fused_optimizer: bool = True) -> Plan:
    """Plan a training step of ``cfg`` at micro-batch ``batch_size`` × ``seq_len`` on ``world`` devices of
    ``gpu_memory_gb`` each (see the module docstring). ``fused_optimizer``: AdamW's fused kernel (CUDA) makes
    no temporaries; off (CPU) it makes two the size of the largest parameter."""
    if seq_len > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=seq_len)
    counts = count_params(cfg)
    flops = flops_per_token(cfg, seq_len, counts)
    acts = count_activations(cfg, batch_size, seq_len, dtype)
    layouts = {par: memory(cfg, acts, counts, world=world, mode=activation_checkpointing, parallel=par,
                           fused_optimizer=fused_optimizer) for par in ("ddp", "fsdp")}
    budget = gpu_memory_gb * GIB if gpu_memory_gb else None
    max_batch: dict[str, int | None] = {}
    if budget is not None:
        one = count_activations(cfg, 1, seq_len, dtype)
        for par in layouts:
            max_batch[par] = _largest_batch(cfg, one, counts, world, activation_checkpointing, par, budget,
                                            fused_optimizer)
    return Plan(cfg, batch_size, seq_len, world, activation_checkpointing, dtype, counts, flops, layouts, budget,
                max_batch)


def _largest_batch(cfg, one: Activations, counts, world, mode, parallel, budget, fused) -> int:
    """The largest micro-batch whose planned peak fits ``budget`` (0: not even one sequence)."""
    m = memory(cfg, one, counts, world=world, mode=mode, parallel=parallel, fused_optimizer=fused)
    shard = world if parallel == "fsdp" else 1
    scaled, grads = _peak_terms(one, mode, 4 * counts["block"] / shard, 4 * counts["root"] / shard)
    fixed = m.weights + m.optimizer + m.buffers
    optimizer_step = fixed + m.grads + _temp(counts, fused)

    def fits(b: int) -> bool:  # memory() at micro-batch b, without rebuilding its per-block lists
        return max(fixed + float((b * scaled + grads).max()), optimizer_step) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def gib(x: float) -> str:
    return f"{x / GIB:.2f}" if x < 100 * GIB else f"{x / GIB:.0f}"


def humanize(n: float) -> str:
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.{3 if n / k < 10 else 1}f}{unit}".replace(".0" + unit, unit)
    return str(int(n))


# Beyond these a plan answers nothing a machine could use (torch.distributed counts ranks in 32 bits)
LIMITS = {"gpus": 2**20, "gpu_memory_gb": 2**20, "seq_len": 2**40, "batch_size": 2**40, "vocab_size": 2**40}


def plan_from_config(config: str, *, seq_len: int | None = None, batch_size: int | None = None, gpus: int = 1,
                     gpu_memory_gb: float | None = None, activation_checkpointing: str | None = None,
                     dtype: str | None = None, vocab_size: int | None = None) -> Plan:
    """:func:`plan` for a run config (a TOML file or a packaged name) with ``diffattn plan``'s overrides (None:
    the config's; the vocabulary: the config's, else 32000). Raises ConfigError (one line) for a bad value or a
    model too large to plan on any machine."""
    given = {"seq_len": seq_len, "batch_size": batch_size, "gpus": gpus, "gpu_memory_gb": gpu_memory_gb,
             "vocab_size": vocab_size}
    for name, v in given.items():
        if v is not None and not (math.isfinite(v) and 0 < v <= LIMITS[name]):
            raise ConfigError(f"--{name.replace('_', '-')} must be positive and finite (at most {LIMITS[name]:,}), "
                              f"got {v}")
    if activation_checkpointing is not None and activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing must be one of {', '.join(CHECKPOINTING)}, got "
                          f"{activation_checkpointing!r}")
    overrides = [f"--train.seq_len={seq_len}"] if seq_len else []
    cfg = load_run_config(config, overrides + ([f"--model.vocab_size={vocab_size}"] if vocab_size is not None else []))
    t, seq = cfg.train, cfg.train.seq_len
    mcfg = resolve_model_config(cfg, None if "vocab_size" in cfg.model_given else 32000)
    mcfg = mcfg.replace(max_seq_len=max(mcfg.max_seq_len, seq))
    try:
        return plan(mcfg, batch_size=batch_size or t.batch_size, seq_len=seq, world=gpus,
                    gpu_memory_gb=gpu_memory_gb, activation_checkpointing=activation_checkpointing
                    or t.activation_checkpointing, dtype=dtype or t.dtype)
    except (RuntimeError, OverflowError) as e:  # a tensor whose element count overflows 64 bits
        raise ConfigError(f"{config}: the model is too large to plan on any machine "
                          f"({printable(str(e).splitlines()[0])})") from None


def format_plan(p: Plan, name: str) -> str:
    """The plan as ``diffattn plan`` prints it: parameters by component, FLOPs per token, memory per device."""
    c = p.config
    lines = [f"{name}: {c.attention}, d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, vocab "
             f"{c.vocab_size}; micro-batch {p.batch_size} × {p.seq_len} tokens, {p.world} device(s), "
             f"{p.dtype}, activation checkpointing {p.mode}", "", "parameters:"]
    for comp in COMPONENTS:
        if p.counts[comp]:
            lines.append(f"  {comp:<12} {p.counts[comp]:>15,}")
    lines.append(f"  {'total':<12} {p.counts['total']:>15,}")
    f = p.flops
    lines += ["", "FLOPs per token (training: forward + backward):",
              f"  matmuls {humanize(f['matmul'])}, attention {humanize(f['attention'])} "
              f"({100 * f['attention'] / f['model']:.1f}%), total {humanize(f['model'])}"
              + (f"; + {humanize(f['recompute'])} recomputed under full checkpointing" if p.mode == "full" else ""),
              "", "memory per device (GiB):",
              f"  {'':<6} {'weights':>8} {'grads':>8} {'AdamW':>8} {'buffers':>8} {'activ.':>8} {'peak':>8}"
              + ("  fits  max micro-batch" if p.budget else "")]
    for par, m in p.layouts.items():
        row = (f"  {par:<6} {gib(m.weights):>8} {gib(m.grads):>8} {gib(m.optimizer):>8} {gib(m.buffers):>8} "
               f"{gib(m.activations):>8} {gib(m.peak):>8}")
        if p.budget:
            row += f"  {'yes' if p.fits(par) else 'no':<5} {p.max_batch[par]}"
        lines.append(row)
    per, outside = p.layouts["ddp"].blocks, p.layouts["ddp"].activations - sum(p.layouts["ddp"].blocks)
    lines.append(f"  activations kept: {gib(per[0])} GiB per block × {len(per)} blocks + {gib(outside)} outside them")
    if p.budget:
        lines.append(f"  budget {p.budget / GIB:g} GiB per device")
    return "\n".join(lines)
