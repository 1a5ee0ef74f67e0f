"""Safetensors files written and read one tensor at a time, so a checkpoint of a large model costs little memory
beyond the model itself.

The ``safetensors`` package writes a file from a dict of tensors it first turns into bytes (a copy of
everything), and reads through a memory map whose touched pages stay resident in the process. Neither suits a
multi-GB training state, so this module writes the same format (an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}`` padded to 8 bytes, then each tensor's
bytes back to back) with each tensor's bytes handed straight to the file, and reads a tensor with one
``readinto`` into its destination. The files are ordinary safetensors files (the tests read them with
``safetensors.torch.load_file``), and a file is read by the ``safetensors`` library's rules: its own parser checks
the header (its size limit, a JSON object of tensor entries, offsets contiguous and in order, sizes that match the
shapes and the file) before this reader trusts any of it.

A tensor to write may be a DTensor (FSDP2): it is gathered (``full_tensor``, a collective) when its turn comes,
so only one full tensor exists at a time. Every rank must then iterate the same tensors (:func:`gathered`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from diffattn.system.atomic_files import names_path, printable
from diffattn.system.untrusted import Refused

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
BY_NAME = {v: k for k, v in DTYPES.items()}


class TensorFileError(Refused):
    """A safetensors file whose header is unreadable or does not describe its contents."""


def _full(t: Tensor) -> Tensor:
    """A plain, contiguous CPU copy-or-view of ``t`` (a DTensor is gathered: collective)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.to("cpu").contiguous()


def gathered(items: Sequence[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(name, full CPU tensor) one at a time; for DTensors every rank must iterate (the gathers are
    collectives), while only one writes."""
    for name, t in items:
        yield name, _full(t)


def write(path: Path, items: Sequence[tuple[str, Tensor]], metadata: dict[str, str] | None = None,
          tensors: Iterable[tuple[str, Tensor]] | None = None) -> str:
    """Write ``items`` (name, tensor) to a safetensors file at ``path``, one tensor at a time; returns the
    file's sha256 (computed while writing). The header comes from the tensors' (global) shapes and dtypes;
    the bytes from ``tensors`` (default: :func:`gathered` ``(items)``), which must yield the same names."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in items:
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot write {name!r}: dtype {t.dtype} has no safetensors name here")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with names_path(path), open(path, "wb") as f:  # a full disk's error names the file (exit 74, one line)
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for (name, t), (got, full) in zip(items, tensors if tensors is not None else gathered(items), strict=True):
            if got != name or full.shape != t.shape or full.dtype != t.dtype:
                raise ValueError(f"tensor stream out of order: expected {name!r}, got {got!r}")
            data = memoryview(full.reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
    return digest.hexdigest()


class Reader:
    """Reads tensors of a safetensors file by name, each with one ``readinto`` (no memory map)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")  # noqa: SIM115 (closed by close() / the context manager)
        try:
            self.entries, self.metadata, self._start = self._header()
        except BaseException:
            self._f.close()
            raise

    def _header(self) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict, int]:
        try:  # the library's own rules first: what it refuses (a 100 MB header, overlapping offsets) is refused here
            with safe_open(str(self.path), framework="pt"):
                pass
        except SafetensorError as e:
            raise TensorFileError(f"{self.path.name}: not a valid safetensors file ({printable(e)})") from None
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) != 8:
            raise TensorFileError(f"{self.path.name}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise TensorFileError(f"{self.path.name}: header length {n} exceeds the file")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TensorFileError(f"{self.path.name}: unreadable safetensors header: {e}") from e
        metadata = header.pop("__metadata__", None) or {}
        entries, data = {}, size - 8 - n
        for name, e in header.items():
            try:
                dtype, shape, (a, b) = BY_NAME[e["dtype"]], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise TensorFileError(f"{self.path.name}: bad header entry for {name!r}: {err}") from err
            numel = 1
            for s in shape:
                numel *= s
            if not 0 <= a <= b <= data or b - a != numel * torch.empty((), dtype=dtype).element_size():
                raise TensorFileError(f"{self.path.name}: {name!r} has offsets [{a}, {b}) that do not fit its "
                                      f"shape {list(shape)} and the file")
            entries[name] = (dtype, shape, a, b)
        return entries, metadata, 8 + n

    def read(self, name: str, out: Tensor | None = None) -> Tensor:
        """Tensor ``name``, read into ``out`` when given (a contiguous CPU tensor of its shape and dtype),
        else into a new tensor."""
        dtype, shape, a, b = self.entries[name]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"{name}: cannot read {dtype} {list(shape)} into {out.dtype} {list(out.shape)} "
                             f"on {out.device}")
        self._f.seek(self._start + a)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        got = self._f.readinto(view) if b > a else 0
        if got != b - a:
            raise TensorFileError(f"{self.path.name}: {name!r} is truncated")
        return out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
