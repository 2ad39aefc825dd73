"""Diagnostic: decode paged attention with the keys split across programs (flash-decoding) and a
combine kernel; and a Triton K/V store against index_copy_. Gemma-3-4B decoder shape."""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(__file__))
from paged_fp8 import _kernel, run as run_single, timed
from wicore.ops.attention.paged_triton import _page_rows, _scores, paged_attention_triton
from wicore.ops.attention.paged import paged_attention_reference, store_kv


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, tables_ptr, rows_ptr, lens_ptr, scale, ring,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tr,
                  HEAD_DIM: tl.constexpr, QPK: tl.constexpr, HQ: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, CONVERT: tl.constexpr):
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + tok)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    table_row = tl.load(rows_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_r < QPK
    heads = kv_head * QPK + offs_r % QPK
    q = tl.load(q_ptr + tok * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    if CONVERT == 1:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        in_range = pos < hi
        pages = tl.load(tables_ptr + table_row * stride_tr + (pos // PAGE) % ring, mask=in_range, other=0).to(tl.int64)
        k = _page_rows(k_ptr, pages, pos % PAGE, kv_head, stride_kp, stride_ks, stride_kh, offs_d, in_range[:, None]).to(q.dtype)
        s = _scores(q, k, scale, 1.0, False, "tf32")
        s = tl.where(in_range[None, :], s, float("-inf"))
        v = _page_rows(v_ptr, pages, pos % PAGE, kv_head, stride_vp, stride_vs, stride_vh, offs_d, in_range[:, None]).to(q.dtype)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32")
        m_i = m_new
    # partials [N, HQ, SPLITS, D] and (m, l) [N, HQ, SPLITS, 2]
    base = (tok * HQ + heads) * SPLITS + split
    tl.store(part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=row_valid)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, HQ: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    tok = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    base = (tok * HQ + h) * SPLITS + sp
    m = tl.load(ml_ptr + base * 2)
    l = tl.load(ml_ptr + base * 2 + 1)
    m_all = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_ptr + base[:, None] * HEAD_DIM + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + tok * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def run_split(q, kc, vc, tables, rows, lens, out, part, ml, bn, warps, stages, splits, convert):
    N = q.shape[0]
    _split_kernel[(N, kc.shape[2], splits)](
        q, kc, vc, part, ml, tables, rows, lens, 256**-0.5, tables.shape[1], *q.stride()[:2], *kc.stride()[:3], *vc.stride()[:3],
        tables.stride(0), HEAD_DIM=256, QPK=2, HQ=8, BLOCK_Q=16, PAGE=16, BLOCK_N=bn, SPLITS=splits, CONVERT=convert,
        num_warps=warps, num_stages=stages)
    _combine_kernel[(N, 8)](part, ml, out, *out.stride()[:2], HQ=8, HEAD_DIM=256, SPLITS=splits, num_warps=4)


@triton.jit
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr,
                  FP8: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + tok * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + tok * stride_v + offs, mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(kc_ptr + slot * ROW + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * ROW + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_triton(kc, vc, k, v, slots, warps):
    _store_kernel[(k.shape[0],)](k, v, kc, vc, slots, k.stride(0), v.stride(0), ROW=1024, BLOCK=1024,
                                 FP8=kc.dtype == torch.float8_e4m3fn, num_warps=warps)


results = {}
g = torch.Generator(device="cuda").manual_seed(0)
for N in (169, 384):
    T = 24
    pages = N * T + 1
    perm = torch.randperm(pages - 1, generator=g, device="cuda")[: N * T].view(N, T).int() + 1
    kc = (torch.randn(pages, 16, 4, 256, device="cuda", generator=g) * 2).bfloat16()
    vc = torch.randn(pages, 16, 4, 256, device="cuda", generator=g).bfloat16()
    k8, v8 = kc.clamp(-448, 448).to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    q = torch.randn(N, 8, 256, device="cuda", generator=g).bfloat16()
    lens = torch.randint(276, 341, (N,), device="cuda", generator=g).int()
    rows = torch.arange(N, device="cuda").int()
    out = torch.empty_like(q)
    prod = lambda kk, vv: paged_attention_triton(q, kk, vv, perm, rows, lens, 256**-0.5, T)
    ref16, ref8 = prod(kc, vc).float(), paged_attention_reference(q, k8, v8, perm, rows, lens, 256**-0.5, T).float()
    r = {"product bf16 pages": timed(lambda: prod(kc, vc)), "product fp8 pages": timed(lambda: prod(k8, v8)),
         "single fp8 bn128 w4 s2 conv1": timed(lambda: run_single(q, k8, v8, perm, rows, lens, out, 128, 4, 2, 1))}
    for splits in (2, 4, 8):
        part = torch.empty(N, 8, splits, 256, device="cuda")
        ml = torch.empty(N, 8, splits, 2, device="cuda")
        for bn, w, s in [(32, 4, 3), (64, 4, 2), (32, 4, 2), (64, 4, 3), (128, 4, 2)]:
            for name, kk, vv, convert, ref in (("bf16", kc, vc, 0, ref16), ("fp8", k8, v8, 1, ref8)):
                key = f"split{splits} {name} bn{bn} w{w} s{s}"
                try:
                    run_split(q, kk, vv, perm, rows, lens, out, part, ml, bn, w, s, splits, convert)
                    torch.cuda.synchronize()
                    r[key + " maxerr"] = round(float((out.float() - ref).abs().max()), 4)
                    r[key] = timed(lambda: run_split(q, kk, vv, perm, rows, lens, out, part, ml, bn, w, s, splits, convert))
                except Exception as exc:  # noqa
                    r[key] = "error: " + (str(exc).splitlines() or [type(exc).__name__])[0][:120]
    slots = torch.randperm(pages * 16, generator=g, device="cuda")[:N].long()
    newk = torch.randn(N, 4, 256, device="cuda", generator=g).bfloat16() * 300
    newv = torch.randn(N, 4, 256, device="cuda", generator=g).bfloat16()
    r["store bf16 index_copy"] = timed(lambda: store_kv(kc, vc, newk, newv, slots))
    r["store fp8 index_copy"] = timed(lambda: store_kv(k8, v8, newk, newv, slots))
    a16, a8 = (kc.clone(), vc.clone()), (k8.clone(), v8.clone())
    for w in (4, 8):
        r[f"store bf16 triton w{w}"] = timed(lambda: store_triton(kc, vc, newk, newv, slots, w))
        r[f"store fp8 triton w{w}"] = timed(lambda: store_triton(k8, v8, newk, newv, slots, w))
    store_kv(*a16, newk, newv, slots); store_kv(*a8, newk, newv, slots)
    store_triton(kc, vc, newk, newv, slots, 4); store_triton(k8, v8, newk, newv, slots, 4)
    r["store bytes equal bf16"] = bool(torch.equal(a16[0].view(torch.int16), kc.view(torch.int16)) and torch.equal(a16[1].view(torch.int16), vc.view(torch.int16)))
    r["store bytes equal fp8"] = bool(torch.equal(a8[0].view(torch.uint8), k8.view(torch.uint8)) and torch.equal(a8[1].view(torch.uint8), v8.view(torch.uint8)))
    results[f"N={N}"] = r
    for k_, v_ in r.items():
        print(f"N={N} {k_:45s} {round(v_, 2) if isinstance(v_, float) else v_}", flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "paged_split.json"), "w"), indent=1)
