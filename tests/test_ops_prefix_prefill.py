"""Prefill over a cached prefix against recomputing the whole prompt: the masks are the rows of
the whole prompt's masks, and the suffix's attention outputs equal the whole prompt's."""

from __future__ import annotations

import pytest
import torch

from tests.fast_requests import one_torch_thread  # noqa: F401 (fixture)
from wicore.ops.attention import gemma3_prefill_masks, pack_layout, prefill_attention
from wicore.ops.attention.prefix_prefill import gemma3_prefix_masks, prefix_layout, prefix_prefill_attention

# (prompt length, cached prefix length, image runs [start, end)) per sequence
CASES = [
    (14, 8, [(2, 6)]),  # image wholly in the prefix
    (9, 0, [(1, 5)]),  # nothing cached
    (20, 4, [(6, 11), (12, 16)]),  # images wholly in the suffix
    (11, 7, [(5, 9)]),  # an image across the boundary (the op allows it; the engine avoids it)
    (6, 5, []),  # only the last token recomputed
]


def groups_of(cases, width):
    """[B, width] image run of each position, -1 for text and padding."""
    groups = torch.full((len(cases), width), -1)
    for b, (_, _, images) in enumerate(cases):
        for i, (start, end) in enumerate(images):
            groups[b, start:end] = i
    return groups


def whole_prompt(cases, window):
    layout = pack_layout([c[0] for c in cases], "cpu")
    return layout, gemma3_prefill_masks(layout, groups_of(cases, layout.max_len), window)


def suffix_batch(cases, window):
    batch = prefix_layout([c[1] for c in cases], [c[0] - c[1] for c in cases], "cpu")
    return batch, gemma3_prefix_masks(batch, groups_of(cases, max(c[0] for c in cases)), window)


@pytest.mark.parametrize("window", [None, 3, 7])
def test_masks_are_the_whole_prompts_rows(window):
    _, whole = whole_prompt(CASES, window)
    batch, masks = suffix_batch(CASES, window)
    for kind in (0, 1) if window else (0,):
        for b, (length, prefix, _) in enumerate(CASES):
            got = masks[kind][b, 0, : length - prefix, :length]
            assert torch.equal(got, whole[kind][b, 0, prefix:length, :length]), (kind, b)
            assert masks[kind][b, 0, length - prefix :].all()  # padding rows see everything


def test_no_prefix_is_the_plain_prefill_mask():
    cases = [(c[0], 0, c[2]) for c in CASES]
    layout, (full, sliding) = whole_prompt(cases, 4)
    _, (pfull, psliding) = suffix_batch(cases, 4)
    assert torch.equal(full, pfull) and torch.equal(sliding, psliding)


def split_rows(cases, x):
    """Packed whole-prompt rows -> (prefix rows, suffix rows), each packed in batch order."""
    prefix, suffix, start = [], [], 0
    for length, cached, _ in cases:
        prefix.append(x[start : start + cached])
        suffix.append(x[start + cached : start + length])
        start += length
    return torch.cat(prefix), torch.cat(suffix)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (3, 20.0)])
def test_suffix_attention_equals_recomputing_the_prompt(window, softcap):
    gen = torch.Generator().manual_seed(0)
    n = sum(c[0] for c in CASES)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (4, 2, 2))
    layout, whole = whole_prompt(CASES, window)
    want = prefill_attention(q, k, v, layout, whole[1] if window else whole[0], 0.3, softcap)
    batch, masks = suffix_batch(CASES, window)
    (k_prefix, k_new), (v_prefix, v_new), (_, q_new) = split_rows(CASES, k), split_rows(CASES, v), split_rows(CASES, q)
    mask = masks[1] if window else masks[0]
    got = prefix_prefill_attention(q_new, k_new, v_new, k_prefix, v_prefix, batch, mask, 0.3, softcap)
    torch.testing.assert_close(got, split_rows(CASES, want)[1], rtol=1e-5, atol=1e-5)


def test_layout_rows():
    batch = prefix_layout([2, 0], [1, 3], "cpu")
    # rows: prefix of seq 0 (0, 1), suffix of seq 0 (2), suffix of seq 1 (3, 4, 5)
    assert batch.key_gather.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        prefix_layout([3], [0], "cpu")
