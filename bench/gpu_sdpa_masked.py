"""Masked SDPA backends at the shapes of follow-up prefills (issue 5, bench/NOTES.md): host and
device ms a call when every call has a new batch size, as in the engine.

    python bench/gpu_sdpa_masked.py
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def case(backend, batch: int, lq: int, lk: int) -> tuple[float, float]:
    q = torch.randn(batch, 8, lq, 256, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, lk, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(batch, 1, lq, lk, device="cuda") < 0.9
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    with sdpa_kernel([backend]):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.0625)
    end.record()
    host = (time.perf_counter() - host) * 1e3
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
    for lq, lk in ((34, 290), (290, 290)):
        try:
            case(backend, 7, lq, lk)  # first call: library set-up
            rows = [case(backend, b, lq, lk) for b in range(20, 40)]  # a new shape each call
            host = sorted(r[0] for r in rows)[len(rows) // 2]
            device = sorted(r[1] for r in rows)[len(rows) // 2]
            print(f"{backend.name:20s} Lq {lq:3d} Lk {lk}: host {host:6.2f} ms, device {device:6.2f} ms (median)")
        except RuntimeError as error:
            print(f"{backend.name:20s} Lq {lq:3d} Lk {lk}: not available ({str(error)[:80]})")
