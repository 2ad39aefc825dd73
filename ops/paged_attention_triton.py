"""Triton paged decode attention (imported lazily: only CUDA needs triton).

One program per (sequence, kv head): it loads the `QPK` query heads that share the kv head
(GQA), walks the sequence's visible keys `BLOCK_N` at a time through its block table, and keeps
an online softmax in float32. Decode is memory-bound, so the kernel's job is to stream K/V
once; the query tile is padded to 16 rows only to satisfy `tl.dot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [P, BS, Hkv, D] (strided view)
    v_ptr,
    out_ptr,  # [B, Hq, D]
    tables_ptr,  # [R, T] int32
    rows_ptr,  # [B]
    lens_ptr,  # [B] int32
    scale,
    softcap,
    window,
    ring,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_tr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    length = tl.load(lens_ptr + seq)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(length - window, 0)

    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, DIM_PAD)
    q_mask = (offs_q[:, None] < QPK) & (offs_d[None, :] < HEAD_DIM)
    heads = kv_head * QPK + offs_q
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    start = (first // BLOCK_N) * BLOCK_N  # the first tile holds `first`, so no tile is empty
    for tile in range(start, length, BLOCK_N):
        pos = tile + offs_n
        valid = (pos >= first) & (pos < length)
        pages = tl.load(tables_ptr + row * stride_tr + (pos // PAGE) % ring, mask=valid, other=0).to(tl.int64)
        slot = pos % PAGE
        kv_mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(
            k_ptr + pages[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_Q, BLOCK_N]
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + pages[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_decode_attention_triton(
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
) -> torch.Tensor:
    """Same contract as `wicore.ops.attention.paged_decode_attention`. Launch-only (no host
    sync), so it can be captured in a CUDA graph."""
    batch, q_heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    qpk = q_heads // kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the head dimension contiguous")
    out = torch.empty_like(q)
    # Keys per tile (any power of two >= 16; tokens map to pages one by one). 32 at head_dim 256
    # keeps the pipelined K/V tiles (3 stages x 2 x 16 KiB in bf16) well inside shared memory.
    block_n = 64 if dim <= 128 else 32
    _paged_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        rows,
        context_lens,
        scale,
        softcap or 1.0,
        window or 0,
        ring,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim),
        QPK=qpk,
        BLOCK_Q=max(16, triton.next_power_of_2(qpk)),
        PAGE=page,
        BLOCK_N=block_n,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
