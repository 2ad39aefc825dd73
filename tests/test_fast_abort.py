"""`Engine.abort` on CPU with the tiny model: an aborted sequence gives its row, pages and cached
blocks back, and its batch mates give the tokens they give without the abort.

The prefix-cache cases use the tiny model with a 128-token sliding window and 4-token blocks,
so the four questions about one image (`vqa`) share 7 blocks, computed by the first of them.
"""

from __future__ import annotations

import pytest

from tests.fast_requests import mismatches, mixed_requests, one_torch_thread, request  # noqa: F401 (fixture)
from tests.test_fast_prefix_parity import vqa
from wicore.engines.base import ABORTED, EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.fast.sequence import SeqStatus
from wicore.engines.null import NullEngine
from wicore.engines.options import FastOptions

pytestmark = pytest.mark.slow
MAX_STEPS = 500  # far more than any run here needs: a sequence left waiting fails the test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


def engine(model_dir, **options) -> FastEngine:
    return FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=FastOptions(**options)))


def step_until(fast: FastEngine, condition) -> list:
    done = []
    for _ in range(MAX_STEPS):
        if condition():
            return done
        done += fast.step()
    raise AssertionError(f"not reached after {MAX_STEPS} steps ({fast.num_unfinished()} sequences left)")


def run_to_end(fast: FastEngine) -> list:
    return step_until(fast, lambda: not fast.num_unfinished())


def sequences(fast: FastEngine) -> dict:
    return {seq.id: seq for seq in fast.planner.sequences()}


def check_same_tokens(done, want):
    assert all(c.ok for c in done)
    assert mismatches(done, [want[c.id] for c in done]) == []


def test_a_waiting_and_a_decoding_sequence(tiny_model_dir):
    want = {c.id: c for c in engine(tiny_model_dir, prefix_cache=False).generate(mixed_requests())}
    fast = engine(tiny_model_dir, prefix_cache=False)
    free = fast.blocks.num_free
    done = fast.add(mixed_requests())  # 7 requests, 4 rows: e, f and g wait
    seqs = sequences(fast)
    done += step_until(fast, lambda: len(seqs["c"].tokens.generated) >= 2)  # a decode of c is in flight
    assert seqs["f"].status == SeqStatus.WAITING and seqs["c"].status == SeqStatus.DECODE
    free_before, pages, tokens = fast.blocks.num_free, len(seqs["c"].kv.pages), len(seqs["c"].tokens.generated)
    aborted = fast.abort(["c", "f", "never-added"])
    assert sorted((c.id, c.error, c.input_error) for c in aborted) == [("c", ABORTED, True), ("f", ABORTED, True)]
    assert seqs["c"].status == seqs["f"].status == SeqStatus.ABORTED
    assert fast.blocks.num_free == free_before + pages and fast.num_unfinished() == 5
    assert fast.abort(["c"]) == []  # ended already
    done += run_to_end(fast)
    assert sorted(c.id for c in done) == ["a", "b", "d", "e", "g"]
    check_same_tokens(done, want)
    assert len(seqs["c"].tokens.generated) == tokens  # the token of its last decode was dropped
    assert fast.blocks.num_free == free and fast.stats()["aborted"] == 2


def test_a_sequence_in_the_vision_stage_drops_the_blocks_it_never_wrote(model_dir):
    # One image per vision batch: after the first step `other` decodes and q0 still waits for
    # the tower, with the blocks of its prompt registered and read by no one else (it reads the
    # template's first 2 blocks from `other`).
    other, q0 = request("other", variant=5, max_new_tokens=6), vqa()[0]
    want = {c.id: c for c in engine(model_dir, block_size=4, prefix_cache=False).generate([other, q0])}
    fast = engine(model_dir, block_size=4, vision_batch_size=1)
    free = fast.blocks.num_free
    fast.add([other, q0])
    done = fast.step()
    seq = sequences(fast)["q0"]
    assert seq.status == SeqStatus.VISION and not seq.cache.others_wait
    reads, registered, cached = seq.cache.reads, len(seq.cache.writes), len(fast.blocks.cache)
    own_pages = len(seq.kv.pages) - sum(len(b.pages) for b in reads)
    free_before = fast.blocks.num_free
    assert len(reads) == 2 and all(b.users == 2 for b in reads)
    assert [c.id for c in fast.abort(["q0"])] == ["q0"]
    assert len(fast.blocks.cache) == cached - registered and fast.blocks.num_free == free_before + own_pages
    assert all(b.users == 1 for b in reads)  # `other` still reads them
    done += run_to_end(fast)
    assert [c.id for c in done] == ["other"]
    fast.add([vqa()[0]])  # the same prompt again: it computes its blocks itself, none is stale
    done += run_to_end(fast)
    check_same_tokens(done, want)
    blocks = fast.blocks
    assert blocks.num_used == 0 and blocks.num_free + blocks.num_cached == free


def test_a_sequence_others_read_from_stops_after_its_prefill(model_dir):
    # After the first step: `other` decodes; q0 waits for the tower; q1 and q2 read the
    # template's 2 blocks from `other` and q0's next 5, not written yet; q3 waits for a row. Aborting q0 now would leave q1
    # and q2 waiting forever: it stops once its prefill is launched. q1 stops at once.
    requests = [request("other", variant=5, max_new_tokens=6), *vqa()]
    want = {c.id: c for c in engine(model_dir, block_size=4, prefix_cache=False).generate(requests)}
    fast = engine(model_dir, block_size=4, vision_batch_size=1)
    fast.add(requests)
    done = fast.step()
    seqs = sequences(fast)
    assert [seqs[q].status for q in ("q0", "q1", "q2", "q3")] == [
        SeqStatus.VISION,
        SeqStatus.PREFILL,
        SeqStatus.PREFILL,
        SeqStatus.WAITING,
    ]
    template, shared = seqs["q1"].cache.reads[:2], seqs["q1"].cache.reads[2:]
    assert template == seqs["q0"].cache.reads and shared == seqs["q0"].cache.writes[:5]
    assert all(b.users == 3 and not b.ready for b in shared)
    assert [c.id for c in fast.abort(["q0", "q1"])] == ["q1"]
    assert seqs["q0"].abort_requested and seqs["q0"].status == SeqStatus.VISION
    assert all(b.users == 2 for b in shared)  # q1's uses are released
    stopped = fast.step()  # q0's vision batch and prefill
    assert [(c.id, c.error) for c in stopped] == [("q0", ABORTED)] and all(b.ready for b in shared)
    done += run_to_end(fast)
    assert sorted(c.id for c in done) == ["other", "q2", "q3"]
    check_same_tokens(done, want)
    blocks = fast.blocks
    assert blocks.num_used == 0 and blocks.cache.policy.num_pinned == 0
    assert all(block.users == 0 and block.ready for block in blocks.cache.blocks.values())
    assert fast.stats()["aborted"] == 2 and fast.stats()["images"] == 2  # q0's image encoded once


def test_a_static_batch_engine_drops_requests_before_its_step(tiny_model_dir):
    null = NullEngine(EngineConfig(str(tiny_model_dir)))
    null.add([request("a"), request("b"), request("c")])
    assert [(c.id, c.error) for c in null.abort(["b", "x"])] == [("b", ABORTED)]
    assert [c.id for c in null.step()] == ["a", "c"] and null.num_unfinished() == 0
