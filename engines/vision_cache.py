"""Image content hash -> projected image embeddings ([image tokens, hidden], what the multimodal
projector returns), so an image seen before skips the vision tower.

`LocalVisionCache` is a small in-process LRU bounded by bytes; `VisionCache` puts it in front of
an optional shared store (the worker's Redis layer implements `EmbeddingStore`; engines never
import Redis). Returned tensors are the cached objects themselves: do not modify them in place.
Key by the image's sha256 within one model: a cache instance serves one model and processor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from wicore.engines.kvcache.cache_stats import TierStats


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


class VisionCache:
    """Local first; the misses go to the shared store in one call and fill the local cache.
    `device`: where the engine wants embeddings (shared hits arrive on the CPU)."""

    def __init__(self, local: LocalVisionCache, shared: EmbeddingStore | None = None, device: str | None = None):
        self.local = local
        self.shared = shared
        self.device = torch.device(device) if device is not None else None

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
        if self.shared is not None and items:
            self.shared.put_many(items)
