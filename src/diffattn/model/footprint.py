"""What a model needs in memory, counted before anything is allocated, and whether this machine has it.

A config from elsewhere (a checkpoint, a ``config.json``, a TOML) may ask for 10¹² positions, 10⁹ tokens of
vocabulary or 10⁶ layers. Every loader asks :func:`check_fits` before it builds or reads a model, and a model that
cannot fit is refused in one line (:class:`ModelTooLarge`, a ValueError: exit 2) naming its size, what it needs
and what the machine has, within milliseconds: the count builds one block on the meta device (shapes, no memory)
and multiplies by the depth, since every block has the same shapes.

Counted, in bytes: the weights in fp32 (``copies`` of them: a loader holds the file's tensors and the model's at
once), training's gradients and AdamW moments (``training``: 16 bytes per parameter), the RoPE tables and their
float64 construction (``max_seq_len`` × the rotated width), each block's buffers, a KV cache (``kv_batch``
sequences of ``max_seq_len``), and the Python objects of the modules themselves (:data:`MODULE_BYTES` each).
Building costs time per module too, whatever the tensors' size: a model of more than :data:`MAX_MODULES`
modules (10⁶ layers of d_model 2: 13 million) is refused, whatever the memory. Activations are left out: they
depend on the batch, which ``diffattn plan`` counts. The machine has: on CUDA the device's free memory; otherwise
the available RAM (``MemAvailable`` of /proc/meminfo, or sysconf), less a cgroup's limit where one is set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from diffattn.model.blocks import Block
from diffattn.model.config import ModelConfig
from diffattn.system.atomic_files import Refused

_UNITS = (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


class ModelTooLarge(Refused):
    """A model needs more memory than this machine has (one-line message: its size, the need, the machine)."""


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: 32 TB, 1.5 GB; beyond exabytes in powers of ten."""
    if n >= 1e21:
        return f"{n:.1e} bytes"
    for unit, k in _UNITS:
        if n >= k:
            v = n / k
            return f"{v:.{0 if v >= 100 else 1}f} {unit}".replace(".0 ", " ")
    return f"{int(n)} bytes"


@dataclass
class Footprint:
    """The parts of a model's memory (bytes); ``params`` counts parameters (a tied weight once)."""

    params: int
    weights: int  # the parameters in fp32
    rope: int  # RoPE tables kept, and the float64 temporaries that build them
    buffers: int  # the blocks' own buffers (λ scales, ALiBi slopes)
    kv_cache: int = 0
    modules: int = 0  # nn.Modules built (each a few kB of Python objects, and tens of µs to build)


# The deepest published transformers have about a thousand layers (DeepNet, 1,000 layers: 13,000 modules here).
# Building 200,000 modules takes about 13 s and 2 GB of Python objects on a busy 2-core machine (65 µs and about
# 9 kB each, measured on the meta device); 10⁶ layers would take 15 minutes and 115 GB before any weight is read.
MAX_MODULES = 200_000
MODULE_BYTES = 10_000


def _block_counts(cfg: ModelConfig, kv_batch: int) -> tuple[int, int, int, int, int]:
    """(parameters, buffer bytes, KV-cache bytes, rotated width, modules) of one block, built on the meta
    device."""
    with torch.device("meta"):
        block = Block(cfg, 0)
        if kv_batch:
            block.attn.setup_cache(kv_batch, cfg.max_seq_len, torch.float32, "meta")
    params = sum(p.numel() for p in block.parameters())
    buffers = sum(b.numel() * b.element_size() for n, b in block.named_buffers() if ".cache." not in f".{n}")
    cache = block.attn.cache
    kv = sum(b.numel() * b.element_size() for b in cache.buffers()) if cache is not None else 0
    return params, buffers, kv, int(getattr(block.attn, "rope_dim", 0) or 0), sum(1 for _ in block.modules())


def footprint(cfg: ModelConfig, *, num_classes: int = 0, kv_batch: int = 0) -> Footprint:
    """What building ``cfg`` holds in memory (a classifier's head of ``num_classes`` included; a KV cache of
    ``kv_batch`` sequences when asked). Raises ModelTooLarge when a tensor's size does not even fit in 64 bits."""
    try:
        block, buffers, kv, rope_dim, modules = _block_counts(cfg, kv_batch)
    except (RuntimeError, OverflowError) as e:  # a shape whose element count overflows int64
        raise ModelTooLarge(f"{_shape(cfg)} is too large to build on any machine ({str(e).splitlines()[0]})") \
            from None
    d, v = cfg.d_model, cfg.vocab_size
    head = 0 if cfg.tie_embeddings or not cfg.causal else v * d
    params = v * d + cfg.n_layers * block + d + head + (num_classes * (d + 1) if num_classes else 0)
    tables = 2 if cfg.has_local_rope else 1  # Gemma 3: the local layers' table and the global one
    rope = tables * cfg.max_seq_len * (rope_dim // 2) * (2 * 4 + 3 * 8) if cfg.rope != "none" else 0
    # the model, its body, embedding, dropout, block list, final norm, head, RoPE (a classifier: its encoder too)
    top = 7 + (cfg.rope != "none") + (1 if num_classes else 0)
    return Footprint(params, 4 * params, rope, cfg.n_layers * buffers, cfg.n_layers * kv,
                     cfg.n_layers * modules + top)


def _shape(cfg: ModelConfig) -> str:
    return (f"the model ({cfg.n_layers:,} layers, d_model {cfg.d_model:,}, vocab_size {cfg.vocab_size:,}, "
            f"max_seq_len {cfg.max_seq_len:,})")


def _cgroup_room() -> int | None:
    """What a cgroup (v2) memory limit leaves this process, or None without one."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" or not limit.isdigit() else max(0, int(limit) - used)


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this machine can give a new allocation on ``device`` now; None when it cannot tell."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0]) if torch.cuda.is_available() else None
    if dev.type != "cpu":
        return None
    have = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        try:
            have = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    room = _cgroup_room()
    return room if have is None else have if room is None else min(have, room)


def check_fits(cfg: ModelConfig, what: str, *, copies: int = 1, training: bool = False, kv_batch: int = 0,
               num_classes: int = 0, rope: bool = True, shards: int = 1,
               device: str | torch.device = "cpu") -> Footprint:
    """Refuse (:class:`ModelTooLarge`, one line starting with ``what``) a model that cannot fit: ``copies`` of
    its fp32 weights (+ gradients and AdamW moments when ``training``, divided over ``shards`` devices), its
    RoPE tables (``rope``) and buffers, and a KV cache of ``kv_batch`` sequences, against
    :func:`available_memory` on ``device``, and (when it builds the model: ``copies`` or ``training``) a model of
    more than :data:`MAX_MODULES` modules. -> the footprint."""
    try:
        fp = footprint(cfg, num_classes=num_classes, kv_batch=kv_batch)
    except ModelTooLarge as e:
        raise ModelTooLarge(f"{what}: {e}") from None
    builds = bool(copies or training)
    weights = fp.weights * (copies + (3 if training else 0)) // max(1, shards if training else 1)
    tensors = weights + (fp.rope + fp.buffers if rope else 0) + fp.kv_cache
    objects = fp.modules * MODULE_BYTES if builds else 0
    have = available_memory(device)
    if builds and fp.modules > MAX_MODULES and (have is None or tensors <= have):
        per_layer = max(1, (fp.modules - 8) // cfg.n_layers)
        raise ModelTooLarge(f"{what}: {_shape(cfg)} has {fp.modules:,} modules to build; diffattn builds at most "
                            f"{MAX_MODULES:,} (about {MAX_MODULES // per_layer:,} layers of this kind): more takes "
                            "minutes and gigabytes of Python objects before any weight is read")
    if have is not None and tensors + objects > have:
        parts = [f"{fp.params:,} parameters"] if copies or training else []
        if rope and fp.rope:
            parts.append(f"RoPE tables for {cfg.max_seq_len:,} positions {human_bytes(fp.rope)}")
        if fp.kv_cache:
            parts.append(f"a KV cache for {kv_batch} × {cfg.max_seq_len:,} tokens {human_bytes(fp.kv_cache)}")
        if objects:
            parts.append(f"{fp.modules:,} modules' Python objects {human_bytes(objects)}")
        dev = torch.device(device)
        where = "this machine has" if dev.type == "cpu" else f"{dev} has"
        raise ModelTooLarge(f"{what}: {_shape(cfg)} needs {human_bytes(tensors + objects)} of memory "
                            f"({'; '.join(parts)}); {where} {human_bytes(have)} available")
    return fp
