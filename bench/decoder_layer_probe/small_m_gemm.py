"""Diagnostic: FP8 rowwise GEMMs at decode row counts (Gemma-3-4B's decoder shapes), device time:
torch._scaled_mm as the product calls it, the same with operands swapped (W @ x^T), and a Triton
split-K kernel."""
import json, os
import torch
import triton
import triton.language as tl
from torch.profiler import profile, ProfilerActivity


@triton.jit
def _mm(x, w, sx, sw, out, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pm * BM + tl.arange(0, BM)
    n = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    per = K // SPLIT
    for k0 in range(ps * per, (ps + 1) * per, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(x + m[:, None] * K + k[None, :], mask=m[:, None] < M, other=0.0)
        b = tl.load(w + n[None, :] * K + k[:, None])  # w [N, K] row-major: b [BK, BN] K-major
        acc = tl.dot(a, b, acc)
    acc = acc * tl.load(sx + m, mask=m < M, other=0.0)[:, None] * tl.load(sw + n)[None, :]
    if SPLIT == 1:
        tl.store(out + m[:, None] * N + n[None, :], acc.to(tl.bfloat16), mask=m[:, None] < M)
    else:
        tl.atomic_add(out + m[:, None] * N + n[None, :], acc, mask=m[:, None] < M, sem="relaxed")


def device_us(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages()) / n, 2)


shapes = {"qkv": (4096, 2560), "o": (2560, 2048), "gate_up": (20480, 2560), "down": (2560, 10240)}
res = {}
for M in (169, 176, 384):
    for name, (N, K) in shapes.items():
        x8 = (torch.randn(M, K, device="cuda") * 10).to(torch.float8_e4m3fn)
        w8 = (torch.randn(N, K, device="cuda") * 10).to(torch.float8_e4m3fn)
        sx, sw = torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
        ref = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
        r = {"bytes_MB": round((N * K + M * K) / 1e6, 1)}
        r["scaled_mm"] = device_us(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))
        swt = sw.t().contiguous(); sxt = sx.t().contiguous()
        try:
            r["scaled_mm swapped (W @ x^T)"] = device_us(lambda: torch._scaled_mm(w8, x8.t(), scale_a=swt, scale_b=sxt, out_dtype=torch.bfloat16, use_fast_accum=True))
        except Exception as exc:  # noqa
            r["scaled_mm swapped (W @ x^T)"] = "error: " + str(exc).splitlines()[0][:80]
        sxf, swf = sx.view(-1).contiguous(), sw.view(-1).contiguous()
        for bm, bn, bk, split, warps, stages in [(64, 128, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (64, 128, 128, 2, 4, 4),
                                                (64, 128, 128, 4, 4, 4), (64, 64, 256, 4, 4, 3), (128, 64, 128, 2, 8, 4),
                                                (64, 32, 256, 2, 4, 3)]:
            if K % (split * bk) or N % bn:
                continue
            key = f"triton bm{bm} bn{bn} bk{bk} split{split} w{warps} s{stages}"
            out = torch.zeros(M, N, device="cuda", dtype=torch.bfloat16 if split == 1 else torch.float32)
            grid = (triton.cdiv(M, bm), N // bn, split)
            def call():
                if split > 1:
                    out.zero_()
                _mm[grid](x8, w8, sxf, swf, out, M, N, K, BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
                return out
            try:
                got = call().float()
                err = float((got - ref.float()).abs().max() / ref.float().abs().max())
                r[key] = device_us(call)
                r[key + " relerr"] = round(err, 4)
            except Exception as exc:  # noqa
                r[key] = "error: " + (str(exc).splitlines() or [type(exc).__name__])[0][:100]
        res[f"M={M} {name}"] = r
        print(f"M={M} {name} {N}x{K}:", {k: v for k, v in r.items() if 'relerr' not in k}, flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "small_m_gemm.json"), "w"), indent=1)
