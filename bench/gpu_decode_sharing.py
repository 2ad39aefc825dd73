"""Does the decode attention kernel read a shared prefix once when its sharers sit next to each
other in the batch? One 4B full-attention layer (4 KV heads, head_dim 256, bf16, pages of 16),
296 sequences of 320 context tokens, groups of sequences sharing the pages of their first 272
tokens (an image question's prefix), laid out in the batch next to each other or far apart.
The kernel's programs run in batch order (program id 0 fastest), so adjacent sharers read the
same pages at about the same time and L2 can serve the second read.

    python bench/gpu_decode_sharing.py     # on the GPU machine; prints a table, $OUT/decode_sharing.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from wicore.ops.attention.paged_triton import paged_attention_triton

SEQS, CONTEXT, SHARED, PAGE, KV_HEADS, Q_HEADS, DIM = 296, 320, 272, 16, 4, 8, 256


def layout(group: int, adjacent: bool) -> list[int]:
    """Group id of each batch position: sharers adjacent (0 0 0 0 1 1 1 1 ...) or spread
    (0 1 2 ... 0 1 2 ...: members SEQS / group positions apart)."""
    groups = SEQS // group
    return [i // group if adjacent else i % groups for i in range(SEQS)]


def tables(owner: list[int]) -> tuple[torch.Tensor, int]:
    """Block tables [SEQS, pages]: a group's shared pages, then each sequence's own."""
    shared, own = SHARED // PAGE, -(-CONTEXT // PAGE) - SHARED // PAGE
    group_pages: dict[int, list[int]] = {}
    next_page, rows = 1, []
    for g in owner:
        if g not in group_pages:
            group_pages[g] = list(range(next_page, next_page + shared))
            next_page += shared
        rows.append(group_pages[g] + list(range(next_page, next_page + own)))
        next_page += own
    return torch.tensor(rows, dtype=torch.int32, device="cuda"), next_page


def time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def main() -> None:
    torch.manual_seed(0)
    token_bytes = 2 * KV_HEADS * DIM * 2  # K and V, bf16
    rows = []
    for name, group, adjacent in [
        ("distinct", 1, True),
        ("pairs adjacent", 2, True),
        ("pairs spread", 2, False),
        ("quads adjacent", 4, True),
        ("quads spread", 4, False),
    ]:
        owner = layout(group, adjacent)
        table, pages = tables(owner)
        k = torch.randn(pages, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(SEQS, Q_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        seq_rows = torch.arange(SEQS, device="cuda")
        lens = torch.full((SEQS,), CONTEXT, dtype=torch.int32, device="cuda")
        ring = table.shape[1]
        args = (q, k, v, table, seq_rows, lens, DIM**-0.5, ring)
        us = time_us(lambda args=args: paged_attention_triton(*args))
        read = SEQS * CONTEXT * token_bytes  # what the programs load
        unique = (pages - 1) * PAGE * token_bytes  # what DRAM must deliver at least
        rows.append(
            {
                "layout": name,
                "us_per_layer": round(us, 1),
                "loaded_GB_per_s": round(read / us / 1e3, 1),
                "unique_MB": round(unique / 1e6, 1),
                "unique_GB_per_s": round(unique / us / 1e3, 1),
            }
        )
        print(rows[-1], flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_sharing.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
