"""One step of the fast engine, decided before any of it launches.

`StepPlanner.plan` makes it, `StepRunner.run` launches exactly it (and returns `Launched`),
`Postprocess.book` updates sequences, caches and counters from both: nothing else reaches
into the planner mid-step (vLLM v1's `SchedulerOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass

from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.kvcache.gpu_tier import CachedBlock


@dataclass(frozen=True)
class StepPlan:
    number: int  # the step's index: its sampled tokens are read READ_LAG steps later
    unreadable: list[Sequence]  # their images failed to preprocess: they fail, unrun
    admitted: list[Sequence]  # their tables go to the device and their restores are queued
    spills: list[CachedBlock]  # evicted from the GPU pool by admission: copied down before their pages are rewritten
    vision: list[Sequence]  # the vision batch ([]: none)
    urgent: bool  # the vision batch is a leading lane's: it goes ahead of those queued
    decode: list[Sequence]  # launched first: the device runs it while the host launches the prefill
    prefill: list[Sequence]


@dataclass(frozen=True)
class Launched:
    """What the runner's launches report back."""

    images: int  # encoded by the vision batch (some may have been cached or on their way)
    graphed: bool  # the decode batch replayed a CUDA graph


@dataclass(frozen=True)
class Landing:
    """What lands between planning a step and launching its model batches. On a device that
    finishes work as it is launched (CPU) that is the step's vision batch and every restore it
    queues, so their sequences are prefilled in the same step; on CUDA it is taken as nothing
    (what lands meanwhile is planned in the next step)."""

    vision: frozenset[int] = frozenset()  # ids of the sequences of the vision batch
    restoring: frozenset[int] = frozenset()  # ids of the sequences whose restores land
    restored: frozenset[int] = frozenset()  # ids of the blocks those restores write

    @classmethod
    def synchronous(cls, vision: list[Sequence], admitted: list[Sequence]) -> Landing:
        blocks = {id(r.block) for seq in admitted for r in seq.cache.restores if r.block is not None}
        return cls(frozenset(map(id, vision)), frozenset(map(id, admitted)), frozenset(blocks))

    def prefill_ready(self, seq: Sequence) -> bool:
        """Its embeddings are in and every cached block its prefill reads is written
        (`CacheState.blocks_ready` once this landing is in)."""
        vision_done = seq.status == SeqStatus.PREFILL or id(seq) in self.vision
        return vision_done and not self._restores(seq) and all(self._written(b) for b in seq.cache.reads)

    def others_wait(self, seq: Sequence) -> bool:
        """`CacheState.others_wait` once this landing is in."""
        return self._restores(seq) or any(b.users > 1 and not self._written(b) for b in seq.cache.writes)

    def _restores(self, seq: Sequence) -> bool:
        return bool(seq.cache.restores) and id(seq) not in self.restoring

    def _written(self, block: CachedBlock) -> bool:
        return block.ready or id(block) in self.restored
