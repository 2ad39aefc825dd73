"""Image content hash -> projected image embeddings ([image tokens, hidden], what the multimodal
projector returns), so an image seen before skips the vision tower.

`LocalVisionCache` is a small in-process LRU bounded by bytes; `VisionCache` puts it in front of
an optional shared store (the worker's Redis layer implements `EmbeddingStore`; engines never
import Redis). Returned tensors are the cached objects themselves: do not modify them in place.
Key by the image's sha256 within one model: a cache instance serves one model and processor.

Puts to the shared store are written behind (`WriteBehind`): the engine thread only queues a
non-blocking copy to pinned host memory; a background thread waits for it and writes. Written
inline, the copy synchronized the main stream and the store's round trip (an image's embeddings
on the 4B) held the thread that launches kernels for much of its time.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from wicore.engines.kvcache.cache_stats import TierStats

log = logging.getLogger(__name__)

WRITES_PENDING = 8  # batches waiting for the shared store at most; past that a batch is not shared


class EmbeddingStore(Protocol):
    """A batch interface: one call (one round trip for a remote store) per batch of images."""

    def get_many(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        """The embeddings found, by hash; absent ones are left out."""
        ...

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None: ...


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class LocalVisionCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self.stats = TierStats()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, image_hash: object) -> bool:
        return image_hash in self._entries

    def get(self, image_hash: str) -> torch.Tensor | None:
        tensor = self._entries.get(image_hash)
        if tensor is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(image_hash)
        self.stats.record(hits=1, misses=0, bytes_out=tensor_bytes(tensor))
        return tensor

    def put(self, image_hash: str, tensor: torch.Tensor) -> bool:
        """False when the tensor alone is over the cap (then it is not kept)."""
        size = tensor_bytes(tensor)
        if size > self.max_bytes:
            return False
        self.discard(image_hash)
        while self.total_bytes + size > self.max_bytes:
            self.discard(next(iter(self._entries)))
            self.stats.evictions += 1
        self._entries[image_hash] = tensor
        self.total_bytes += size
        self.stats.bytes_in += size
        return True

    def discard(self, image_hash: str) -> None:
        tensor = self._entries.pop(image_hash, None)
        if tensor is not None:
            self.total_bytes -= tensor_bytes(tensor)

    def get_many(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        return {h: t for h in dict.fromkeys(hashes) if (t := self.get(h)) is not None}

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None:
        for image_hash, tensor in items.items():
            self.put(image_hash, tensor)


class WriteBehind:
    """`put_many` to a store from a background thread. Device tensors are first copied into
    pinned host memory on the current stream without blocking; the thread waits for that copy,
    then writes. At most `max_pending` batches wait; past that a batch is dropped (`dropped`
    counts its images): the store is a cache, and the vision tower is not held to its pace."""

    def __init__(self, store: EmbeddingStore, max_pending: int = WRITES_PENDING):
        self.store = store
        self.dropped = 0
        self._queue: queue.Queue[tuple[dict[str, torch.Tensor], torch.cuda.Event | None] | None]
        self._queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="vision-cache-writer", daemon=True)
        self._thread.start()

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._queue.put_nowait(_to_host(items))
        except queue.Full:
            self.dropped += len(items)

    def flush(self) -> None:
        """Until every queued batch is written (or failed)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to `timeout_s`), then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            host, copied = item
            try:
                if copied is not None:
                    copied.synchronize()
                self.store.put_many(host)
            except Exception:  # a cache write must never stop the writer
                log.exception("shared vision cache: a write failed")
            finally:
                self._queue.task_done()
        self._queue.task_done()


def _to_host(items: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """The tensors on the CPU (device ones copied into pinned memory, queued on the current
    stream) and the event that marks the copies done (None when nothing was copied)."""
    host, copied = {}, False
    for key, tensor in items.items():
        if tensor.device.type == "cuda":
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host[key] = pinned.copy_(tensor, non_blocking=True)
            copied = True
        else:
            host[key] = tensor
    if not copied:
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


class VisionCache:
    """Local first; the misses go to the shared store in one call and fill the local cache.
    `device`: where the engine wants embeddings (shared hits arrive on the CPU). Puts reach the
    shared store from a background thread (module docstring; `flush` waits for them)."""

    def __init__(self, local: LocalVisionCache, shared: EmbeddingStore | None = None, device: str | None = None):
        self.local = local
        self._shared: EmbeddingStore | None = None
        self._writer: WriteBehind | None = None
        self.shared = shared
        self.device = torch.device(device) if device is not None else None

    @property
    def shared(self) -> EmbeddingStore | None:
        return self._shared

    @shared.setter
    def shared(self, store: EmbeddingStore | None) -> None:
        if self._writer is not None:
            self._writer.close()
        self._shared = store
        self._writer = WriteBehind(store) if store is not None else None

    def flush(self) -> None:
        """Until the puts queued for the shared store are written."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Write what is queued for the shared store, then stop its writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def dropped_writes(self) -> int:
        """Images not shared because the store fell behind."""
        return self._writer.dropped if self._writer is not None else 0

    def get_many(self, hashes: Sequence[str]) -> dict[str, torch.Tensor]:
        found = self.local.get_many(hashes)
        missing = [h for h in dict.fromkeys(hashes) if h not in found]
        if missing and self.shared is not None:
            for image_hash, tensor in self.shared.get_many(missing).items():
                tensor = tensor.to(self.device) if self.device is not None else tensor
                self.local.put(image_hash, tensor)
                found[image_hash] = tensor
        return found

    def put_many(self, items: Mapping[str, torch.Tensor]) -> None:
        """New embeddings, e.g. a batch's vision-tower output split per image."""
        self.local.put_many(items)
        if self._writer is not None and items:
            self._writer.put_many(items)
