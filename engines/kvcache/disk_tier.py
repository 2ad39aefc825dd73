"""A folder of KV blocks (or any tensors) keyed by block hash, under a byte cap.

One file per entry, `<root>/<first 2 hex>/<hex>.blk`, in the checksummed format of `tensor_codec`
(the header also names the key). Writes are crash-safe: a temp file in the same folder, fsync,
atomic rename, fsync of the folder. On open, temp leftovers are deleted and the remaining files
indexed (oldest modification first, for the policy); checksums are verified on read (or on open
with `verify_on_open`). A damaged or vanished file is a miss and is dropped, never an error.
One process owns a folder at a time (an flock on `<root>/.lock`), so cleaning up temp files on
open cannot delete another writer's.

Thread-safe: the index (sizes, policy, byte count, stats) changes under a lock, and the files are
read, encoded and written outside it, so reads on several threads run beside a write and its
fsyncs (`AsyncDiskTier`). A write reserves its bytes before it starts, so the cap holds while it
is in flight; a read of a file that an eviction unlinks meanwhile is a plain miss.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from wicore.engines import tensor_codec as codec
from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.cache_stats import TierStats
from wicore.engines.kvcache.eviction import LRU, EvictionPolicy
from wicore.errors import ConfigError

log = logging.getLogger(__name__)
SUFFIX = ".blk"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"


@dataclass(frozen=True)
class _Found:
    key: BlockHash
    path: Path
    size: int
    mtime: float


class DiskTier:
    def __init__(
        self,
        root: str | Path,
        max_bytes: int,
        policy: EvictionPolicy[BlockHash] | None = None,
        verify_on_open: bool = False,
    ):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.policy: EvictionPolicy[BlockHash] = policy if policy is not None else LRU()
        self.stats = TierStats()
        self._sizes: dict[BlockHash, int] = {}
        self.total_bytes = 0  # indexed entries and the writes in flight
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.root / LOCK_NAME)
        self._open(verify_on_open)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def path(self, key: BlockHash) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def put(self, key: BlockHash, tensor: torch.Tensor, cost: float = 1.0) -> bool:
        """Store `tensor` under `key`, evicting by policy to stay under the cap. False when it
        cannot be stored (bigger than the cap, or the disk refused); never raises for that."""
        with self._lock:
            if key in self._sizes:
                self.policy.touch(key)
                return True
        started = time.perf_counter()
        blob = codec.encode(tensor, meta={"key": key.hex()})
        with self._lock:
            if len(blob) > self.max_bytes or not self._make_room(len(blob)):
                return False
            self.total_bytes += len(blob)  # reserved while the file is written
        path = self.path(key)
        written = self._write(path, blob)
        with self._lock:
            self.total_bytes -= len(blob)
            # Another put of this key may have renamed onto the same path, been indexed and been
            # evicted (the file unlinked) while this one finished: index only a file still there.
            stored = written and (key in self._sizes or path.exists())
            if stored and key not in self._sizes:
                self._add(key, len(blob), cost)
                self.stats.bytes_in += len(blob)
            self.stats.seconds += time.perf_counter() - started
        return stored

    def get(self, key: BlockHash) -> torch.Tensor | None:
        """The tensor under `key` (on the CPU), or None: absent, damaged or vanished."""
        with self._lock:
            if key not in self._sizes:
                self.stats.misses += 1
                return None
        started = time.perf_counter()
        tensor, damage = self._load(key, self.path(key))
        with self._lock:
            self.stats.seconds += time.perf_counter() - started
            if tensor is None:
                self._forget(key, damage)
                self.stats.misses += 1
                return None
            if key in self._sizes:
                self.policy.touch(key)
            self.stats.record(hits=1, misses=0, bytes_out=self._sizes.get(key, tensor.nbytes))
        return tensor

    def delete(self, key: BlockHash) -> None:
        with self._lock:
            if key in self._sizes:
                self._drop(key)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _open(self, verify: bool) -> None:
        found = sorted(self._scan(), key=lambda f: f.mtime)  # oldest first: LRU order
        for entry in found:
            if verify:
                tensor, damage = self._load(entry.key, entry.path)
                if tensor is None:
                    if damage is not None:
                        self._note_damage(entry.path, damage)
                    continue
            self._add(entry.key, entry.size, 1.0)
        self._make_room(0)  # the cap may have shrunk since the last run

    def _scan(self) -> list[_Found]:
        found = []
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue
            for path in shard.iterdir():
                if path.name.startswith(TEMP_PREFIX):
                    path.unlink(missing_ok=True)  # a write that never reached its rename
                elif (key := _key_of(path)) is not None:
                    stat = path.stat()
                    found.append(_Found(key, path, stat.st_size, stat.st_mtime))
        return found

    def _load(self, key: BlockHash, path: Path) -> tuple[torch.Tensor | None, str | None]:
        """Read, decode and check one file (no lock held): (tensor, None), or (None, why it is
        damaged), or (None, None) when it is gone (evicted or deleted behind our back)."""
        try:
            decoded = codec.decode(path.read_bytes())
            if decoded.meta.get("key") != key.hex():
                raise codec.CorruptBlob("the header names another key")
            return decoded.tensor, None
        except FileNotFoundError:
            return None, None
        except (OSError, codec.CorruptBlob) as e:
            return None, str(e)

    def _forget(self, key: BlockHash, damage: str | None) -> None:
        """After a failed read (lock held): a damaged file is logged, counted and deleted; either
        way a key still indexed leaves the index."""
        if damage is not None:
            self._note_damage(self.path(key), damage)
        if key in self._sizes:
            self._drop(key)

    def _note_damage(self, path: Path, damage: str) -> None:
        log.warning("disk tier: dropping damaged %s: %s", path, damage)
        self.stats.corrupt += 1
        path.unlink(missing_ok=True)

    def _write(self, path: Path, blob: bytes) -> bool:
        path.parent.mkdir(exist_ok=True)
        temp = path.parent / f"{TEMP_PREFIX}{path.stem}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, blob)
                os.fsync(fd)  # the bytes are on disk before the name points at them
            finally:
                os.close(fd)
            os.replace(temp, path)
            _fsync_dir(path.parent)  # and the rename itself survives a power cut
        except OSError as e:
            log.warning("disk tier: cannot write %s: %s", path, e)
            temp.unlink(missing_ok=True)
            return False
        return True

    def _make_room(self, size: int) -> bool:
        while self.total_bytes + size > self.max_bytes:
            victim = self.policy.victim()
            if victim is None:
                return False
            self._drop(victim)
            self.stats.evictions += 1
        return True

    def _add(self, key: BlockHash, size: int, cost: float) -> None:
        self._sizes[key] = size
        self.total_bytes += size
        self.policy.insert(key, cost)

    def _drop(self, key: BlockHash) -> None:
        self.total_bytes -= self._sizes.pop(key)
        self.policy.remove(key)
        self.path(key).unlink(missing_ok=True)


def _key_of(path: Path) -> BlockHash | None:
    if path.suffix != SUFFIX:
        return None
    try:
        key = bytes.fromhex(path.stem)
    except ValueError:
        return None
    return key if path.parent.name == path.stem[:2] else None


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise ConfigError(f"{path.parent} is in use by another process") from e
    return fd


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
