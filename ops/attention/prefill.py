"""Packed prefill attention for Gemma-style decoders, with the exact Gemma-3 masks.

Masks follow transformers' Gemma-3 (`create_masks_for_vision_model`): a query at `i` sees key `j`
when (j <= i or both are in the same image's run of soft tokens), and on sliding layers also
j > i - window (the window is exclusive: `window` keys including the query itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wicore.ops.transfer import upload


@dataclass
class PackedBatch:
    """Where each sequence of a packed prefill batch sits, and its padded [B, L] layout.

    `gather` maps each padded cell [B, L] to a packed row (padding cells point at row 0);
    `scatter` maps each packed row to its cell in the flattened [B * L] layout.
    """

    lengths: list[int]
    gather: torch.Tensor  # [B, L] int64
    scatter: torch.Tensor  # [N] int64
    valid: torch.Tensor  # [B, L] bool

    @property
    def max_len(self) -> int:
        return max(self.lengths)


def pack_layout(lengths: list[int], device: torch.device | str) -> PackedBatch:
    batch, longest = len(lengths), max(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    cols = torch.arange(longest)
    valid = cols[None, :] < lens[:, None]  # [B, L]
    gather = torch.where(valid, starts[:, None] + cols[None, :], torch.zeros((), dtype=torch.int64))
    scatter = (torch.arange(batch)[:, None] * longest + cols[None, :])[valid]
    return PackedBatch(lengths, upload(gather, device), upload(scatter, device), upload(valid, device))


def gemma3_prefill_masks(
    layout: PackedBatch, image_groups: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boolean masks [B, 1, L, L] (True = attend) for full and sliding layers.

    `image_groups`: [B, L] int64, the index of the image run each token belongs to, -1 for text
    (and padding). Padding query rows attend to everything so that SDPA never sees an empty row
    (their outputs are dropped).
    """
    longest = layout.max_len
    device = layout.valid.device
    i = torch.arange(longest, device=device)[:, None]
    j = torch.arange(longest, device=device)[None, :]
    same_image = (image_groups[:, :, None] == image_groups[:, None, :]) & (image_groups[:, :, None] >= 0)
    full = (j <= i)[None] | same_image  # [B, L, L]
    pad_rows = ~layout.valid[:, :, None]
    sliding = None
    if window is not None:
        sliding = ((full & (j > i - window)[None]) | pad_rows)[:, None]
    return (full | pad_rows)[:, None], sliding


@dataclass
class GroupedBatch:
    """A padded batch laid out once per step for grouped-query attention without repeating K/V
    heads: the G = Hq / Hkv query heads that share a KV head are stacked along the query axis, so
    attention runs on q [B, Hkv, G * Lq, D] against k/v [B, Hkv, Lk, D]. Every layer of the step
    reuses the index maps and the additive masks (0 / -inf, query rows repeated per head group,
    keys padded to a multiple of 8 as the memory-efficient kernel wants its bias aligned).
    """

    q_token: torch.Tensor  # [B, Hkv, G * Lq] packed query row of each folded query
    q_head: torch.Tensor  # [B, Hkv, G * Lq] its query head
    key_rows: torch.Tensor  # [B, Lk] row of the keys tensor (padding -> 0, masked out)
    out_cell: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [N * Hq] (b, kv head, folded row)
    masks: tuple[torch.Tensor, torch.Tensor | None]  # additive [B, 1, G * Lq, Lk]: full, sliding

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        sliding: bool,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [N, Hq, D] packed queries; keys/values: [R, Hkv, D], the rows `key_rows` indexes
        -> [N, Hq, D]."""
        n, heads, dim = q.shape
        mask = self.masks[1] if sliding else self.masks[0]
        qf = gather_rows(q, self.q_token, self.q_head)  # [B, Hkv, G * Lq, D]
        kp, vp = (x[self.key_rows].transpose(1, 2) for x in (keys, values))  # [B, Hkv, Lk, D]
        out = grouped_attention(qf, kp, vp, mask, scale, softcap)  # [B, Hkv, G * Lq, D]
        b, h, row = self.out_cell
        return gather_rows(out, b, h, row).view(n, heads, dim)


def gather_rows(x: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """x[index] for index tensors over x's leading dims, each selected row of the last dim moved
    as 8-byte words where its layout allows: torch's index kernel copies one element per thread,
    and bf16 rows moved as int64 take about half the time. A pure copy, bit for bit."""
    words = 8 // x.element_size() if x.element_size() < 8 else 1
    aligned = (
        words > 1
        and x.stride(-1) == 1
        and x.shape[-1] % words == 0
        and x.storage_offset() % words == 0
        and all(stride % words == 0 for stride in x.stride()[:-1])
    )
    if not aligned:
        return x[index]
    return x.view(torch.int64)[index].view(x.dtype)


def group_batch(
    queries: PackedBatch,
    key_rows: torch.Tensor,
    masks: tuple[torch.Tensor, torch.Tensor | None],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
) -> GroupedBatch:
    """`queries`: the packed query rows' padded layout [B, Lq]; `key_rows`: [B, Lk] row of the
    keys for each key cell; `masks`: bool [B, 1, Lq, Lk] (True = attend)."""
    batch, lq = queries.gather.shape
    groups = heads // kv_heads
    device = queries.gather.device
    head = torch.arange(heads, device=device).view(1, kv_heads, groups, 1)  # kv head h serves h*G .. h*G+G-1
    q_token = queries.gather[:, None, None, :].expand(batch, kv_heads, groups, lq).reshape(batch, kv_heads, -1)
    q_head = head.expand(batch, kv_heads, groups, lq).reshape(batch, kv_heads, -1)
    b, i = queries.scatter // lq, queries.scatter % lq  # [N] cell of each packed row
    hq = torch.arange(heads, device=device)[None, :]  # [1, Hq]
    out_cell = (
        b[:, None].expand(-1, heads).reshape(-1),
        (hq // groups).expand(len(b), -1).reshape(-1),
        ((hq % groups) * lq + i[:, None]).reshape(-1),
    )
    pad = (-key_rows.shape[1]) % 8
    key_rows = F.pad(key_rows, (0, pad))
    folded = tuple(None if m is None else _additive(m, pad, groups, dtype) for m in masks)
    return GroupedBatch(q_token, q_head, key_rows, out_cell, folded)


def _additive(mask: torch.Tensor, pad: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, 1, Lq, Lk] -> [B, 1, G * Lq, Lk + pad] of 0 (attend) / -inf, row g * Lq + i = row i."""
    mask = F.pad(mask, (0, pad), value=False)
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return additive.repeat(1, 1, groups, 1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PackedBatch,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [N, Hq, D], k/v: [N, Hkv, D] packed rows -> [N, Hq, D]. `mask`: [B, 1, L, L] bool.

    The rows are padded to [B, H, L, D] for attention; the attention FLOPs are a small part of a
    prefill (the projections run packed), so the padding costs little. One call; a step with many
    layers builds its `GroupedBatch` once instead.
    """
    grouped = group_batch(layout, layout.gather, (mask, None), q.shape[1], k.shape[1], q.dtype)
    return grouped(q, k, v, False, scale, softcap)


def grouped_attention(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """q: [B, Hkv, M, D] (query head groups folded into M), k/v: [B, Hkv, Lk, D], mask: additive
    [B, 1, M, Lk] -> [B, Hkv, M, D]."""
    if softcap is not None:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)
    if q.is_cuda:
        # The memory-efficient kernel, called directly: SDPA's dispatcher would pick cuDNN first,
        # which builds a graph for every new (B, Lq, Lk), tens of ms of host time, and prefill
        # batches rarely repeat a shape (docs/benchmarks.md, the cache benchmark).
        bias = mask.expand(q.shape[0], q.shape[1], -1, -1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
