"""Diagnostic: the decode step's paged attention alone on bf16 pages and FP8 (e4m3) pages, Gemma-3-4B's
decoder shape (8 q heads, 4 kv heads, head dim 256, pages of 16), ~313 keys a sequence; with the
FP8 tiles converted as the product does (.to(bf16)), through fp16 (one cvt per two values), and
with other tiles/stages/warps. Also the K/V store (index_copy) per layer."""
import json, os, statistics, sys
import torch
import triton
import triton.language as tl
from wicore.ops.attention.paged_triton import _tile_span, _page_rows, _scores, _online_softmax, paged_attention_triton
from wicore.ops.attention.paged import paged_attention_reference, store_kv


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, rows_ptr, lens_ptr, scale, ring,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ob, stride_oh, stride_tr,
            HEAD_DIM: tl.constexpr, QPK: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
            CONVERT: tl.constexpr):
    kv_head = tl.program_id(1)
    tok = tl.program_id(0)
    length = tl.load(lens_ptr + tok)
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
    for tile in range(0, length, BLOCK_N):
        pos = tile + offs_n
        in_range = pos < length
        pages = tl.load(tables_ptr + table_row * stride_tr + (pos // PAGE) % ring, mask=in_range, other=0).to(tl.int64)
        kv_mask = in_range[:, None]
        k = _page_rows(k_ptr, pages, pos % PAGE, kv_head, stride_kp, stride_ks, stride_kh, offs_d, kv_mask).to(q.dtype)
        s = _scores(q, k, scale, 1.0, False, "tf32")
        v = _page_rows(v_ptr, pages, pos % PAGE, kv_head, stride_vp, stride_vs, stride_vh, offs_d, kv_mask).to(q.dtype)
        m_i, l_i, acc = _online_softmax(tl.where(in_range[None, :], s, float("-inf")), v, m_i, l_i, acc, "tf32")
    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None])


def run(q, kc, vc, tables, rows, lens, out, bn, warps, stages, convert):
    _kernel[(q.shape[0], kc.shape[2])](
        q, kc, vc, out, tables, rows, lens, 256**-0.5, tables.shape[1], *q.stride()[:2], *kc.stride()[:3], *vc.stride()[:3],
        *out.stride()[:2], tables.stride(0), HEAD_DIM=256, QPK=2, BLOCK_Q=16, PAGE=16, BLOCK_N=bn, CONVERT=convert,
        num_warps=warps, num_stages=stages)


def timed(fn, n=50):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n): fn()
        b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / n)
    return statistics.median(ts)


def main():
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
        ref = paged_attention_reference(q[:8], k8[:], v8, perm, rows[:8], lens[:8], 256**-0.5, T)
        prod = lambda kk, vv: paged_attention_triton(q, kk, vv, perm, rows, lens, 256**-0.5, T)
        r = {"product bf16 pages": timed(lambda: prod(kc, vc)), "product fp8 pages": timed(lambda: prod(k8, v8))}
        for bn, w, s in [(32, 4, 3), (64, 4, 3), (64, 4, 2), (128, 4, 2), (64, 8, 3), (32, 4, 4), (128, 8, 3)]:
            for convert in (0, 1):
                for name, kk, vv in (("bf16", kc, vc), ("fp8", k8, v8)):
                    if name == "bf16" and convert == 1:
                        continue
                    key = f"{name} bn{bn} w{w} s{s} conv{convert}"
                    try:
                        run(q, kk, vv, perm, rows, lens, out, bn, w, s, convert)
                        torch.cuda.synchronize()
                        err = float(((out[:8].float() - ref.float()).abs().max()) if name == "fp8" else 0.0)
                        r[key] = round(timed(lambda: run(q, kk, vv, perm, rows, lens, out, bn, w, s, convert)), 2)
                        r[key + " maxerr"] = round(err, 4)
                    except Exception as exc:  # noqa
                        r[key] = "error: " + (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        slots = (perm[:, 0].long() * 16)
        newk = torch.randn(N, 4, 256, device="cuda", generator=g).bfloat16()
        r["store bf16 (index_copy x2)"] = timed(lambda: store_kv(kc, vc, newk, newk, slots))
        k8u, v8u = k8.view(torch.uint8).view(torch.float8_e4m3fn), v8.view(torch.uint8).view(torch.float8_e4m3fn)
        r["store fp8 (clamp, cast, index_copy x2)"] = timed(lambda: store_kv(k8u, v8u, newk, newk, slots))
        results[f"N={N}"] = r
        for k_, v_ in r.items():
            print(f"N={N} {k_:45s} {v_ if isinstance(v_, str) else round(v_, 3)}", flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "paged_fp8.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
