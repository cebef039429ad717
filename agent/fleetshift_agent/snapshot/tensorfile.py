"""The safetensors format, written by streaming and read with a distrustful parser.

``safetensors.torch.save_file`` builds the whole file in memory before writing it, which
would double the memory of a worker being snapshotted. The format is simple (8-byte header
length, JSON header, raw little-endian tensor bytes), so we write it ourselves, one tensor at a
time straight from the tensor's memory. Files stay standard safetensors: ``safe_open`` reads
them.

Reading never hands bytes to a deserialiser that can run code: the header is JSON, checked
field by field (dtype known, shape sane, offsets in range, contiguous, non-overlapping)
before a single tensor is built, and tensors are views of the already verified buffer. A
pickle or a torch zip archive renamed ``.safetensors`` is recognised and refused.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

MAX_HEADER = 100 << 20  # the limit safetensors itself applies
DEVICE_CHUNK = 64 << 20  # bytes copied from an accelerator to the host at a time

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}


class TensorFileError(Exception):
    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data section
    end: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[Entry]]:
    """Header bytes (length prefix included) and the order tensors must be written in.

    Larger element types go first, so that every tensor starts at an offset aligned to its
    element size and can later be viewed in place without a copy.
    """
    if sys.byteorder != "little":
        raise TensorFileError("safetensors is little-endian; big-endian hosts are unsupported")
    order = sorted(tensors, key=lambda n: (-_itemsize(tensors[n].dtype), n))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    entries: list[Entry] = []
    offset = 0
    for name in order:
        t = tensors[name]
        if name == "__metadata__":
            raise TensorFileError("a tensor may not be named '__metadata__' (reserved)")
        if t.dtype not in DTYPES:
            raise TensorFileError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        nbytes = t.numel() * _itemsize(t.dtype)
        shape = tuple(t.shape)
        entries.append(Entry(name, t.dtype, shape, offset, offset + nbytes))
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, entries


def tensor_bytes(t: torch.Tensor, chunk: int = DEVICE_CHUNK) -> Iterator[memoryview]:
    """The tensor's bytes as views of its own memory (a copy only if it is not contiguous).

    A tensor on an accelerator is brought over ``chunk`` bytes at a time, so snapshotting a
    GPU worker never needs host memory the size of its largest tensor (a KV pool can be most
    of the GPU's memory).
    """
    t = t.detach().contiguous()
    if t.numel() == 0:
        return
    flat = t.reshape(-1).view(torch.uint8)
    if t.device.type == "cpu":
        yield memoryview(flat.numpy())
        return
    for start in range(0, flat.numel(), chunk):
        yield memoryview(flat[start : start + chunk].to("cpu").numpy())


def _describe_foreign(prefix: bytes) -> str | None:
    if prefix.startswith(b"PK\x03\x04"):
        return "is a zip archive (torch.save/pickle format), not safetensors"
    # A header length of 640, 896, 1152 or 1408 bytes also starts 0x80 0x02-0x05; a real
    # safetensors header then opens its JSON at byte 8.
    if prefix[8:9] == b"{":
        return None
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "is a pickle stream, not safetensors"
    return None


def parse_header(head: bytes, file_size: int) -> tuple[int, list[Entry]]:
    """Validate a safetensors header; returns (data start, entries sorted by offset).

    ``head`` holds at least the first ``min(file_size, 8 + header length)`` bytes.
    """
    foreign = _describe_foreign(head[:9])
    if foreign:
        raise TensorFileError(f"{foreign}; refused without deserialising it")
    if file_size < 8:
        raise TensorFileError(f"too short for a safetensors file ({file_size} bytes)")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER or 8 + n > file_size:
        raise TensorFileError(
            f"absurd header length {n} (file has {file_size} bytes, limit {MAX_HEADER})"
        )
    raw = head[8 : 8 + n]
    if not raw.startswith(b"{"):
        raise TensorFileError("header is not a JSON object")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TensorFileError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorFileError("header is not a JSON object")
    entries = [_entry(name, spec) for name, spec in header.items() if name != "__metadata__"]
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TensorFileError("__metadata__ must map strings to strings")
    _check_layout(entries, file_size - 8 - n)
    return 8 + n, entries


def _entry(name: str, spec: object) -> Entry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise TensorFileError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
    dtype = BY_NAME.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise TensorFileError(f"tensor {name!r}: unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise TensorFileError(f"tensor {name!r}: shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise TensorFileError(f"tensor {name!r}: data_offsets must be two non-negative integers")
    begin, end = offsets
    expected = math.prod(shape) * _itemsize(dtype)
    if end < begin or end - begin != expected:
        raise TensorFileError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold the {expected} bytes "
            f"its shape {shape} and dtype need"
        )
    return Entry(name, dtype, tuple(shape), begin, end)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_layout(entries: list[Entry], data_len: int) -> None:
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.begin < cursor:
            raise TensorFileError(f"tensor {e.name!r}: data overlaps the previous tensor")
        if e.begin > cursor:
            raise TensorFileError(f"tensor {e.name!r}: gap of {e.begin - cursor} bytes before it")
        if e.end > data_len:
            raise TensorFileError(
                f"tensor {e.name!r}: data_offsets end {e.end} beyond the {data_len} data bytes"
            )
        cursor = e.end
    if cursor != data_len:
        raise TensorFileError(f"{data_len - cursor} trailing bytes after the last tensor")


def build_tensors(
    buffer: np.ndarray, data_start: int, entries: list[Entry], device: str
) -> dict[str, torch.Tensor]:
    """Tensors over the verified buffer: views where aligned, one copy per tensor otherwise."""
    raw = torch.from_numpy(buffer)
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        piece = raw[data_start + e.begin : data_start + e.end]
        size = _itemsize(e.dtype)
        if (raw.data_ptr() + data_start + e.begin) % size:
            piece = piece.clone()
        t = piece.view(e.dtype).reshape(e.shape)
        out[e.name] = t if device == "cpu" else t.to(device)
    return out
