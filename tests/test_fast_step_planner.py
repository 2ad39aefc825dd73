"""The step planner: admission by free rows and pages (FIFO), and the vision and prefill batches."""

from __future__ import annotations

from types import SimpleNamespace

from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.schemas import GenerationParams

S, F = "sliding_attention", "full_attention"


def text_config(layer_types, window=16):
    return SimpleNamespace(layer_types=layer_types, sliding_window=window)


def sequence(rid, prompt_len, max_new, images=0):
    request = EngineRequest(rid, [], [object()] * images, GenerationParams(max_new_tokens=max_new))
    return Sequence(request, Prompt(list(range(prompt_len)), []), seed=0)


def admitted(seqs):
    return [s.status != SeqStatus.WAITING for s in seqs]


def test_admission_waits_for_pages_then_takes_freed_ones():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    assert layout.pages_for(40) == 10 + 3  # full group: 10 blocks; sliding ring: ceil(8/4) + 1
    blocks = BlockManager(1 + 2 * 13 + 5)
    planner = StepPlanner(layout, blocks, max_rows=8, vision_batch=8, prefill_tokens=64)
    seqs = [sequence(f"s{i}", 30, 10) for i in range(3)]
    for seq in seqs:
        planner.add(seq)
    planner.schedule_vision(1)
    assert admitted(seqs) == [True, True, False] and blocks.num_free == 5
    assert [s.id for s in planner.take_admitted()] == ["s0", "s1"]
    kv = seqs[0].kv
    assert kv.table[0, :10].tolist() == kv.pages[:10] and kv.table[1, :3].tolist() == kv.pages[10:]
    freed = set(kv.pages)
    planner.prefilled([seqs[0]])
    planner.finish(seqs[0])
    assert (seqs[0].status, seqs[0].kv.row, blocks.num_free) == (SeqStatus.FINISHED, -1, 18)
    planner.schedule_vision(1)
    third = seqs[2]
    assert third.status == SeqStatus.PREFILL and third.kv.row >= 0 and set(third.kv.pages) <= freed | set(range(27, 32))


def test_admission_is_bounded_by_rows_and_fifo():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(200), max_rows=2, vision_batch=8, prefill_tokens=64)
    seqs = [sequence("big", 30, 10), sequence("x", 5, 5), sequence("y", 5, 5)]
    for seq in seqs:
        planner.add(seq)
    planner.schedule_vision(1)
    assert admitted(seqs) == [True, True, False]


def test_vision_and_prefill_batches():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(500), max_rows=8, vision_batch=3, prefill_tokens=50)
    seqs = [sequence("a", 20, 4, images=2), sequence("b", 20, 4, images=2), sequence("c", 20, 4), sequence("d", 20, 4)]
    for seq in seqs:
        planner.add(seq)
    assert [s.id for s in planner.schedule_vision(1)] == ["a"]  # a + b would be 4 images > 3
    assert [s.id for s in planner.schedule_vision(1)] == ["b"]
    assert planner.schedule_vision(0) == []
    prefill, decode = planner.schedule_model()
    assert [s.id for s in prefill] == ["c", "d"] and decode == []  # text-only: ready at once


def test_partial_vision_batches_wait_unless_allowed():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(500), max_rows=8, vision_batch=3, prefill_tokens=50)
    seqs = [sequence("a", 20, 4, images=1), sequence("b", 20, 4, images=1)]
    for seq in seqs:
        planner.add(seq)
    assert planner.schedule_vision(1, allow_partial=False) == []  # 2 of 3 images: wait for more
    planner.add(sequence("c", 20, 4, images=1))
    assert [s.id for s in planner.schedule_vision(1, allow_partial=False)] == ["a", "b", "c"]
    planner.add(sequence("d", 20, 4, images=1))
    assert [s.id for s in planner.schedule_vision(1, allow_partial=True)] == ["d"]
