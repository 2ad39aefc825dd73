"""Triton paged attention and the K/V store into the pages (imported lazily: only CUDA needs
triton).

Queries are packed tokens ([N, Hq, D]), each with the table row of its sequence and its context
length (position + 1): a decode step's tokens, or the tokens of a prefill whose keys all sit in
the pages (its own K/V stored before the call). A program handles one *tile* of up to `TOKENS`
consecutive tokens of one sequence and one kv head: its query tile is those tokens' `QPK` query
heads ([TOKENS * QPK, D], GQA), it walks the keys the tile can see `BLOCK_N` at a time through the
block table, masks each row to its own range (causal; to the end of its image for an image's
soft tokens, whose attention is bidirectional; a sliding window starts from the position) and
keeps an online softmax in float32. Decode uses tiles of one token (the tile is then the token); the query tile
is padded to 16 rows only to satisfy `tl.dot`. Over FP8 pages with bf16 queries the tiles are fp16
(`_fp16_tiles`): e4m3 -> fp16 is one instruction for two values and exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from wicore.ops.fp8_format import E4M3_MAX, KV_FP8

FP8_MAX = tl.constexpr(E4M3_MAX)  # a kernel reads module globals only as constexprs


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots_ptr, stride_k, stride_v, ROW: tl.constexpr,
                     BLOCK: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Program t: token t's k and v rows (kv_heads * head_dim values each) into slot slots[t] of
    each cache, saturated at +-448 and rounded to nearest when the cache is e4m3."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < ROW
    k = tl.load(k_ptr + token * stride_k + offs, mask=inside)
    v = tl.load(v_ptr + token * stride_v + offs, mask=inside)
    if FP8:
        k = tl.clamp(k.to(tl.float32), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(k_cache + slot * ROW + offs, k.to(k_cache.dtype.element_ty), mask=inside)
    tl.store(v_cache + slot * ROW + offs, v.to(v_cache.dtype.element_ty), mask=inside)


def store_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> bool:
    """`paged.store_kv` in one launch for k and v (two `index_copy_` otherwise, and for an e4m3
    cache a clamp and a cast of each before them). Returns False, having written nothing, where
    a token's row is not contiguous or a cache is not laid out as rows of slots."""
    row = k_cache.shape[2] * k_cache.shape[3]
    rows_ok = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    if not (rows_ok and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if slots.numel():
        _store_kv_kernel[(slots.numel(),)](
            k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row),
            FP8=k_cache.dtype == KV_FP8, num_warps=4,
        )  # fmt: skip
    return True


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [N, Hq, D]
    k_ptr,  # [P, BS, Hkv, D] (strided view)
    v_ptr,
    out_ptr,  # [N, Hq, D]
    tables_ptr,  # [R, T] int32
    rows_ptr,  # [N] table row of each token
    lens_ptr,  # [N] int32 position + 1 of each token (its causal end; the window ends there)
    ends_ptr,  # [N] int32 end of the keys each token sees (>= lens: image tokens see their image)
    tile_first_ptr,  # [tiles] first token of each tile (TOKENS > 1 only)
    tile_count_ptr,  # [tiles] tokens in each tile, 0 for a padding tile (TOKENS > 1 only)
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
    TOKENS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    FP16_TILES: tl.constexpr,
):
    kv_head = tl.program_id(1)
    first_token, count, first, length = _tile_span(
        tl.program_id(0), lens_ptr, ends_ptr, tile_first_ptr, tile_count_ptr, window, TOKENS, USE_WINDOW
    )
    table_row = tl.load(rows_ptr + first_token).to(tl.int64)
    # Row r of the query tile: token r // QPK of the tile, query head kv_head * QPK + r % QPK.
    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, DIM_PAD)
    token = first_token + offs_r // QPK
    row_valid = offs_r < count * QPK
    q_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    heads = kv_head * QPK + offs_r % QPK
    q = tl.load(
        q_ptr + token[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )
    if FP16_TILES:  # FP8 pages: e4m3 -> fp16 is one conversion for two values, -> bf16 is not
        q = q.to(tl.float16)
    row_end = tl.load(ends_ptr + token, mask=row_valid, other=0)  # [BLOCK_Q]
    row_first = tl.zeros([BLOCK_Q], tl.int32)
    if USE_WINDOW:
        row_first = tl.maximum(tl.load(lens_ptr + token, mask=row_valid, other=0) - window, 0)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range((first // BLOCK_N) * BLOCK_N, length, BLOCK_N):
        pos = tile + offs_n
        in_range = (pos >= first) & (pos < length)
        pages = tl.load(tables_ptr + table_row * stride_tr + (pos // PAGE) % ring, mask=in_range, other=0)
        pages = pages.to(tl.int64)
        kv_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        # An FP8 cache's rows in the tiles' dtype, q's (scale 1: `paged.KV_FP8`); a no-op otherwise.
        k = _page_rows(k_ptr, pages, pos % PAGE, kv_head, stride_kp, stride_ks, stride_kh, offs_d, kv_mask).to(q.dtype)
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, PRECISION)
        visible = (pos[None, :] >= row_first[:, None]) & (pos[None, :] < row_end[:, None])
        v = _page_rows(v_ptr, pages, pos % PAGE, kv_head, stride_vp, stride_vs, stride_vh, offs_d, kv_mask).to(q.dtype)
        m_i, l_i, acc = _online_softmax(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc, PRECISION)

    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _tile_span(tile_id, lens_ptr, ends_ptr, tile_first_ptr, tile_count_ptr, window, TOKENS, USE_WINDOW):
    """(first token, tokens, first key, key end) of a tile. Its tokens are consecutive positions,
    whose ends never decrease: it reads keys [first key, key end), from the first token's window
    start to the last token's end."""
    if TOKENS == 1:
        first_token = tile_id
        count = 1
        length = tl.load(ends_ptr + tile_id)
    else:
        first_token = tl.load(tile_first_ptr + tile_id).to(tl.int32)
        count = tl.load(tile_count_ptr + tile_id).to(tl.int32)
        last_end = tl.load(ends_ptr + first_token + tl.maximum(count - 1, 0))
        length = tl.where(count > 0, last_end, 0)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(tl.load(lens_ptr + first_token) - window, 0)
    return first_token, count, first, length


@triton.jit
def _page_rows(base_ptr, pages, slots, kv_head, stride_p, stride_s, stride_h, offs_d, mask):
    """Keys or values [BLOCK_N, DIM_PAD] of one kv head at each position's (page, slot)."""
    ptrs = base_ptr + pages[:, None] * stride_p + slots[:, None] * stride_s + kv_head * stride_h + offs_d[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP, PRECISION):
    """Scaled (and soft-capped) logits [BLOCK_Q, BLOCK_N] of the query tile against k."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if USE_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    return s


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, PRECISION):
    """One key tile of the online softmax (float32 state): masked logits s [BLOCK_Q, BLOCK_N]
    (-inf where unseen), values v -> the new running max, sum and output accumulator."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row may see nothing in a tile (before its window starts): keep it at exp(-inf) = 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


def paged_attention_triton(
    q, k_cache, v_cache, block_tables, rows, context_lens, scale, ring, window=None, softcap=None, tiles=None, ends=None
) -> torch.Tensor:
    """`wicore.ops.attention.paged_attention` on the GPU: same arguments, same result. Launch-only
    (no host sync), so it can be captured in a CUDA graph."""
    _require_contiguous_head_dim(q, k_cache, v_cache)
    out = torch.empty_like(q)
    tile_first, tile_count, tokens = tiles if tiles is not None else (rows, rows, 1)
    programs = tile_first.shape[0] if tiles is not None else q.shape[0]  # one per tile (decode: per token)
    _paged_attention_kernel[(programs, k_cache.shape[2])](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        rows,
        context_lens,
        ends if ends is not None else context_lens,
        tile_first,
        tile_count,
        scale,
        softcap or 1.0,
        window or 0,
        ring,
        *_strides(q, k_cache, v_cache, out, block_tables),
        **_constants(q, k_cache, tokens, window, softcap),
        num_warps=4,
    )
    return out


def _require_contiguous_head_dim(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("paged attention needs the head dimension contiguous")


def _strides(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The kernel's stride arguments in its order: q by token and head; each cache by page, slot
    and head; out by token and head; the block table by row (the last dimensions are contiguous)."""
    return (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2], block_tables.stride(0))


def _constants(
    q: torch.Tensor, k_cache: torch.Tensor, tokens: int, window: int | None, softcap: float | None
) -> dict[str, int | bool | str]:
    """The kernel's compile-time constants for these shapes and options, with its pipeline depth."""
    dim, page, kv_heads = q.shape[2], k_cache.shape[1], k_cache.shape[2]
    qpk = q.shape[1] // kv_heads  # query heads per kv head (GQA)
    block_n, stages = _tile(q, k_cache)
    return {
        "HEAD_DIM": dim,
        "DIM_PAD": triton.next_power_of_2(dim),
        "QPK": qpk,
        "TOKENS": tokens,
        "BLOCK_Q": max(16, triton.next_power_of_2(qpk * tokens)),  # tl.dot needs 16 rows
        "PAGE": page,
        "BLOCK_N": block_n,
        "USE_WINDOW": window is not None,
        "USE_SOFTCAP": softcap is not None,
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "FP16_TILES": _fp16_tiles(q, k_cache),
        "num_stages": stages,
    }


# (keys per tile, pipeline stages) over FP8 pages with bf16 queries at head_dim > 128, whose tiles
# are converted to fp16 (`_fp16_tiles`): the fastest of (32 or 64 or 128 keys, stages) and of
# bf16 tiles on Gemma-3-4B's decode, about as fast as over bf16 pages.
FP8_TILE = (64, 3)


def _fp16_tiles(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return k_cache.dtype == KV_FP8 and q.dtype == torch.bfloat16


def _tile(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """(keys per tile, pipeline stages): any power of two >= 16 keys (tokens map to pages one by
    one). 32 at head_dim 256 keeps the pipelined K/V tiles (3 stages x 2 x 16 KiB in bf16) well
    inside shared memory."""
    if q.shape[2] <= 128:
        return 64, 3
    return FP8_TILE if _fp16_tiles(q, k_cache) else (32, 3)
