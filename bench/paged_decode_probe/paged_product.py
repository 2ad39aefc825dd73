"""Diagnostic: the product's paged decode kernel and K/V store, device time (torch.profiler), bf16
pages against FP8 pages with fp16 tiles at several (keys a tile, stages); the store through
index_copy_ against the Triton store."""
import json, os, sys
import torch
from torch.profiler import profile, ProfilerActivity
import wicore.ops.attention.paged_triton as pt
from wicore.ops.attention.paged import paged_attention_reference, store_kv, paged_attention


def device_us(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    return round(sum(e.device_time_total for e in prof.key_averages()) / n, 2)


results = {}
g = torch.Generator(device="cuda").manual_seed(0)
original_fp16, original_store = pt._fp16_tiles, pt.store_kv_triton
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
    ref = paged_attention_reference(q, k8, v8, perm, rows, lens, 256**-0.5, T).float()
    att = lambda kk, vv: paged_attention(q, kk, vv, perm, rows, lens, 256**-0.5, T)
    r = {"attn bf16 pages": device_us(lambda: att(kc, vc))}
    pt._fp16_tiles = lambda q, k: False
    r["attn fp8 pages, bf16 tiles (before)"] = device_us(lambda: att(k8, v8))
    r["maxerr fp8 bf16 tiles"] = float((att(k8, v8).float() - ref).abs().max())
    pt._fp16_tiles = original_fp16
    for tile in [(32, 3), (64, 3), (64, 4), (128, 2), (128, 3), (256, 2)]:
        pt.FP8_TILE = tile
        try:
            r[f"attn fp8 pages, fp16 tiles {tile}"] = device_us(lambda: att(k8, v8))
            r[f"maxerr fp16 tiles {tile}"] = float((att(k8, v8).float() - ref).abs().max())
        except Exception as exc:  # noqa
            r[f"attn fp8 pages, fp16 tiles {tile}"] = "error: " + str(exc).splitlines()[0][:100]
    pt.FP8_TILE = (128, 2)
    for M in (N, 2048):
        slots = torch.randperm(pages * 16, generator=g, device="cuda")[:M].long()
        newk = torch.randn(M, 4, 256, device="cuda", generator=g).bfloat16() * 300
        newv = torch.randn(M, 4, 256, device="cuda", generator=g).bfloat16()
        for name, caches in (("bf16", (kc, vc)), ("fp8", (k8, v8))):
            pt.store_kv_triton = lambda *a: False
            r[f"store {name} M={M} index_copy"] = device_us(lambda: store_kv(*caches, newk, newv, slots))
            before = [c.clone() for c in caches]
            store_kv(*before, newk, newv, slots)
            pt.store_kv_triton = original_store
            r[f"store {name} M={M} triton"] = device_us(lambda: store_kv(*caches, newk, newv, slots))
            store_kv(*caches, newk, newv, slots)
            r[f"store {name} M={M} bytes equal"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, caches))
    results[f"N={N}"] = r
    for k_, v_ in r.items():
        print(f"N={N} {k_:45s} {v_}", flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "paged_product.json"), "w"), indent=1)
