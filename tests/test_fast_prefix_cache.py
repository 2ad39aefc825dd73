"""The prefix cache's rules on CPU, without a model: hits take shared pages, blocks in use are
never evicted, finished blocks stay cached until allocation needs their pages, sequences that
wrap a sliding ring are never cached, a match never ends inside an image, a sequence whose
prefix is being computed waits for it, a prefill's budget counts what it computes, and the
counters."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from wicore.engines.base import EngineRequest
from wicore.engines.fast.prompt_inputs import Prompt
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.kvcache.block_manager import BlockManager, OutOfPages
from wicore.engines.kvcache.eviction import LRU
from wicore.engines.kvcache.gpu_tier import PrefixCache
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.kvcache.prefix_keys import IMAGE_BLOCK_COST, prompt_keys, usable_prefix
from wicore.engines.kvcache.tiers import KVTiers
from wicore.engines.pending import Pending
from wicore.schemas import GenerationParams, Lane

S, F = "sliding_attention", "full_attention"
IMAGE = "ab" * 32  # a sha256 hex digest
TPI = 4  # soft tokens per image here


def layout(window=64):
    """Block size 4; the sliding ring holds 17 pages (68 positions)."""
    config = SimpleNamespace(layer_types=[S, F], sliding_window=window)
    return KVLayout.build(config, block_size=4, max_model_len=128)


def sequence(rid, ids, max_new=4, images=(), lay=None, image=IMAGE, hashed=False):
    """A sequence of prompt `ids` with images (all `image`) starting at `images`, keyed like the
    engine; `hashed`: the request carries the images' sha256 (a vision batch counts each once)."""
    hashes = [image] * len(images) if hashed else []
    request = EngineRequest(rid, [], [object()] * len(images), GenerationParams(max_new_tokens=max_new), hashes)
    seq = Sequence(request, Prompt(list(ids), list(images)), seed=0)
    lay = lay or layout()
    if not lay.wraps(seq.max_len):
        seq.cache.keys = Pending.now(prompt_keys(list(ids), list(images), [image] * len(images), TPI, 4, "model"))
    return seq


def scheduler(pages=200, lay=None, rows=8):
    blocks = BlockManager(pages, PrefixCache(LRU()))
    return StepPlanner(lay or layout(), blocks, max_rows=rows, vision_batch=8, prefill_tokens=512), blocks


def admit(sched, *seqs):
    for seq in seqs:
        sched.add(seq)
    sched.schedule_vision(1)
    return [s.status != SeqStatus.WAITING for s in seqs]


def run(sched, seqs):
    """Prefill then finish `seqs` (what the engine does, without a model)."""
    sched.prefilled(seqs)
    for seq in seqs:
        sched.finish(seq)


def test_finished_prompt_blocks_stay_cached_and_are_reused():
    sched, blocks = scheduler()
    first = sequence("a", range(10))  # 2 full blocks + 2 tokens; 14 positions -> 4 blocks x 2 groups
    assert admit(sched, first) == [True] and first.cache.prefix_len == 0 and len(first.cache.held) == 2
    held = list(first.cache.held)
    run(sched, [first])
    assert blocks.num_cached == 4 and blocks.num_used == 0  # 2 blocks x 2 groups
    second = sequence("b", [*range(8), 99, 98, 97])
    admit(sched, second)
    assert second.cache.prefix_len == 8 and second.cache.shared_len == 8 and second.cache.reads == held
    assert second.kv.table[:, :2].T.tolist() == [list(b.pages) for b in held]
    assert blocks.num_cached == 0 and blocks.cache.stats.hits == 2


def test_whole_prompt_cached_recomputes_the_last_token():
    sched, _ = scheduler()
    first = sequence("a", range(8))
    admit(sched, first)
    run(sched, [first])
    again = sequence("b", range(8))
    admit(sched, again)
    assert (again.cache.prefix_len, again.cache.shared_len) == (7, 8)  # position 7 recomputed, not written


def test_blocks_in_use_are_never_evicted():
    lay = layout()
    sched, blocks = scheduler(pages=1 + 12, lay=lay)
    running = sequence("a", range(8), max_new=4)  # 3 blocks x 2 groups = 6 pages
    admit(sched, running)
    sched.prefilled([running])
    other = sequence("b", range(50, 58), max_new=4)  # needs 6 more: 6 free
    admit(sched, other)
    other_keys = [b.key for b in other.cache.held]
    run(sched, [other])
    assert blocks.num_free == 2 and blocks.num_cached == 4
    third = sequence("c", range(100, 108), max_new=12)  # 5 blocks = 10 pages: 2 free + 4 cached < 10
    assert admit(sched, third) == [False] and all(b in blocks.cache for b in [h.key for h in running.cache.held])
    with pytest.raises(OutOfPages):
        blocks.allocate(7)
    assert blocks.allocate(6) and [b.key for b in blocks.take_evicted()] == other_keys


def test_reused_evictable_blocks_do_not_count_as_free():
    sched, blocks = scheduler(pages=1 + 8)
    first = sequence("a", range(8), max_new=4)  # 6 pages, 2 blocks cached after
    admit(sched, first)
    run(sched, [first])
    assert blocks.num_free == 4 and blocks.num_cached == 4
    again = sequence("b", range(8), max_new=12)  # 5 blocks: 2 hits + 3 new = 6 pages; 4 free only
    assert admit(sched, again) == [False] and blocks.num_cached == 4


def test_ring_wrapping_sequences_are_not_cached():
    lay = layout(window=8)  # ring of 3 pages: 12 positions
    sched, blocks = scheduler(lay=lay)
    long = sequence("a", range(10), max_new=4, lay=lay)
    assert long.cache.keys is None
    admit(sched, long)
    run(sched, [long])
    assert blocks.num_cached == 0 and len(blocks.cache) == 0


def test_match_never_ends_inside_an_image():
    spans = [(5, 13)]  # an image's soft tokens at positions 5..12
    assert usable_prefix(2, 4, 20, spans) == 4  # 8 tokens end inside: back to the image's block
    assert usable_prefix(3, 4, 20, spans) == 4
    assert usable_prefix(4, 4, 20, spans) == 16  # past the image
    assert usable_prefix(5, 4, 20, spans) == 19  # the whole prompt: the last token is recomputed
    assert usable_prefix(2, 4, 20, [(2, 6), (6, 10)]) == 0  # cut back through adjacent images
    assert usable_prefix(2, 4, 20, spans, split_images=True) == 8  # allowed to split


def test_a_split_image_is_prefilled_from_its_tail():
    from wicore.engines.fast.prefill_batch import suffix_image_embeds

    # soft tokens at 6..9; the prompts share 11 tokens: 2 blocks, ending inside the image
    seqs = [sequence(f"q{i}", [9] * 6 + [0, 1, 2, 3] + [9, 40 + i, 41], images=[6]) for i in range(2)]
    sched, _ = scheduler()
    sched.split_images = True
    admit(sched, *seqs)
    later = seqs[1]
    assert (later.cache.prefix_len, later.cache.first_image, later.needs_vision) == (8, 0, True)
    later.vision.embeds = torch.arange(4.0).view(1, 4, 1)  # [images, tokens, hidden]
    assert suffix_image_embeds([later])[0].flatten().tolist() == [2.0, 3.0]  # tokens 8, 9


def test_image_blocks_are_keyed_by_content_and_cost_more():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = prompt_keys(ids, [2], [IMAGE], TPI, 4, "m")
    b = prompt_keys(ids, [2], ["cd" * 32], TPI, 4, "m")
    assert a.keys[0] != b.keys[0] and a.costs == [IMAGE_BLOCK_COST, IMAGE_BLOCK_COST]
    assert prompt_keys(ids, [2], [IMAGE], TPI, 4, "other").keys[0] != a.keys[0]


def test_same_image_questions_admitted_together_share_and_wait():
    image = [0, 1, 2, 3, 4, 5, 6, 7]
    seqs = [sequence(f"q{i}", [9, 9, *image, 9, 9, 9, 9, 40 + i, 41], images=[2]) for i in range(3)]
    sched, blocks = scheduler()
    assert admit(sched, *seqs) == [True] * 3
    first, *rest = seqs
    assert first.status == SeqStatus.VISION and first.needs_vision
    for seq in rest:  # the image and the shared text are first's blocks, not computed again
        assert seq.cache.prefix_len == 12 and seq.cache.reads == first.cache.held[:3] and not seq.needs_vision
        assert seq.status == SeqStatus.PREFILL and not seq.cache.blocks_ready
    assert sched.schedule_model()[0] == []  # first needs vision; the rest wait for its blocks
    first.move(SeqStatus.PREFILL)
    assert sched.schedule_model()[0] == [first]
    sched.prefilled([first])
    assert sched.schedule_model()[0] == rest
    assert blocks.cache.stats.hits == 6


def test_prefill_budget_counts_the_uncached_suffix():
    """Four follow-ups of a cached 40-token prefix compute 4 tokens each: one prefill takes all
    of them, where four uncached 44-token prompts fit two to a 100-token budget."""

    def budget_100():
        return StepPlanner(layout(), BlockManager(200, PrefixCache(LRU())), 8, vision_batch=8, prefill_tokens=100)

    sched = budget_100()
    first = sequence("first", range(40))
    admit(sched, first)
    run(sched, [first])
    follow_ups = [sequence(f"f{k}", [*range(40), 100 + k, 101, 102, 103]) for k in range(4)]
    admit(sched, *follow_ups)
    assert [s.cache.prefix_len for s in follow_ups] == [40] * 4
    assert sched.schedule_model()[0] == follow_ups
    fresh = budget_100()
    uncached = [sequence(f"u{k}", [200 + k, *range(43)]) for k in range(4)]
    admit(fresh, *uncached)
    assert fresh.schedule_model()[0] == uncached[:2]


def test_restores_from_a_lower_tier_are_registered_and_awaited():
    sched, blocks = scheduler()
    sched.lower = lambda seq, key: True  # every block is in the host tier
    seq = sequence("a", range(10))
    admit(sched, seq)
    assert [r.key for r in seq.cache.restores] == seq.prompt_keys().keys and seq.cache.prefix_len == 8
    assert all(r.block in seq.cache.held and not r.block.ready for r in seq.cache.restores)
    assert not seq.cache.blocks_ready and sched.schedule_model()[0] == []


def test_cache_stats_are_json():
    sched, blocks = scheduler()
    for name in "ab":
        seq = sequence(name, range(10))
        admit(sched, seq)
        run(sched, [seq])
    kv = SimpleNamespace(tensor=np.zeros(0), layout=layout())
    tiers = KVTiers.__new__(KVTiers)
    tiers.host, tiers.disk, tiers.restored_bytes, tiers.block_bytes, tiers.kv = None, None, 0, 100, kv
    stats = tiers.cache_stats(blocks.cache)
    assert stats.tiers["gpu"].hits == 2 and stats.tiers["gpu"].misses == 2
    assert stats.tiers["gpu"].bytes_out == 200
    assert stats.to_dict()["gpu"]["hits"] == 2 and stats.to_dict()["gpu"]["hit_rate"] == 0.5


def test_a_failed_key_job_leaves_the_sequence_uncached(caplog):
    seq = sequence("a", range(10))
    job = Future()
    seq.cache.keys = Pending(job)
    assert not seq.cache.keys.ready
    job.set_exception(ValueError("bad image"))
    assert seq.cache.keys.ready and seq.prompt_keys() is None and "not cached" in caplog.text


def questions(image: str, count: int, first: int = 0) -> list[Sequence]:
    """Questions `first`.. about one image: a shared 12-token prefix (image at 2..5), then their own."""
    prefix = [9, 9, 0, 1, 2, 3, 9, 9, 9, 9, 9, 9]
    return [
        sequence(f"{image[:2]}{q}", [*prefix, 40 + q, 41], images=[2], image=image, hashed=True)
        for q in range(first, first + count)
    ]


def test_decode_batch_puts_the_sharers_of_a_prefix_side_by_side():
    a, b = "aa" * 32, "bb" * 32
    (a0, a1), (b0, b1) = questions(a, 2), questions(b, 2)
    sched, _ = scheduler()
    admit(sched, a0, b0, a1, b1)
    assert sched.admitted == [a0, b0, a1, b1]
    for seq in sched.admitted:
        if seq.status == SeqStatus.VISION:
            seq.move(SeqStatus.PREFILL)
    sched.prefilled(sched.admitted)
    for seq in sched.admitted:
        seq.tokens.launched = 1
    decode = sched.schedule_model()[1]
    assert {frozenset(map(id, decode[:2])), frozenset(map(id, decode[2:]))} == {
        frozenset(map(id, (a0, a1))),
        frozenset(map(id, (b0, b1))),
    }


def test_an_image_asked_about_twice_counts_once_in_a_vision_batch():
    """Without the prefix cache every question needs the tower; the batch takes 2 distinct
    images, so both questions about `a` and the one about `b` go together."""
    a, b = "aa" * 32, "bb" * 32
    seqs = questions(a, 2) + questions(b, 1) + questions("cc" * 32, 1)
    sched = StepPlanner(layout(), BlockManager(200), max_rows=8, vision_batch=2, prefill_tokens=512)
    for seq in seqs:
        sched.add(seq)
    assert sched.schedule_vision(1) == seqs[:3]
    assert sched.schedule_vision(1, allow_partial=False) == []  # one image left: partial
    assert sched.schedule_vision(1) == seqs[3:]


def test_a_sequence_stopped_before_its_prefill_takes_its_unwritten_blocks_out():
    sched, blocks = scheduler()
    first = sequence("a", range(10))
    admit(sched, first)
    assert len(blocks.cache) == 2 and not first.cache.others_wait
    sched.finish(first, SeqStatus.ABORTED)
    assert len(blocks.cache) == 0 and blocks.num_free == 199 and blocks.cache.policy.num_pinned == 0
    again = sequence("b", range(10))
    admit(sched, again)
    assert again.cache.prefix_len == 0  # nothing stale to wait for
    follow_up = sequence("c", [*range(8), 50, 51])
    admit(sched, follow_up)
    assert follow_up.cache.reads == again.cache.writes and again.cache.others_wait  # c waits on b
    sched.prefilled([again])
    assert not again.cache.others_wait


def test_a_leading_lane_waiting_for_another_lanes_blocks_lets_their_writer_run():
    """A high-lane question about an image a bulk sequence is computing reads that sequence's
    blocks: the bulk sequence keeps its vision and prefill while the high lane leads."""
    image = [0, 1, 2, 3, 4, 5, 6, 7]
    writer = sequence("bulk", [9, 9, *image, 9, 9, 9, 9, 40, 41], images=[2])
    other = sequence("bulk-2", [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], images=[])
    reader = sequence("high", [9, 9, *image, 9, 9, 9, 9, 50, 51], images=[2])
    reader.request.priority = Lane.HIGH
    sched, _ = scheduler()
    sched.add(writer)
    sched.add(other)
    assert sched.schedule_vision(0) == [], "admitted, no vision launched"
    sched.add(reader)
    assert sched.schedule_vision(0) == [writer] and sched.lead_rank == Lane.HIGH.rank
    assert reader.cache.reads and not reader.cache.blocks_ready and writer.cache.others_wait
    writer.move(SeqStatus.PREFILL)
    assert sched.schedule_model() == ([writer], []), "the writer prefills; the other bulk sequence waits"
    sched.prefilled([writer])
    assert sched.schedule_model() == ([reader], [])
