"""Building the prefix cache's parts from the fast engine's resolved config: the GPU tier's
table and policy, the pinned host tier, the disk tier and its threads."""

from __future__ import annotations

from pathlib import Path

from wicore.engines.kvcache.disk_io import AsyncDiskTier
from wicore.engines.kvcache.disk_tier import DiskTier
from wicore.engines.kvcache.eviction import A2CR, LRU, EvictionPolicy
from wicore.engines.kvcache.gpu_tier import PrefixCache
from wicore.engines.kvcache.host_tier import HostTier
from wicore.engines.kvcache.kv_layout import KVCache, KVLayout
from wicore.engines.kvcache.tiers import KVTiers
from wicore.engines.options import ResolvedFastConfig
from wicore.errors import ConfigError
from wicore.ops.transfer import batch_copier

STAGING_BYTES = 512 * 2**20  # device buffers of copies in flight, each way (down: more dropped; up: queued)
HALF_LIFE_CAPACITIES = 2  # A2CR's half-life in accesses, in units of the tier's capacity (README)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "a2cr":
        return A2CR.with_half_life(HALF_LIFE_CAPACITIES * max(1, capacity))
    raise ConfigError(f"unknown cache policy {name!r}")


def build_prefix_cache(options: ResolvedFastConfig, num_pages: int, layout: KVLayout) -> PrefixCache | None:
    if not options.prefix_cache:
        return None
    return PrefixCache(make_policy(options.cache_policy, num_pages // len(layout.groups)))


def build_tiers(kv: KVCache, options: ResolvedFastConfig, kv_heads: int, head_dim: int) -> KVTiers:
    shape = kv.layout.block_shape(kv_heads, head_dim)
    block_bytes = kv.tensor.element_size()
    for size in shape:
        block_bytes *= size
    host_bytes = options.host_cache_bytes
    host = None
    if host_bytes:
        num_blocks = host_bytes // block_bytes
        if num_blocks < 1:
            raise ConfigError(f"host_cache_bytes {host_bytes} is less than one KV block ({block_bytes} bytes)")
        policy = make_policy(options.cache_policy, num_blocks)
        copier = batch_copier(kv.tensor.device) if options.batched_copies else None
        host = HostTier(num_blocks, shape, kv.tensor.dtype, policy, pin_memory=options.cuda, copier=copier)
    disk = None
    if options.disk_cache_dir is not None:
        capacity = options.disk_cache_bytes // block_bytes
        policy = make_policy(options.cache_policy, capacity)
        disk = AsyncDiskTier(DiskTier(Path(options.disk_cache_dir), options.disk_cache_bytes, policy))
    return KVTiers(kv, host, disk, STAGING_BYTES, kv_heads, head_dim)
