"""The KV cache, in one place: how pages are laid out (`kv_layout`), the page pool
(`block_manager`), prefix keys (`block_hashes`, `prefix_keys`), the tiers of the prefix cache
(`gpu_tier`, `host_tier`, `disk_tier` + `disk_io`), the copies between them (`tiers`,
`restores`), matching at admission (`prefix_admission`), eviction (`eviction`; the benchmark
simulates it in `wicore.bench.eviction_sim`), counters (`cache_stats`) and the build from the
engine's options (`kv_setup`).

Nothing here imports Redis or RQ. README.md has the eviction simulation behind the default policy.
"""
