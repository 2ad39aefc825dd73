"""The `fast` engine: Gemma-3 served with a paged KV cache, continuous batching, CUDA graphs.

Owners, one per concern:
- `engine.FastEngine`: the Engine interface; a step = schedule -> launch -> read back.
- `scheduler.Scheduler`: waiting / admitted sequences; FIFO admission by free rows and pages;
  picks the vision, prefill and decode batches.
- `block_manager.BlockManager`: the pool of KV pages (refcounts; the prefix cache's pages).
- `prefix_cache.PrefixCache`: the GPU tier of the prefix cache (hash -> block, users, policy);
  `prefix_keys` (keys, model id), `prefix_admission` (matching and taking hits at admission).
- `tiers.KVTiers`: host and disk tiers and the copies down; `restores.Restorer` the copies up;
  `cache_setup` builds them from the options; `restore_probe` measures restore bandwidth.
- `kv_cache`: layer groups, pages, block tables, sliding-window rings.
- `model_runner.ModelRunner`: the device: weights, cache, tables, streams, prefill, decode;
  `prefill_inputs` builds a prefill's inputs (the uncached suffix of each prompt).
- `graph_runner.GraphRunner`: CUDA graphs per size bucket (decode batches, short paged prefills).
- `sampler.Sampler`: greedy / seeded Gumbel-max sampling with top-k / top-p on the device.
- `vision`, `text_model`, `layers`, `weights`: our own Gemma-3 modules and their loading.
- `inputs`: chat -> token ids and pixels, identical to the HF processor.
"""

from wicore.engines.fast.engine import FastEngine

__all__ = ["FastEngine"]
