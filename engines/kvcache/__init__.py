"""The KV cache's storage, in one place: how pages are laid out (`kv_layout`), the page pool
(`block_manager`), prefix keys (`block_hashes`, `prefix_keys`), the tiers of the prefix cache
(`gpu_tier`, `host_tier`, `disk_tier` + `disk_io`), the copies between them (`tiers`,
`restores`), eviction (`eviction`; the benchmark simulates it in `wicore.bench.eviction_sim`)
and counters (`cache_stats`). It knows blocks and keys, never a sequence: the sequence-facing
half (admission with the cache, the tiers as sequences meet them, the build from the engine's
options) is the fast engine's (`wicore.engines.fast`: `prefix_admission`, `sequence_tiers`,
`kv_setup`), and nothing here imports from it (tests/test_packaging.py).

Nothing here imports Redis or RQ. README.md has the eviction simulation behind the default policy.
"""
