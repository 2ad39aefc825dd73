"""The device side of a step: what landed since the last one, then the launches of a plan.

`land` (before the plan): finished vision batches are collected (their sequences may be
prefilled), finished restores landed in their pages, and disk reads started for waiting
sequences (admission counts those blocks as hits once read). `run` (the plan): the newly
admitted sequences' tables to the device and their restores queued (pinning their host blocks),
the blocks admission evicted copied down before anything writes their pages, the vision batch on
the side stream, the queued restores started; then decode on the main stream while the host
launches the prefill (a short prefix-cached prefill costs more host time than device time).
Sampled tokens come back as `Readbacks`, read by `Postprocess`.
"""

from __future__ import annotations

from collections.abc import Iterable

from wicore.engines.fast.device_handles import Readbacks
from wicore.engines.fast.image_stage import ImageStage
from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.sequence import Sequence
from wicore.engines.fast.sequence_tiers import SequenceTiers
from wicore.engines.fast.step_plan import Launched, StepPlan
from wicore.engines.kvcache.gpu_tier import PrefixCache
from wicore.engines.kvcache.tiers import KVTiers


class StepRunner:
    def __init__(self, model: ModelRunner, images: ImageStage, tiers: KVTiers, readbacks: Readbacks):
        self.model, self.images, self.tiers, self.readbacks = model, images, tiers, readbacks
        self.sequence_tiers = SequenceTiers(tiers)

    def land(self, waiting: Iterable[Sequence], cache: PrefixCache | None) -> int:
        """Take in what finished on the device; returns the vision batches still on it."""
        self.images.collect()
        self.tiers.land_finished()
        self.sequence_tiers.prefetch(waiting, cache)
        return self.images.num_queued

    def run(self, plan: StepPlan) -> Launched:
        for seq in plan.admitted:
            self._admit(seq)
        self.tiers.demote(plan.spills)  # before anything writes the reused pages
        images = self._vision(plan)
        self.tiers.land()  # this step's restores start behind the demotion's gather
        graphed = False
        if plan.decode:
            readback, graphed = self.model.decode(plan.decode)
            self.readbacks.add(plan.number, readback)
        if plan.prefill:  # its sequences decode from the next step on
            self.readbacks.add(plan.number, self.model.prefill(plan.prefill))
        return Launched(images, graphed)

    def _admit(self, seq: Sequence) -> None:
        if seq.kv.table is None:
            raise RuntimeError(f"sequence {seq.id} was admitted without a block table")
        self.model.set_table(seq.kv.row, seq.kv.table)
        self.sequence_tiers.start(seq)  # pins its host blocks: `demote` cannot reuse their slots

    def _vision(self, plan: StepPlan) -> int:
        """Launch the vision batch; returns the images it encodes. On CPU it is done at once and
        collected here, so its sequences are prefilled in this step (`Landing`)."""
        if not plan.vision:
            return 0
        images = self.images.launch(plan.vision, urgent=plan.urgent)
        self.images.collect()
        return images

    def reset(self) -> None:
        """Forget the work in flight (after a failed step)."""
        self.tiers.reset()
        self.images.reset()
        self.readbacks.clear()
