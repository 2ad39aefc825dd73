"""Paged attention over a block-table KV cache: writing K/V into pages, and attention for decode
tokens (or prefill tokens whose keys are all paged).

Paged KV layout (one layer): `k_cache`, `v_cache`: [num_pages, block_size, kv_heads, head_dim].
A sequence's `block_tables[row]` lists its pages; the token at position `t` lives in page
`block_tables[row, (t // block_size) % ring]` at offset `t % block_size`. `ring` is the number of
table entries a layer group cycles through: the table width for full-attention layers (no
wrap-around), ceil(window / block_size) + 1 for sliding-window layers, which then keep only the
pages their window still needs.

`paged_attention` and `store_kv` pick the Triton kernels (`paged_triton`) on CUDA and plain torch
elsewhere.

An FP8 cache (`KV_FP8`, e4m3) holds K/V at scale 1, as vLLM's FP8 KV cache does by default: a
value is rounded to 3 mantissa bits and saturates at +-448. Attention reads it back in the
queries' dtype and computes as it does over a cache of that dtype (the CUDA kernel with bf16
queries in fp16, which holds every e4m3 value exactly and q's with 3 more mantissa bits).
"""

from __future__ import annotations

import torch

from wicore.ops.fp8_format import E4M3_MAX, KV_FP8


def kv_storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a cache of `dtype` is kept in: bytes for FP8, since index_copy_, index_select and
    their kin have no FP8 kernels on every device and torch version. The attention layers see
    views of it in `dtype`; copies between tiers move the bytes."""
    return torch.uint8 if dtype == KV_FP8 else dtype


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write k/v [N, Hkv, D] into flat cache slots [N] (page * block_size + offset), rounded to
    the cache's dtype (an FP8 cache saturates at +-448 rather than overflow to NaN).

    Tokens a layer must not keep are given a slot in the reserved null page 0; several may land
    on the same slot, which is harmless since nothing ever reads page 0 for real.
    """
    if k_cache.is_cuda:
        from wicore.ops.attention.paged_triton import store_kv_triton

        if store_kv_triton(k_cache, v_cache, k, v, slots):
            return
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache.dtype == KV_FP8:
            new = new.clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8).view(torch.uint8)
        _slot_rows(cache).index_copy_(0, slots, new)


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One layer's K or V [len(slots), Hkv, D] at flat cache slots [n], in `dtype`."""
    return _slot_rows(cache).index_select(0, slots).view(cache.dtype).to(dtype)


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache [pages, block_size, Hkv, D] as rows [slots, Hkv, D] that index_copy_ and
    index_select take: an FP8 cache's bytes (`kv_storage_dtype` says why)."""
    rows = cache.view(torch.uint8) if cache.dtype == KV_FP8 else cache
    return rows.view(-1, *rows.shape[2:])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    ring: int,
    window: int | None = None,
    softcap: float | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed query tokens over their pages. q: [N, Hq, D]; block_tables: [R, T] int32; rows:
    [N] the table row of each token's sequence; context_lens: [N] int32, the keys 0 .. len-1 a
    token sees (its position + 1: the token's own K/V are in the pages already). Decode passes
    one token per sequence. A prefill passes its new tokens (their K/V stored first), with
    `ends` [N] int32 >= context_lens where a token sees further (an image's soft tokens see the
    whole image: Gemma-3's bidirectional image attention; a sliding window still starts from
    context_lens) and `tiles` = (first token [T], token count [T] (0: padding), tokens per tile):
    consecutive tokens of one sequence that the Triton kernel attends together (one K/V read per
    tile). Returns [N, Hq, D]."""
    if q.is_cuda:
        from wicore.ops.attention.paged_triton import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, rows, context_lens, scale, ring, window, softcap, tiles, ends
        )
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, rows, context_lens, scale, ring, window, softcap, ends
    )


def paged_attention_reference(
    q, k_cache, v_cache, block_tables, rows, context_lens, scale, ring, window=None, softcap=None, ends=None
) -> torch.Tensor:
    """Plain torch, one token at a time: gather its visible keys from its pages, then dense
    attention (`tiles` only group work for the kernel)."""
    block_size = k_cache.shape[1]
    groups = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    ends = context_lens if ends is None else ends
    for b, (row, length, end) in enumerate(zip(rows.tolist(), context_lens.tolist(), ends.tolist(), strict=True)):
        first = max(0, length - window) if window is not None else 0
        positions = torch.arange(first, end, device=q.device)
        pages = block_tables[row, (positions // block_size) % ring].long()
        offsets = positions % block_size
        k = k_cache[pages, offsets].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, n, D]
        v = v_cache[pages, offsets].to(q.dtype).transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = torch.matmul(q[b, :, None, :], k.transpose(-1, -2)) * scale  # [Hq, 1, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[b] = torch.matmul(probs, v)[:, 0]
    return out
