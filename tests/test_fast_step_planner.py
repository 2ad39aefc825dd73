"""The step planner: admission by free rows and pages (by lane, then first come), the vision and
prefill batches, and a better lane running ahead of the sequences already admitted."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.pending import Pending
from wicore.schemas import GenerationParams, Lane

S, F = "sliding_attention", "full_attention"


def text_config(layer_types, window=16):
    return SimpleNamespace(layer_types=layer_types, sliding_window=window)


def sequence(rid, prompt_len, max_new, images=0, lane=Lane.NORMAL):
    request = EngineRequest(rid, [], [object()] * images, GenerationParams(max_new_tokens=max_new), priority=lane)
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


def test_a_short_vision_batch_waits_for_the_head_s_resize_but_not_for_rows():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    for rows in (3, 1):
        planner = StepPlanner(layout, BlockManager(500), max_rows=rows, vision_batch=3, prefill_tokens=50)
        resize = Future()
        a, b, c = (sequence(rid, 20, 4, images=1) for rid in "abc")
        b.vision.pixels = Pending(resize)  # still being resized in the pool
        for seq in (a, b, c):
            planner.add(seq)
        if rows == 1:  # b has no row to go to: a goes alone
            assert [s.id for s in planner.schedule_vision(1, allow_partial=True)] == ["a"]
            continue
        assert planner.schedule_vision(1, allow_partial=True) == []  # b joins a within a resize
        resize.set_result(None)
        assert [s.id for s in planner.schedule_vision(1, allow_partial=True)] == ["a", "b", "c"]


def ids(seqs):
    return [s.id for s in seqs]


def test_a_better_lane_is_admitted_first_and_each_lane_in_arrival_order():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(200), max_rows=3, vision_batch=8, prefill_tokens=64)
    lanes = {"n0": Lane.NORMAL, "l0": Lane.LOW, "n1": Lane.NORMAL, "h0": Lane.HIGH, "h1": Lane.HIGH}
    for rid, lane in lanes.items():
        planner.add(sequence(rid, 5, 5, lane=lane))
    assert ids(planner.waiting) == ["h0", "h1", "n0", "n1", "l0"]
    planner.schedule_vision(1)
    assert ids(planner.admitted) == ["h0", "h1", "n0"] and ids(planner.waiting) == ["n1", "l0"]


def running_bulk(planner, count):
    """`count` bulk sequences with an image each: the first two prefilled and decoding, the rest
    waiting for the vision tower (none launched)."""
    bulk = [sequence(f"b{i}", 20, 4, images=1) for i in range(count)]
    for seq in bulk:
        planner.add(seq)
    planner.schedule_vision(0)  # admits, launches nothing
    for seq in bulk[:2]:
        seq.move(SeqStatus.PREFILL)
    assert planner.schedule_model() == (bulk[:2], [])
    planner.prefilled(bulk[:2])
    return bulk


def test_a_better_lane_runs_alone_until_its_last_sequence_ends():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(500), max_rows=8, vision_batch=4, prefill_tokens=200)
    bulk = running_bulk(planner, 4)
    assert planner.lead_rank is None and ids(planner.schedule_model()[1]) == ["b0", "b1"]
    high = sequence("h", 20, 4, images=1, lane=Lane.HIGH)
    planner.add(high)
    # no vision slot, one image of four: a bulk batch would wait; the leading lane's goes now
    assert planner.schedule_vision(0, allow_partial=False) == [high] and planner.lead_rank == Lane.HIGH.rank
    assert planner.schedule_model() == ([], []), "bulk neither prefills nor decodes meanwhile"
    high.move(SeqStatus.PREFILL)
    bulk[2].move(SeqStatus.PREFILL)  # a bulk image done too: it still waits
    assert planner.schedule_model() == ([high], [])
    planner.prefilled([high])
    assert planner.schedule_model() == ([], [high])
    planner.finish(high)
    assert planner.lead_rank is None
    assert ids(planner.schedule_vision(1)) == ["b3"]
    assert planner.schedule_model() == ([bulk[2]], bulk[:2]), "bulk goes on where it stopped"


def test_a_better_lane_waiting_for_pages_holds_nothing_back():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    need = layout.pages_for(24)
    planner = StepPlanner(layout, BlockManager(1 + 4 * need), max_rows=8, vision_batch=4, prefill_tokens=200)
    running_bulk(planner, 4)  # every page taken
    high = sequence("h", 20, 4, images=1, lane=Lane.HIGH)
    planner.add(high)
    assert ids(planner.schedule_vision(1)) == ["b2", "b3"] and high.status == SeqStatus.WAITING
    assert planner.lead_rank is None and ids(planner.schedule_model()[1]) == ["b0", "b1"], "their end frees pages"


def test_paced_decode_waits_only_while_vision_runs():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(500), max_rows=3, vision_batch=8, prefill_tokens=64, decode_interval=60)
    seqs = [sequence(f"s{i}", 5, 4) for i in range(2)]
    for seq in seqs:
        planner.add(seq)
    planner.schedule_vision(1)
    planner.prefilled(seqs)
    assert planner.schedule_model(vision_busy=True) == ([], seqs), "the first decode batch goes"
    assert planner.decode_due_in() == float("inf")
    assert planner.schedule_model(vision_busy=True) == ([], []), "then waits while vision keeps the device busy"
    assert 59 < planner.decode_due_in() <= 60
    assert planner.schedule_model(vision_busy=False) == ([], seqs), "never while the device would idle"
    assert planner.schedule_model(vision_busy=True) == ([], [])
    planner.last_decode -= 60
    assert planner.schedule_model(vision_busy=True) == ([], seqs), "and at most the interval"

    high = sequence("high", 5, 4, lane=Lane.HIGH)
    planner.add(high)
    planner.schedule_vision(1)
    planner.prefilled([high])
    # The high-lane sequence leads: it decodes alone, and at once; so does a full batch.
    assert planner.schedule_model(vision_busy=True) == ([], [high])
    planner.finish(high)
    third = sequence("s2", 5, 4)
    planner.add(third)
    planner.schedule_vision(1)
    planner.prefilled([third])
    assert planner.schedule_model(vision_busy=True) == ([], [*seqs, third]), "3 rows: full"


def test_decode_is_never_paced_by_default():
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    planner = StepPlanner(layout, BlockManager(500), max_rows=8, vision_batch=8, prefill_tokens=64)
    seq = sequence("s", 5, 4)
    planner.add(seq)
    planner.schedule_vision(1)
    planner.prefilled([seq])
    assert [planner.schedule_model(vision_busy=True)[1] for _ in range(3)] == [[seq]] * 3
