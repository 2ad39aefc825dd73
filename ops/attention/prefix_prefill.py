"""Prefill of prompts whose first tokens' K/V are already in the cache (a prefix-cache hit).

Sequence b of a batch has K/V for positions [0, P_b) in its pages (the prefix) and computes
q/k/v for positions [P_b, P_b + S_b) (the suffix). Its queries attend over the keys of all
P_b + S_b positions: the prefix rows, gathered from the pages, followed by the suffix's own rows.
The masks are `ops.attention`'s Gemma-3 masks on absolute positions: a query at i sees key j when
j <= i or both lie in the same image's soft tokens, and on sliding layers also j > i - window.
With every P_b = 0 this is exactly `prefill_attention`.

Row order: `k_prefix` / `v_prefix` hold the prefix rows of every sequence, packed in batch order
([sum P, Hkv, D]); q / k / v hold the suffix rows, packed as usual ([sum S, H, D]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wicore.ops.attention import GroupedBatch, PackedBatch, group_batch, pack_layout
from wicore.ops.transfer import upload


@dataclass
class PrefixBatch:
    """The suffixes (the query rows, `queries`) and every sequence's keys, padded to [B, Lk]."""

    queries: PackedBatch  # lengths S_b, padded [B, Lq]
    prefix_lens: torch.Tensor  # [B] int64 P_b
    key_gather: torch.Tensor  # [B, Lk] int64 row in cat(prefix rows, suffix rows); padding -> 0

    @property
    def key_len(self) -> int:
        return self.key_gather.shape[1]


def prefix_layout(prefix_lens: list[int], suffix_lens: list[int], device: torch.device | str) -> PrefixBatch:
    """Layout of a batch whose sequence b has `prefix_lens[b]` cached and `suffix_lens[b]` (>= 1)
    new tokens."""
    if any(s < 1 for s in suffix_lens) or any(p < 0 for p in prefix_lens):
        raise ValueError(f"bad prefix/suffix lengths {prefix_lens} / {suffix_lens}")
    p, s = torch.tensor(prefix_lens, dtype=torch.int64), torch.tensor(suffix_lens, dtype=torch.int64)
    total = p + s
    cols = torch.arange(int(total.max()))[None, :]  # [1, Lk]
    prefix_start = (torch.cumsum(p, 0) - p)[:, None]  # first prefix row of each sequence
    suffix_start = (int(p.sum()) + torch.cumsum(s, 0) - s)[:, None]  # first suffix row
    in_prefix = cols < p[:, None]
    valid = cols < total[:, None]
    gather = torch.where(in_prefix, prefix_start + cols, suffix_start + cols - p[:, None])
    gather = torch.where(valid, gather, torch.zeros((), dtype=torch.int64))
    return PrefixBatch(pack_layout(suffix_lens, device), upload(p, device), upload(gather, device))


def gemma3_prefix_masks(
    batch: PrefixBatch, key_groups: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks [B, 1, Lq, Lk] (True = attend) for full and sliding layers.

    `key_groups`: [B, >= Lk] int64, the image run of each absolute position, -1 for text and
    padding. Padding query rows attend to everything (no empty rows for SDPA; dropped later).
    """
    lq, lk = batch.queries.max_len, batch.key_len
    device = batch.key_gather.device
    key_groups = key_groups[:, :lk]
    i = batch.prefix_lens[:, None] + torch.arange(lq, device=device)[None, :]  # [B, Lq] absolute
    q_groups = key_groups.gather(1, i.clamp(max=lk - 1))
    q_groups = torch.where(batch.queries.valid, q_groups, torch.full_like(q_groups, -1))
    j = torch.arange(lk, device=device)[None, None, :]  # [1, 1, Lk]
    same_image = (q_groups[:, :, None] == key_groups[:, None, :]) & (q_groups[:, :, None] >= 0)
    full = (j <= i[:, :, None]) | same_image  # [B, Lq, Lk]
    pad_rows = ~batch.queries.valid[:, :, None]
    sliding = None
    if window is not None:
        sliding = ((full & (j > i[:, :, None] - window)) | pad_rows)[:, None]
    return (full | pad_rows)[:, None], sliding


def prefix_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    batch: PrefixBatch,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [N, Hq, D], k/v: [N, Hkv, D] suffix rows; k_prefix/v_prefix: [M, Hkv, D] prefix rows;
    mask: [B, 1, Lq, Lk] bool -> [N, Hq, D]. One call; a step builds `group_prefix` once."""
    grouped = group_prefix(batch, (mask, None), q.shape[1], k.shape[1], q.dtype)
    return grouped(q, torch.cat([k_prefix, k]), torch.cat([v_prefix, v]), False, scale, softcap)


def group_prefix(batch: PrefixBatch, masks, heads: int, kv_heads: int, dtype: torch.dtype) -> GroupedBatch:
    """The step's grouped layout: queries are the suffix rows, keys the rows of
    cat(prefix rows, suffix rows) ([M + N, Hkv, D])."""
    return group_batch(batch.queries, batch.key_gather, masks, heads, kv_heads, dtype)
