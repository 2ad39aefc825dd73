"""Engine-independent cache components: prefix block hashes, eviction policies, a host (CPU) and
a disk tier for KV blocks, a vision-embedding cache, per-tier counters and a trace simulator.

Nothing here imports Redis or RQ; the shared (Redis) vision cache lives in `wicore.worker`.
"""
