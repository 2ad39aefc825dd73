"""Host <-> device copies that never make the host wait for the device.

A synchronous copy (`.to(device)`) waits for everything queued on the stream, which would undo
an engine's running a step ahead; `non_blocking` from pageable memory depends on driver
staging. So small per-step inputs go through pinned memory (PyTorch's caching host allocator:
cheap after warm-up, and it keeps the buffer alive until the copy has read it).

Two helpers serve the KV cache's host tier, which moves gigabytes:

- `PinnedHostBuffer`: one page-aligned host allocation, page-locked once (cudaHostRegister).
  PyTorch's pinned allocator rounds every tensor up to a power of two (a 20 GiB pool pins 32 GiB)
  and keeps what is freed cached; this pins exactly what is asked and unpins it on `close`.
- `BatchCopier`: many pointer-to-pointer copies queued by one driver call (cuMemcpyBatchAsync,
  CUDA >= 12.8, found through cuda-python), so KV blocks move between host slots and their
  pages piece by piece with no device staging buffer and no scatter kernel.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)

BATCH_COPY_CUDA_VERSION = 12080  # the entry point's ABI (with the failIdx argument CUDA 13's _v2 dropped)
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order
CUDA_HOST_REGISTER_DEFAULT = 0


def upload(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a tensor, numpy array or list) on `device`, copied asynchronously on CUDA."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PinnedHostBuffer:
    """`num_bytes` of page-aligned, zero-filled host memory as a flat uint8 `tensor`; with
    `register`, page-locked for CUDA in one call. `close` (or collecting this object) unpins it;
    the memory itself lives as long as `tensor` or a view of it does."""

    def __init__(self, num_bytes: int, register: bool):
        memory = mmap.mmap(-1, num_bytes)  # anonymous: page-aligned, pages faulted in on first touch
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to lock and to translate
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)
        self.registered = register
        self._finalizer = None
        if register:
            _host_register(self.tensor.data_ptr(), num_bytes)
            self._finalizer = weakref.finalize(self, _host_unregister, self.tensor.data_ptr())
            self._finalizer.atexit = False  # the process's end unpins everything anyway

    def close(self) -> None:
        """Unpin (no copy may be reading or writing the buffer any more)."""
        if self._finalizer is not None:
            self._finalizer()


def _host_register(address: int, num_bytes: int) -> None:
    error = torch.cuda.cudart().cudaHostRegister(address, num_bytes, CUDA_HOST_REGISTER_DEFAULT)
    if getattr(error, "value", error) != 0:
        raise RuntimeError(f"page-locking {num_bytes} bytes of host memory failed ({error}): lower host_cache_bytes")


def _host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_COPY = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


class BatchCopier:
    """cuMemcpyBatchAsync: copies given as uint64 arrays of addresses and sizes, queued on a
    stream in one call. Its arrays are read during the call; numpy hands them over without a
    per-copy Python object (a list of 143k addresses cost ~50 ms to convert)."""

    def __init__(self, function):
        self._function = function
        self._attributes = _CopyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._first = (ctypes.c_size_t * 1)(0)  # the one attribute set applies from copy 0 on
        self._failed = ctypes.c_size_t(0)

    @classmethod
    def load(cls) -> BatchCopier | None:
        """The driver's batched copy, or None (no cuda-python, no driver, a driver before 12.8)."""
        try:
            from cuda.bindings import driver
        except ImportError:
            return None
        try:
            error, address, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", BATCH_COPY_CUDA_VERSION, 0)
        except RuntimeError as exc:  # cuda-python raises when it finds no driver library
            log.info("batched copies off: %s", exc)
            return None
        if error != driver.CUresult.CUDA_SUCCESS or not address:
            log.info("batched copies off: this driver has no cuMemcpyBatchAsync (%s)", error)
            return None
        return cls(_BATCH_COPY(address))

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
        """Queue srcs[i] -> dsts[i] (sizes[i] bytes) on `stream` (not the legacy default stream).
        The batch runs in stream order, its copies in any order among themselves: no two may
        write the same bytes."""
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        if not len(dsts) == len(srcs) == len(sizes):
            raise ValueError(f"{len(dsts)} destinations, {len(srcs)} sources, {len(sizes)} sizes")
        if not len(dsts):
            return
        result = self._function(
            dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts),
            ctypes.addressof(self._attributes), ctypes.addressof(self._first), 1,
            ctypes.addressof(self._failed), stream.cuda_stream,
        )  # fmt: skip
        if result != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed (CUresult {result}) at copy {self._failed.value}")

    def works(self, device: torch.device) -> bool:
        """A round trip of a few bytes host -> device -> host, checked (run once, at start)."""
        host = torch.arange(64, dtype=torch.uint8).pin_memory()
        back = torch.zeros(64, dtype=torch.uint8).pin_memory()
        on_device = torch.zeros(64, dtype=torch.uint8, device=device)
        torch.cuda.current_stream(device).synchronize()  # the zeros are written
        stream = torch.cuda.Stream(device)  # the batched copy refuses the legacy default stream
        halves = np.array([0, 32], dtype=np.uint64)
        self.copy(on_device.data_ptr() + halves, host.data_ptr() + halves[::-1], np.full(2, 32), stream)
        self.copy(back.data_ptr() + halves, on_device.data_ptr() + halves, np.full(2, 32), stream)
        stream.synchronize()
        return torch.equal(back, torch.cat([host[32:], host[:32]]))


def batch_copier(device: torch.device) -> BatchCopier | None:
    """A checked `BatchCopier` for `device`, or None (logged) where it cannot be had."""
    copier = BatchCopier.load()
    if copier is None:
        return None
    try:
        if copier.works(device):
            return copier
    except RuntimeError as exc:
        log.warning("batched copies off: %s", exc)
        return None
    log.warning("batched copies off: a test copy on %s returned wrong bytes", device)
    return None
