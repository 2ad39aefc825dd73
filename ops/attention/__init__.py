"""Attention kernels for serving Gemma-3, one module each: packed prefill with Gemma-3's masks
(`prefill`), prefill over a cached prefix (`prefix_prefill`), paged attention for decode and short
prefills (`paged`: a torch reference, and `paged_triton` on CUDA)."""

from wicore.ops.attention.paged import (
    KV_FP8,
    gather_kv,
    kv_storage_dtype,
    paged_attention,
    paged_attention_reference,
    store_kv,
)
from wicore.ops.attention.prefill import (
    GroupedBatch,
    PackedBatch,
    gemma3_prefill_masks,
    group_batch,
    grouped_attention,
    pack_layout,
    prefill_attention,
)

__all__ = [
    "KV_FP8",
    "GroupedBatch",
    "PackedBatch",
    "gather_kv",
    "gemma3_prefill_masks",
    "group_batch",
    "grouped_attention",
    "kv_storage_dtype",
    "pack_layout",
    "paged_attention",
    "paged_attention_reference",
    "prefill_attention",
    "store_kv",
]
