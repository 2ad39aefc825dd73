"""The FP8 tower's quantizing passes alone at one vision batch (8 images: 32,768 rows), each at
several warp counts / rows a program: ms a call (CUDA events, median of 3 x 50), GB/s of their
bytes, and whether the outputs equal the product's configuration bit for bit."""
import json, os, sys
import torch, triton
sys.path.insert(0, ".")
from wicore.ops import fp8_triton as ft
from wicore.ops import fp8_attention_cuda as fc
from wicore.ops.fp8 import AMAX_FLOOR, E4M3_MAX
from wicore.ops.fp8_attention import MARGIN, SEEN_SLOTS

dev = torch.device("cuda"); torch.manual_seed(0)
M, N, FF, H, D, P = 32768, 1152, 4304, 16, 72, 128

def timeit(fn, n=50):
    out = []
    for _ in range(3):
        fn(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / n * 1000)
    return sorted(out)[1]

res = {"gpu": torch.cuda.get_device_name()}
# add + LayerNorm + quantize
x = torch.randn(M, N, device=dev, dtype=torch.bfloat16); pend = torch.randn_like(x)
w = torch.randn(N, device=dev, dtype=torch.bfloat16); bias = torch.randn_like(w)
def ln(nw):
    summed = torch.empty_like(x); q, s = ft.empty_quantized_rows(M, N, dev)
    split = ft._row_split(N); split["num_warps"] = nw
    fn = lambda: ft._add_layer_norm_quantize_kernel[(M,)](x, pend, summed, w, bias, q, s, N, 1e-6, AMAX_FLOOR, E4M3_MAX, HAS_PENDING=True, **split)
    return fn, (summed, q, s)
base = None
for nw in (4, 1, 2, 8):
    fn, outs = ln(nw); us = timeit(fn)
    same = None
    if base is None: base = [t.clone() for t in outs]
    else: same = all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a, b.view(torch.uint8) if b.dtype != torch.float32 else b) for a, b in zip(outs, base))
    res[f"add_ln_quant warps={nw}"] = {"us": us, "TB/s": M * N * 7 / us / 1e6, "same": same}
    print(f"add_ln_quant warps={nw}", res[f"add_ln_quant warps={nw}"], flush=True)
# GELU + quantize (fc1's output, bias)
h = torch.randn(M, FF, device=dev, dtype=torch.bfloat16); fb = torch.randn(FF, device=dev, dtype=torch.bfloat16)
base = None
for nw in (8, 4, 16):
    q, s = ft.empty_quantized_rows(M, FF, dev); split = ft._row_split(FF); split["num_warps"] = nw
    fn = lambda: ft._gelu_quantize_kernel[(M,)](h, fb, q, s, FF, h.stride(0), AMAX_FLOOR, E4M3_MAX, HAS_BIAS=True, GATED=False, **split)
    us = timeit(fn); same = None
    if base is None: base = (q.clone(), s.clone())
    else: same = torch.equal(q.view(torch.uint8), base[0].view(torch.uint8)) and torch.equal(s, base[1])
    res[f"gelu_quant warps={nw}"] = {"us": us, "TB/s": M * FF * 3 / us / 1e6, "same": same}
    print(f"gelu_quant warps={nw}", res[f"gelu_quant warps={nw}"], flush=True)
# pad + quantize q, k, v
qkv = torch.randn(M, 3 * H * D, device=dev, dtype=torch.bfloat16)
amax = qkv.float().abs().amax().repeat(3).contiguous()
for rows in (8, 4, 16):
    for nw in (4, 2, 8):
        out = torch.empty((3, M, H, P), dtype=torch.float8_e4m3fn, device=dev)
        seen = torch.zeros(3, SEEN_SLOTS, device=dev); scal = torch.zeros(6, device=dev)
        fn = lambda: fc._pad_quantize_kernel[(triton.cdiv(M, rows), 3)](qkv, out, amax, seen, scal, M, qkv.stride(0), out[0].numel(), AMAX_FLOOR, E4M3_MAX, MARGIN, SLOTS=SEEN_SLOTS, HEADS=H, HEAD_DIM=D, PADDED=P, BLOCK_M=rows, BLOCK_D=P, num_warps=nw)
        us = timeit(fn)
        res[f"pad_quant rows={rows} warps={nw}"] = {"us": us, "TB/s": (M * 3 * H * D * 2 + 3 * M * H * P) / us / 1e6}
        print(f"pad_quant rows={rows} warps={nw}", res[f"pad_quant rows={rows} warps={nw}"], flush=True)
# requantize O
o8 = (torch.randn(M, H, P, device=dev) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
scal = torch.ones(6, device=dev)
for rows in (8, 4, 16, 32):
    for nw in (4, 2, 8):
        out, os_ = ft.empty_quantized_rows(M, H * D, dev)
        fn = lambda: fc._requantize_kernel[(triton.cdiv(M, rows),)](o8, scal, out, os_, M, AMAX_FLOOR, E4M3_MAX, HEADS=H, HEAD_DIM=D, PADDED=P, BLOCK_M=rows, BLOCK_H=16, BLOCK_D=P, num_warps=nw)
        us = timeit(fn)
        res[f"requant rows={rows} warps={nw}"] = {"us": us, "TB/s": (M * H * P + M * H * D) / us / 1e6}
        print(f"requant rows={rows} warps={nw}", res[f"requant rows={rows} warps={nw}"], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "pass_tune_probe.json"), "w"), indent=1)
