"""Tensors as self-describing, checksummed bytes, for the disk tier and the shared vision cache.

    b"WCT1" | sha256 digest (32 bytes) | header length (uint32 LE) | header JSON | payload

The header holds dtype, shape, byte order and an optional `meta` dict (e.g. the entry's key);
the payload is the tensor's raw bytes in C order. The digest covers everything after itself, so
a torn or flipped file fails `decode`. Never pickle: decoding only builds a tensor from numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"WCT1"
_DIGEST = 32  # sha256: hardware-accelerated on current x86 and ARM, faster than blake2b there
_PREFIX = len(MAGIC) + _DIGEST + 4
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32")
    + ("int16", "int8", "uint8", "bool")
    if hasattr(torch, name)
}


class CorruptBlob(ValueError):
    """The bytes are not a whole, intact encoded tensor."""


@dataclass(frozen=True)
class Decoded:
    tensor: torch.Tensor
    meta: dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be encoded")
    return name


def encode(tensor: torch.Tensor, meta: dict[str, Any] | None = None) -> bytes:
    """The blob for `tensor` (copied to the CPU first when it lives elsewhere: that syncs)."""
    header = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "byteorder": sys.byteorder}
    if meta:
        header["meta"] = meta
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [struct.pack("<I", len(head)), head, raw_bytes(tensor)]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return b"".join([MAGIC, digest.digest(), *parts])


def decode(blob: bytes | bytearray | memoryview) -> Decoded:
    """Inverse of `encode`; raises CorruptBlob for anything that is not an intact blob."""
    view = memoryview(blob)
    if len(view) < _PREFIX or bytes(view[:4]) != MAGIC:
        raise CorruptBlob("bad magic or truncated prefix")
    if hashlib.sha256(view[4 + _DIGEST :]).digest() != bytes(view[4 : 4 + _DIGEST]):
        raise CorruptBlob("checksum mismatch")
    (head_len,) = struct.unpack_from("<I", view, 4 + _DIGEST)
    header = _parse_header(bytes(view[_PREFIX : _PREFIX + head_len]))
    dtype, shape = DTYPES[header["dtype"]], tuple(header["shape"])
    payload = view[_PREFIX + head_len :]
    if len(payload) != math.prod(shape) * dtype.itemsize:
        raise CorruptBlob(f"payload is {len(payload)} bytes, expected {math.prod(shape) * dtype.itemsize}")
    return Decoded(from_raw_bytes(payload, dtype, shape), header.get("meta", {}))


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, as a view of a CPU copy (or of the tensor itself)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def from_raw_bytes(payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # a private, writable copy
    return flat.view(dtype).reshape(shape)


def _parse_header(head: bytes) -> dict[str, Any]:
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptBlob(f"bad header: {e}") from e
    if not isinstance(header, dict) or header.get("dtype") not in DTYPES:
        raise CorruptBlob(f"bad header: {header!r:.200}")
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptBlob(f"bad shape {shape!r}")
    if header.get("byteorder") != sys.byteorder:
        raise CorruptBlob(f"written on a {header.get('byteorder')}-endian host")
    return header
