"""KV pages: the pool, the layer-group layout with sliding rings, and admission by free pages."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from wicore.engines.base import EngineRequest
from wicore.engines.fast.block_manager import BlockManager, OutOfPages
from wicore.engines.fast.inputs import Prompt
from wicore.engines.fast.kv_cache import NULL_PAGE, KVLayout
from wicore.engines.fast.scheduler import Scheduler
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.schemas import GenerationParams

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


def sequence(rid, prompt_len, max_new, images=0):
    request = EngineRequest(rid, [], [object()] * images, GenerationParams(max_new_tokens=max_new))
    return Sequence(request, Prompt(list(range(prompt_len)), []), np.zeros((images, 3, 1, 1)), seed=0)


def admitted(seqs):
    return [s.status != SeqStatus.WAITING for s in seqs]


def test_admission_waits_for_pages_then_takes_freed_ones():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    assert layout.pages_for(40) == 10 + 3  # full group: 10 blocks; sliding ring: ceil(8/4) + 1
    blocks = BlockManager(1 + 2 * 13 + 5)
    scheduler = Scheduler(layout, blocks, max_rows=8, vision_batch=8, prefill_tokens=64)
    seqs = [sequence(f"s{i}", 30, 10) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule_vision(1)
    assert admitted(seqs) == [True, True, False] and blocks.num_free == 5
    assert [s.id for s in scheduler.take_admitted()] == ["s0", "s1"]
    assert seqs[0].table[0, :10].tolist() == seqs[0].pages[:10] and seqs[0].table[1, :3].tolist() == seqs[0].pages[10:]
    freed = set(seqs[0].pages)
    scheduler.finish(seqs[0])
    assert (seqs[0].status, seqs[0].row, blocks.num_free) == (SeqStatus.FINISHED, -1, 18)
    scheduler.schedule_vision(1)
    assert seqs[2].status == SeqStatus.READY and seqs[2].row >= 0 and set(seqs[2].pages) <= freed | set(range(27, 32))


def test_admission_is_bounded_by_rows_and_fifo():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    scheduler = Scheduler(layout, BlockManager(200), max_rows=2, vision_batch=8, prefill_tokens=64)
    seqs = [sequence("big", 30, 10), sequence("x", 5, 5), sequence("y", 5, 5)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule_vision(1)
    assert admitted(seqs) == [True, True, False]


def test_vision_and_prefill_batches():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    scheduler = Scheduler(layout, BlockManager(500), max_rows=8, vision_batch=3, prefill_tokens=50)
    seqs = [sequence("a", 20, 4, images=2), sequence("b", 20, 4, images=2), sequence("c", 20, 4), sequence("d", 20, 4)]
    for seq in seqs:
        scheduler.add(seq)
    assert [s.id for s in scheduler.schedule_vision(1)] == ["a"]  # a + b would be 4 images > 3
    assert [s.id for s in scheduler.schedule_vision(1)] == ["b"]
    assert scheduler.schedule_vision(0) == []
    prefill, decode = scheduler.schedule_model()
    assert [s.id for s in prefill] == ["c", "d"] and decode == []  # text-only: ready at once


def test_partial_vision_batches_wait_unless_allowed():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    scheduler = Scheduler(layout, BlockManager(500), max_rows=8, vision_batch=3, prefill_tokens=50)
    seqs = [sequence("a", 20, 4, images=1), sequence("b", 20, 4, images=1)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule_vision(1, allow_partial=False) == []  # 2 of 3 images: wait for more
    scheduler.add(sequence("c", 20, 4, images=1))
    assert [s.id for s in scheduler.schedule_vision(1, allow_partial=False)] == ["a", "b", "c"]
    scheduler.add(sequence("d", 20, 4, images=1))
    assert [s.id for s in scheduler.schedule_vision(1, allow_partial=True)] == ["d"]
