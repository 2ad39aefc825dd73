"""Diagnostic: decode paged attention over FP8 pages, tile math variants:
MODE 1: q, k, v in fp16 (k, v converted after the load: one cvt per two values);
MODE 4: QK^T on FP8 tensor cores (q quantized per row in the kernel), k never converted; v to fp16;
MODE 5: both products in FP8 (p scaled by 256 to e4m3)."""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(__file__))
from paged_fp8 import timed
from wicore.ops.attention.paged_triton import paged_attention_triton
from wicore.ops.attention.paged import paged_attention_reference


@triton.jit
def _k(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, rows_ptr, lens_ptr, scale, ring,
       stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ob, stride_oh, stride_tr,
       HEAD_DIM: tl.constexpr, QPK: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
       MODE: tl.constexpr):
    kv_head = tl.program_id(1)
    tok = tl.program_id(0)
    length = tl.load(lens_ptr + tok)
    table_row = tl.load(rows_ptr + tok).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_r < QPK
    heads = kv_head * QPK + offs_r % QPK
    q = tl.load(q_ptr + tok * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    q_descale = tl.full([BLOCK_Q], 1.0, tl.float32)
    if MODE == 1:
        q = q.to(tl.float16)
    else:
        qf = q.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-12)
        q = (qf * (448.0 / amax)[:, None]).to(tl.float8e4nv)
        q_descale = amax / 448.0
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(0, length, BLOCK_N):
        pos = tile + offs_n
        in_range = pos < length
        pages = tl.load(tables_ptr + table_row * stride_tr + (pos // PAGE) % ring, mask=in_range, other=0).to(tl.int64)
        slots = pos % PAGE
        k = tl.load(k_ptr + pages[:, None] * stride_kp + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        if MODE == 1:
            k = k.to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * (q_descale * scale)[:, None]
        s = tl.where(in_range[None, :], s, float("-inf"))
        v = tl.load(v_ptr + pages[:, None] * stride_vp + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MODE == 5:
            acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        m_i = m_new
    if MODE == 5:
        acc = acc / 256.0
    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


def run(q, kc, vc, tables, rows, lens, out, bn, warps, stages, mode):
    _k[(q.shape[0], kc.shape[2])](
        q, kc, vc, out, tables, rows, lens, 256**-0.5, tables.shape[1], *q.stride()[:2], *kc.stride()[:3], *vc.stride()[:3],
        *out.stride()[:2], tables.stride(0), HEAD_DIM=256, QPK=2, BLOCK_Q=16, PAGE=16, BLOCK_N=bn, MODE=mode,
        num_warps=warps, num_stages=stages)


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
    ref = paged_attention_reference(q, k8, v8, perm, rows, lens, 256**-0.5, T).float()
    prod = lambda kk, vv: paged_attention_triton(q, kk, vv, perm, rows, lens, 256**-0.5, T)
    r = {"product bf16 pages": timed(lambda: prod(kc, vc)), "product fp8 pages": timed(lambda: prod(k8, v8)),
         "product fp8 maxerr": float((prod(k8, v8).float() - ref).abs().max())}
    for mode in (1, 4, 5):
        for bn, w, s in [(128, 4, 2), (64, 4, 3), (64, 4, 4), (128, 8, 2), (32, 4, 4), (256, 8, 2), (128, 4, 3)]:
            key = f"mode{mode} bn{bn} w{w} s{s}"
            try:
                run(q, k8, v8, perm, rows, lens, out, bn, w, s, mode)
                torch.cuda.synchronize()
                r[key + " maxerr"] = round(float((out.float() - ref).abs().max()), 4)
                r[key] = timed(lambda: run(q, k8, v8, perm, rows, lens, out, bn, w, s, mode))
            except Exception as exc:  # noqa
                r[key] = "error: " + (str(exc).splitlines() or [type(exc).__name__])[0][:120]
    results[f"N={N}"] = r
    for k_, v_ in r.items():
        print(f"N={N} {k_:35s} {round(v_, 3) if isinstance(v_, float) else v_}", flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "paged_fp8b.json"), "w"), indent=1)
