"""KV pages: the pool and the layer-group layout with sliding rings."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from wicore.engines.kvcache.block_manager import BlockManager, OutOfPages
from wicore.engines.kvcache.kv_layout import NULL_PAGE, KVLayout

S, F = "sliding_attention", "full_attention"


def text_config(layer_types, window=16):
    return SimpleNamespace(layer_types=layer_types, sliding_window=window)


def test_allocate_release_and_refuse():
    blocks = BlockManager(6)
    assert blocks.num_free == 5  # page 0 is the null page
    first = blocks.allocate(3)
    assert NULL_PAGE not in first and len(set(first)) == 3
    with pytest.raises(OutOfPages):
        blocks.allocate(3)
    assert blocks.num_free == 2  # a refused request takes nothing
    blocks.release(first)
    assert blocks.num_free == 5 and blocks.num_used == 0
    with pytest.raises(ValueError):
        blocks.release(first[:1])  # double free
    with pytest.raises(ValueError):
        blocks.release([NULL_PAGE])


def test_gemma3_4b_groups_and_rings():
    types = ([S] * 5 + [F]) * 5 + [S] * 4  # Gemma-3-4B: 34 layers, 5 full
    layout = KVLayout.build(text_config(types, window=1024), block_size=16, max_model_len=8192)
    assert layout.slots == 5
    assert [g.sliding for g in layout.groups] == [False] + [True] * 6
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(34))
    assert layout.groups[0].ring == 512 and layout.groups[1].ring == 65  # ceil(1024/16) + 1
    assert layout.pages_for(340) == 7 * 22  # short sequences: every group holds every block
    assert layout.pages_for(8192) == 512 + 6 * 65  # long ones: sliding groups stay at their ring


def test_prefill_slots_keep_the_window_in_distinct_ring_slots():
    layout = KVLayout.build(text_config([S, F], window=6), block_size=4, max_model_len=64)
    ring = layout.groups[1].ring
    assert (layout.groups[1].sliding, ring) == (True, 3)
    table = np.zeros((2, layout.table_width), dtype=np.int32)
    table[0, :8] = np.arange(10, 18)
    table[1, :ring] = [20, 21, 22]
    slots = layout.prefill_slots(table, 30)
    assert slots[0].tolist() == [table[0, p // 4] * 4 + p % 4 for p in range(30)]
    # The last ring of positions (3 pages x 4) is kept, each in its own slot; earlier positions,
    # overwritten later in the same prompt, go to the null page.
    kept = slots[1, 30 - 12 :]
    assert len(set(kept.tolist())) == 12 and set(kept // 4) <= {20, 21, 22}
    assert (slots[1, : 30 - 12] // 4 == NULL_PAGE).all()
    suffix = layout.prefill_slots(table, 30, start=20, shared=24)  # positions 20..29, 20..23 cached
    assert suffix.shape == (2, 10) and (suffix[:, :4] == 0).all()
    assert (suffix[:, 4:] == slots[:, 24:]).all()


def test_wrapping_and_prefix_slots():
    layout = KVLayout.build(text_config([S, F], window=6), block_size=4, max_model_len=64)
    assert not layout.wraps(12) and layout.wraps(13)  # the sliding ring holds 3 pages x 4
    table = np.zeros((2, layout.table_width), dtype=np.int32)
    table[0, :3], table[1, :3] = [5, 6, 7], [8, 9, 10]
    assert (layout.prefix_slots(table, 10) == layout.prefill_slots(table, 10)).all()
