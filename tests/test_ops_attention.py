"""Attention ops: the paged decode reference against dense attention, the prefill masks
against transformers' own Gemma-3 mask functions, and the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fast_requests import one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import fp8_gpu
from wicore.ops.attention import (
    KV_FP8,
    gather_kv,
    gemma3_prefill_masks,
    pack_layout,
    paged_attention,
    paged_attention_reference,
    prefill_attention,
    store_kv,
)
from wicore.ops.attention.prefill import gather_rows

BLOCK = 4


def dense_attention(q, k, v, mask, scale):
    """q [Hq, Lq, D], k/v [Hkv, L, D], mask [Lq, L] bool."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def paged_setup(lengths, ring, pages=64, kv_heads=2, dim=8, seed=0, dtype=torch.float32):
    """Random K/V for each sequence, written into shuffled pages through its block table
    (ring entries); returns the caches (of `dtype`), tables and the dense K/V per sequence."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(pages, BLOCK, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), 16, dtype=torch.int32)
    dense = []
    for row, length in enumerate(lengths):
        entries = min(ring, -(-length // BLOCK))
        tables[row, :entries] = torch.tensor([free.pop() for _ in range(entries)], dtype=torch.int32)
        k = torch.randn(length, kv_heads, dim, generator=gen)
        v = torch.randn(length, kv_heads, dim, generator=gen)
        pos = torch.arange(length)
        slots = tables[row, (pos // BLOCK) % ring].long() * BLOCK + pos % BLOCK
        for t in range(length):  # in order, so ring pages end up holding the newest tokens
            store_kv(k_cache, v_cache, k[t : t + 1], v[t : t + 1], slots[t : t + 1])
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


@pytest.mark.parametrize("window, ring", [(None, 16), (6, 3), (9, 4)])
def test_paged_reference_matches_dense(window, ring):
    lengths = [1, 5, 23, 37]
    k_cache, v_cache, tables, dense = paged_setup(lengths, ring)
    q = torch.randn(len(lengths), 4, 8)
    rows = torch.tensor([0, 1, 2, 3])
    out = paged_attention_reference(
        q, k_cache, v_cache, tables, rows, torch.tensor(lengths, dtype=torch.int32), 0.3, ring, window
    )
    for b, (k, v) in enumerate(dense):
        j = torch.arange(lengths[b])
        mask = (j > lengths[b] - 1 - window) if window else torch.ones_like(j, dtype=torch.bool)
        want = dense_attention(q[b][:, None], k.transpose(0, 1), v.transpose(0, 1), mask[None], 0.3)
        torch.testing.assert_close(out[b], want[:, 0], rtol=1e-5, atol=1e-5)


def test_an_fp8_cache_holds_saturated_e4m3_and_is_attended_in_the_queries_dtype():
    """K/V stored into an e4m3 cache are their values rounded to e4m3 at scale 1, saturated at
    +-448 rather than NaN; attention over the cache computes exactly what it computes over those
    values in the queries' dtype, close to attention over the values before rounding."""
    lengths, ring = [1, 5, 23, 37], 16
    k8, v8, tables, _ = paged_setup(lengths, ring, dtype=KV_FP8)
    k32, v32, _, _ = paged_setup(lengths, ring)  # the same seed: the same values in the same pages
    assert k8.dtype == KV_FP8 and torch.equal(k8.float(), k32.to(KV_FP8).float())
    assert not torch.equal(k8.float(), k32), "e4m3 rounds"

    q = torch.randn(len(lengths), 4, 8)
    args = (tables, torch.arange(4), torch.tensor(lengths, dtype=torch.int32), 0.3, ring, 6)
    out = paged_attention_reference(q, k8, v8, *args)
    assert torch.equal(out, paged_attention_reference(q, k8.float(), v8.float(), *args))
    torch.testing.assert_close(out, paged_attention_reference(q, k32, v32, *args), rtol=0.1, atol=0.1)

    slots = torch.tensor([5, 9])
    huge = torch.tensor([1e3, -1e6, 2.0, 0.5]).repeat(8).reshape(2, 2, 8)  # [tokens, kv heads, D]
    store_kv(k8, v8, huge, -huge, slots)
    for cache, sign in ((k8, 1), (v8, -1)):
        read = gather_kv(cache, slots, torch.float32)
        assert torch.equal(read, sign * huge.clamp(-448, 448)), "saturated, and 2.0, 0.5 exact in e4m3"


def hf_gemma3_mask(token_type_ids, window):
    """transformers' own composition: full = causal | same image block, sliding = that & window."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    blocks = get_block_sequence_ids_for_mask(token_type_ids[None])
    full = or_masks(causal_mask_function, blockwise_overlay(blocks))
    sliding = and_masks(full, sliding_window_overlay(window))
    n = token_type_ids.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    b = torch.zeros((), dtype=torch.long)
    return full(b, b, i, j), sliding(b, b, i, j)


def test_prefill_masks_match_transformers():
    types = [torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0]), torch.tensor([0, 1, 1, 1, 1, 0, 0])]
    layout = pack_layout([len(t) for t in types], "cpu")
    groups = torch.full((2, layout.max_len), -1)
    for b, t in enumerate(types):
        starts = (t == 1) & ~torch.cat([torch.tensor([False]), t[:-1] == 1])
        groups[b, : len(t)] = torch.where(t == 1, torch.cumsum(starts.long(), 0) - 1, -1)
    full, sliding = gemma3_prefill_masks(layout, groups, window=3)
    for b, t in enumerate(types):
        want_full, want_sliding = hf_gemma3_mask(t, 3)
        n = len(t)
        assert torch.equal(full[b, 0, :n, :n], want_full)
        assert torch.equal(sliding[b, 0, :n, :n], want_sliding)
        assert full[b, 0, n:].all()  # padding rows see everything (no NaN rows)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # 4, 2 and 1 query heads per KV head
def test_packed_prefill_matches_per_sequence_attention(kv_heads):
    lengths = [5, 9, 2]
    layout = pack_layout(lengths, "cpu")
    groups = torch.full((3, 9), -1)
    groups[1, 2:6] = 0
    full, _ = gemma3_prefill_masks(layout, groups, window=None)
    n = sum(lengths)
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, kv_heads, 8), torch.randn(n, kv_heads, 8)
    out = prefill_attention(q, k, v, layout, full, scale=0.25)
    start = 0
    for b, length in enumerate(lengths):
        rows = slice(start, start + length)
        want = dense_attention(
            q[rows].transpose(0, 1),
            k[rows].transpose(0, 1),
            v[rows].transpose(0, 1),
            full[b, 0, :length, :length],
            0.25,
        )
        torch.testing.assert_close(out[rows], want.transpose(0, 1), rtol=1e-5, atol=1e-5)
        start += length


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_rows_gathered_as_words_are_the_rows_indexed(dtype):
    x = torch.randn(40, 8, 16).to(dtype)
    tokens, heads = torch.randint(0, 40, (3, 4, 5)), torch.randint(0, 8, (3, 4, 5))
    for view in (x, x.transpose(0, 1)[:, :, :], x[:, :, 1:], x[1:]):  # aligned, strided, odd columns, offset
        got = gather_rows(view, tokens % view.shape[0], heads % view.shape[1])
        assert got.dtype == dtype and torch.equal(got, view[tokens % view.shape[0], heads % view.shape[1]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, ring, softcap", [(None, 16, None), (6, 3, None), (9, 4, 30.0)])
def test_triton_kernel_matches_reference(dtype, window, ring, softcap):
    lengths = [1, 5, 23, 37, 64]
    k_cache, v_cache, tables, _ = paged_setup(lengths, ring, kv_heads=4, dim=256)
    q = torch.randn(len(lengths), 8, 256)
    args = (
        tables,
        torch.arange(len(lengths)),
        torch.tensor(lengths, dtype=torch.int32),
        256**-0.5,
        ring,
        window,
        softcap,
    )
    want = paged_attention_reference(q, k_cache, v_cache, *args)
    cuda = [x.to("cuda") if isinstance(x, torch.Tensor) else x for x in args]
    out = paged_attention(q.to("cuda", dtype), k_cache.to("cuda", dtype), v_cache.to("cuda", dtype), *cuda)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), want, rtol=tolerance, atol=tolerance)


def tiled_queries(lengths, suffix, tokens):
    """The last suffix[b] positions of each sequence as packed query tokens: rows [N], context
    lengths [N] int32 (position + 1), tiles (first, count, tokens) of at most `tokens`
    consecutive tokens plus two padding tiles (count 0) as a CUDA graph's bucket leaves, and
    ends [N] int32 where a suffix of 4 or more starts with a 3-token image (its tokens see it all)."""
    rows, lens, ends, first, count = [], [], [], [], []
    for b, (length, s) in enumerate(zip(lengths, suffix, strict=True)):
        start = len(rows)
        rows += [b] * s
        positions = range(length - s, length)
        lens += [p + 1 for p in positions]
        image_end = length - s + 3 if s >= 4 else 0
        ends += [max(p + 1, image_end) for p in positions]
        first += range(start, start + s, tokens)
        count += [min(tokens, s - k) for k in range(0, s, tokens)]
    tiles = (torch.tensor(first + [0, 0]), torch.tensor(count + [0, 0]), tokens)
    return torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), tiles, torch.tensor(ends, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window, ring, softcap", [(None, 16, None), (6, 3, None), (9, 4, 30.0)])
def test_triton_tiled_prefill_matches_reference(window, ring, softcap):
    # Prefill tokens whose keys are all paged, 8 or 3 tokens a tile, against one-at-a-time.
    lengths, suffix = [1, 5, 23, 37, 64], [1, 5, 5, 4, 5]
    k_cache, v_cache, tables, _ = paged_setup(lengths, ring, kv_heads=4, dim=256)
    for tokens in (8, 3):
        rows, lens, tiles, ends = tiled_queries(lengths, suffix, tokens)
        q = torch.randn(len(rows), 8, 256)
        args = (tables, rows, lens, 256**-0.5, ring, window, softcap)
        want = paged_attention_reference(q, k_cache, v_cache, *args, ends=ends)
        cuda = [x.to("cuda") if isinstance(x, torch.Tensor) else x for x in args]
        cuda_tiles = (tiles[0].cuda(), tiles[1].cuda(), tokens)
        kv = k_cache.to("cuda", torch.bfloat16), v_cache.to("cuda", torch.bfloat16)
        out = paged_attention(q.to("cuda", torch.bfloat16), *kv, *cuda, cuda_tiles, ends.cuda())
        torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("window, ring, softcap", [(None, 16, None), (6, 3, None), (9, 4, 30.0)])
def test_triton_kernel_reads_an_fp8_cache_as_the_reference_does(window, ring, softcap):
    # Decode tokens and prefill tiles over an e4m3 cache, bf16 queries.
    lengths, suffix = [1, 5, 23, 37, 64], [1, 5, 5, 4, 5]
    k_cache, v_cache, tables, _ = paged_setup(lengths, ring, kv_heads=4, dim=256, dtype=KV_FP8)
    kv = k_cache.cuda(), v_cache.cuda()
    for tokens in (1, 8):
        rows, lens, tiles, ends = tiled_queries(lengths, [1] * 5 if tokens == 1 else suffix, tokens)
        q = torch.randn(len(rows), 8, 256)
        args = (tables, rows, lens, 256**-0.5, ring, window, softcap)
        want = paged_attention_reference(q, k_cache, v_cache, *args, ends=ends)
        cuda = [x.to("cuda") if isinstance(x, torch.Tensor) else x for x in args]
        cuda_tiles = (tiles[0].cuda(), tiles[1].cuda(), tokens) if tokens > 1 else None
        out = paged_attention(q.to("cuda", torch.bfloat16), *kv, *cuda, cuda_tiles, ends.cuda())
        torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, KV_FP8])
def test_the_cuda_store_writes_the_values_the_cpu_store_writes(dtype):
    # One launch for k and v on CUDA: the values two index_copy_ (and, for e4m3, a saturating
    # cast) write on the CPU, on rows of a wider q/k/v output as the decoder hands them over.
    # NaN stays NaN (its e4m3 sign bit may differ: the CPU writes 0xff, the GPU 0x7f).
    gen = torch.Generator().manual_seed(3)
    pages, kv_heads, dim, tokens = 40, 4, 256, 37
    row = kv_heads * dim
    fused = (torch.randn(tokens, 3 * row, generator=gen) * 300).to(torch.bfloat16)  # q, k, v
    for start in (row, 2 * row):  # k's and v's first values: past e4m3's range, and not finite
        fused[0, start : start + 5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -1e-9])
    k, v = (fused[:, i * row : (i + 1) * row].view(tokens, kv_heads, dim) for i in (1, 2))
    assert k.stride(0) == 3 * row, "views: rows contiguous, tokens strided"
    slots = torch.randperm(pages * BLOCK, generator=gen)[:tokens]
    storage = torch.uint8 if dtype == KV_FP8 else dtype
    caches = [torch.zeros(pages, BLOCK, kv_heads, dim, dtype=storage).view(dtype) for _ in range(4)]
    store_kv(caches[0], caches[1], k, v, slots)
    on_gpu = [c.cuda() for c in caches[2:]]
    store_kv(*on_gpu, k.cuda(), v.cuda(), slots.cuda())
    for cpu, gpu in zip(caches[:2], on_gpu, strict=True):
        torch.testing.assert_close(gpu.cpu().float(), cpu.float(), rtol=0, atol=0, equal_nan=True)
        assert gpu.float().isnan().sum() == 1, "the NaN kept, as NaN"


INTERPRETED = """
import torch
from tests.test_ops_attention import paged_setup, tiled_queries
from wicore.ops.attention import KV_FP8, paged_attention_reference
from wicore.ops.attention.paged_triton import paged_attention_triton

for dtype in (torch.float32, torch.float16):  # the interpreter mis-handles bf16 tl.dot
    for fp8 in (False, True):  # FP8 pages read as the queries' dtype
        for window, ring, softcap in [(None, 16, None), (6, 3, None), (9, 4, 30.0)]:
            lengths = [1, 5, 23, 37, 64]
            k, v, tables, _ = paged_setup(lengths, ring, kv_heads=2, dim=24, dtype=KV_FP8 if fp8 else torch.float32)
            k32, v32 = k.float(), v.float()
            k, v = (k, v) if fp8 else (k.to(dtype), v.to(dtype))
            q = torch.randn(len(lengths), 4, 24)
            args = (tables, torch.arange(5), torch.tensor(lengths, dtype=torch.int32), 0.2, ring, window, softcap)
            want = paged_attention_reference(q, k32, v32, *args)
            got = paged_attention_triton(q.to(dtype), k, v, *args)
            torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
            # Prefill tiles: the last few positions of each sequence (a ring keeps the window).
            rows, lens, tiles, ends = tiled_queries(lengths, [1, 5, 5, 4, 5], 3)
            q = torch.randn(len(rows), 4, 24)
            args = (tables, rows, lens, 0.2, ring, window, softcap)
            want = paged_attention_reference(q, k32, v32, *args, ends=ends)
            got = paged_attention_triton(q.to(dtype), k, v, *args, tiles, ends)
            torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
print("ok")
"""


@pytest.mark.slow
def test_triton_kernel_in_the_interpreter():
    # The Triton kernel's logic on CPU (TRITON_INTERPRET=1 must be set before triton loads).
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    import numpy as np

    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        # Loop bounds read from memory reach int() as 1-element arrays there.
        pytest.skip(
            "triton 3.6's interpreter needs numpy < 2.4 (e.g. `pip install --target D numpy==2.2.*`, PYTHONPATH=D)"
        )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
