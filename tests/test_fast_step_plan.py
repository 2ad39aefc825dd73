"""A step's plan: one `StepPlanner.plan` call decides admissions, the vision batch and the model
batches; on a synchronous device (CPU) the step's vision batch is counted as landed before its
prefill, on CUDA it is not (its sequences are prefilled in a later step)."""

from __future__ import annotations

from tests.test_fast_step_planner import F, S, sequence, text_config
from wicore.engines.fast.sequence import SeqStatus
from wicore.engines.fast.step_plan import Landing
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.gpu_tier import CachedBlock, Restore
from wicore.engines.kvcache.kv_layout import KVLayout


def planner(synchronous: bool) -> StepPlanner:
    layout = KVLayout.build(text_config([S, F], window=8), block_size=4, max_model_len=64)
    return StepPlanner(
        layout, BlockManager(500), max_rows=4, vision_batch=2, prefill_tokens=64, synchronous=synchronous
    )


def test_one_plan_holds_the_whole_step():
    plan_of = planner(synchronous=True)
    seqs = [sequence("text", 10, 4), sequence("image", 10, 4, images=1), sequence("late", 10, 4)]
    for seq in seqs[:2]:
        plan_of.add(seq)
    plan = plan_of.plan(number=7, vision_queued=0)
    assert plan.number == 7 and plan.unreadable == [] and plan.spills == [] and not plan.urgent
    assert [s.id for s in plan.admitted] == ["text", "image"] and [s.id for s in plan.vision] == ["image"]
    assert [s.id for s in plan.prefill] == ["text", "image"] and plan.decode == []  # CPU: its tower is done
    assert plan_of.take_admitted() == []  # the plan took them


def test_on_cuda_the_vision_batch_is_prefilled_in_a_later_step():
    plan_of = planner(synchronous=False)
    for seq in (sequence("text", 10, 4), sequence("image", 10, 4, images=1)):
        plan_of.add(seq)
    plan = plan_of.plan(number=0, vision_queued=0)
    assert [s.id for s in plan.vision] == ["image"] and [s.id for s in plan.prefill] == ["text"]
    plan_of.prefilled(plan.prefill)
    image = plan.vision[0]
    image.move(SeqStatus.PREFILL)  # its batch was collected
    later = plan_of.plan(number=1, vision_queued=0)
    assert later.vision == [] and later.prefill == [image] and [s.id for s in later.decode] == ["text"]


def test_a_landing_counts_restored_blocks_as_written():
    seq = sequence("reader", 10, 4)
    seq.move(SeqStatus.PREFILL)
    block = CachedBlock(b"k", (1, 2), 1.0, users=2, ready=False)
    seq.cache.reads, seq.cache.writes, seq.cache.restores = [block], [block], [Restore(b"k", (1, 2), block)]
    assert not Landing().prefill_ready(seq) and Landing().others_wait(seq)
    landing = Landing(restoring=frozenset({id(seq)}), restored=frozenset({id(block)}))
    assert landing.prefill_ready(seq) and not landing.others_wait(seq)
