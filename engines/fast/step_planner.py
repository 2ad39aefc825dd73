"""Which sequences do what in the next step.

Admission in lane order (`Sequence.rank`: the job's priority), first come first within a lane:
the head of the waiting queue is admitted when a table row and every KV page it can ever need
(prompt + max_new_tokens) are free, so a running sequence never waits for memory and nothing is
preempted. Admitted sequences go through the vision tower in batches of about `vision_batch`
images, are prefilled together (up to `prefill_tokens` tokens a step) and then decode one token
per step until they finish; finished sequences give their pages and row back.

Lanes: while admitted sequences belong to more than one lane, the best of them leads
(`lead_rank`): only its sequences get vision batches, prefills and decode steps; the others keep
their rows and pages and go on once it has none left admitted. A leading sequence's images go at
once, in a batch of their own (the engine runs it ahead of the vision batches already queued),
and its prefill is never behind another lane's. A sequence of another lane whose blocks a
leading one waits to read (`CacheState.others_wait`) keeps its vision and prefill. Only admitted
sequences lead: one waiting for pages never holds back the sequences whose end frees them.

With the prefix cache (`blocks.cache`), a sequence that never wraps a sliding ring is admitted
through `prefix_admission.place_cached`: it takes the cached blocks of its prompt's prefix, only
its suffix is prefilled, and it needs the vision tower only for images in that suffix. Its
prefill waits until the blocks it reads are `ready` (computed by an earlier sequence's prefill,
or restored from a lower tier). The decode batch is ordered by pages, so the sharers of a prefix
sit side by side: the attention kernel's neighbouring programs read those pages at about the
same time, the later reads from L2 (~11% of the kernel's time for pairs, over sharers spread
through the batch; docs/benchmarks.md).

Decode pacing (`decode_interval`, bulk throughput): a decode step costs a fixed part (the weights'
reads, the launches) plus a part per sequence. While a vision batch keeps the device busy, the
decode batch may wait until `decode_interval` after the last decode step, so it runs less often
and larger and the tower gets the device time saved. A full batch, or one holding a sequence of
the best lane, never waits, nor does any when no vision batch is on the device (the device
would idle).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Hashable

import numpy as np

from wicore.engines.fast.prefix_admission import LowerTiers, place_cached
from wicore.engines.fast.sequence import KVSlot, SeqStatus, Sequence
from wicore.engines.fast.step_plan import Landing, StepPlan
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.schemas import Lane

# Key cells a prefill may gather per layer ([batch, longest prompt]), per token of its budget: a
# batch of short suffixes over cached prefixes reads many more keys than it computes tokens. The
# warm-up measures a plain prefill (keys = tokens); the extra transient K/V copies (2 x 4 KiB a
# cell on the 4B) fit in the memory the pool leaves free (`gpu_memory_utilization`).
KEY_CELLS = 2
NOTHING_LANDS = Landing()


def _no_lower_tier(seq: Sequence, key: bytes) -> bool:
    return False


class StepPlanner:
    def __init__(
        self,
        layout: KVLayout,
        blocks: BlockManager,
        max_rows: int,
        vision_batch: int,
        prefill_tokens: int,
        lower: LowerTiers = _no_lower_tier,  # whether the host / disk tier holds a block
        split_images: bool = False,  # a cached prefix may end inside an image (`usable_prefix`)
        decode_interval: float = 0.0,  # seconds (module docstring: decode pacing)
        vision_batches_queued: int = 1,  # vision batches that may be on the device at once
        synchronous: bool = False,  # the device finishes work as it is launched (CPU; `Landing`)
    ):
        self.layout, self.blocks, self.lower, self.split_images = layout, blocks, lower, split_images
        self.max_rows, self.decode_interval = max_rows, decode_interval
        self.last_decode = -float("inf")  # perf_counter of the last decode batch handed out
        self.decode_paced = False  # the last `schedule_model` held its decode batch back
        self.vision_batch, self.prefill_tokens = vision_batch, prefill_tokens
        self.vision_batches_queued, self.synchronous = vision_batches_queued, synchronous
        self.key_cells = KEY_CELLS * prefill_tokens
        self.free_rows = deque(range(max_rows))
        self.waiting: deque[Sequence] = deque()  # by rank, then arrival
        self.admitted: list[Sequence] = []  # VISION, PREFILL and DECODE, in admission order
        self.newly_admitted: list[Sequence] = []
        self.admitted_ranks: Counter[int] = Counter()  # admitted sequences per lane rank (none at 0)

    def add(self, seq: Sequence) -> None:
        """Queued behind every waiting sequence of its lane or a better one."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].rank > seq.rank:
            at -= 1
        self.waiting.insert(at, seq)

    def sequences(self) -> list[Sequence]:
        """Every sequence it holds: the waiting ones (in admission order), then the admitted ones."""
        return [*self.waiting, *self.admitted]

    @property
    def lead_rank(self) -> int | None:
        """The rank of the lane that alone runs while admitted sequences span several lanes
        (module docstring); None when they are all of one lane."""
        return min(self.admitted_ranks) if len(self.admitted_ranks) > 1 else None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.admitted)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` positions fits in the pool at all."""
        return self.layout.pages_for(num_tokens) <= self.blocks.num_pages - 1

    def plan(self, number: int, vision_queued: int) -> StepPlan:
        """Step `number`, with `vision_queued` vision batches on the device. A full vision batch
        may queue behind another; a partial one goes only when none is queued (the device would
        idle), so the tower mostly runs full, compiled batches. On a synchronous device the
        step's vision batch and restores are done before its model batches launch (`Landing`)."""
        unreadable = self.drop_unreadable()
        vision = self.schedule_vision(self.vision_batches_queued - vision_queued, allow_partial=not vision_queued)
        admitted = self.take_admitted()
        landing = Landing.synchronous(vision, admitted) if self.synchronous else NOTHING_LANDS
        vision_busy = not self.synchronous and vision_queued + bool(vision) > 0
        prefill, decode = self.schedule_model(vision_busy, landing)
        urgent = self.lead_rank is not None
        return StepPlan(number, unreadable, admitted, self.blocks.take_evicted(), vision, urgent, decode, prefill)

    def schedule_vision(self, vision_slots: int, allow_partial: bool = True) -> list[Sequence]:
        """Admit what fits, then pick the next vision batch if `vision_slots` (batches that may
        still be queued on the device) allows one. A batch short of `vision_batch` images goes
        only with `allow_partial` (the engine allows it when the device would otherwise idle),
        and not while the queue's head waits only for its images to be resized: they join it
        within a resize, where a short batch would run the eager tower on a few images.
        A leading lane's batch goes whatever the slots and its size (module docstring)."""
        self._admit()
        lead = self.lead_rank
        if lead is None and vision_slots <= 0:
            return []
        batch, images = self._vision_batch(lead)
        if lead is None and images < self.vision_batch and (not allow_partial or self._pixels_coming()):
            return []
        now = time.perf_counter()
        for seq in batch:
            seq.vision.launched = True
            seq.timeline["vision_launched"] = now
        return batch

    def _pixels_coming(self) -> bool:
        """The head of the queue has a row to go to and waits only for its images' resize."""
        if not self.waiting or not self.free_rows:
            return False
        head = self.waiting[0]
        return head.num_images > 0 and not head.vision.pixels.ready

    def take_admitted(self) -> list[Sequence]:
        """Sequences admitted since the last call (their tables must reach the device)."""
        admitted, self.newly_admitted = self.newly_admitted, []
        return admitted

    def schedule_model(
        self, vision_busy: bool = False, landing: Landing = NOTHING_LANDS
    ) -> tuple[list[Sequence], list[Sequence]]:
        """(prefill batch, decode batch) of this step; `vision_busy`: a vision batch is on the
        device, so the decode batch may wait (module docstring: decode pacing); `landing`: what
        is done before they launch."""
        lead = self.lead_rank
        decode = [s for s in self.admitted if s.wants_decode and (lead is None or s.rank <= lead)]
        now = time.perf_counter()
        self.decode_paced = bool(decode) and vision_busy and self._decode_waits(decode, now)
        if self.decode_paced:
            decode = []
        if decode:
            self.last_decode = now
        if self.blocks.cache is not None:
            decode.sort(key=_pages_key)  # sharers of a prefix side by side (module docstring)
        return self._take_prefill(lead, landing), decode

    def decode_due_in(self) -> float:
        """Seconds until the decode batch this step held back goes anyway (inf: none held back)."""
        if not self.decode_paced:
            return float("inf")
        return max(0.0, self.last_decode + self.decode_interval - time.perf_counter())

    def _decode_waits(self, decode: list[Sequence], now: float) -> bool:
        if len(decode) >= self.max_rows or min(seq.rank for seq in decode) == Lane.HIGH.rank:
            return False
        return now < self.last_decode + self.decode_interval

    def _admit(self) -> None:
        while self.waiting and self.free_rows:
            seq = self.waiting[0]
            if not seq.admissible or not self._place(seq):
                return
            self.waiting.popleft()
            seq.kv.row = self.free_rows.popleft()
            seq.move(SeqStatus.VISION if seq.needs_vision else SeqStatus.PREFILL)
            self.admitted.append(seq)
            self.admitted_ranks[seq.rank] += 1
            self.newly_admitted.append(seq)

    def _place(self, seq: Sequence) -> bool:
        """Pages and table for `seq`; False when they do not fit yet."""
        cache = self.blocks.cache
        keys = seq.prompt_keys() if cache is not None else None
        if cache is not None and keys is not None:
            with cache.stats.timed():  # the GPU tier's host time: matching, taking hits
                return place_cached(seq, keys, self.blocks, self.layout, self.lower, self.split_images)
        need = self.layout.pages_for(seq.max_len)
        if not self.blocks.can_allocate(need):
            return False
        seq.kv.pages = self.blocks.allocate(need)
        seq.kv.table = self._table(seq.kv.pages, seq.max_len)
        return True

    def _table(self, pages: list[int], num_tokens: int) -> np.ndarray:
        """[groups, width] int32: the pages of each group's logical blocks (0 = null page)."""
        table = np.zeros((len(self.layout.groups), self.layout.table_width), dtype=np.int32)
        taken = 0
        for g, group in enumerate(self.layout.groups):
            count = self.layout.blocks(group, num_tokens)
            table[g, :count] = pages[taken : taken + count]
            taken += count
        return table

    def _vision_batch(self, lead: int | None) -> tuple[list[Sequence], int]:
        """(sequences, distinct images among them): an image several of them ask about is
        encoded once, so it counts once towards `vision_batch`."""
        batch: list[Sequence] = []
        images: set[Hashable] = set()
        for seq in self.admitted:
            if seq.status == SeqStatus.VISION and not seq.vision.launched and _runs(seq, lead):
                new = _image_ids(seq) - images
                if batch and len(images) + len(new) > self.vision_batch:
                    break
                batch.append(seq)
                images |= new
        return batch, len(images)

    def _take_prefill(self, lead: int | None, landing: Landing) -> list[Sequence]:
        """Ready sequences, oldest first, while the batch padded to its longest uncached suffix
        (the tokens it computes) stays within `prefill_tokens`, and padded to its longest
        prompt (the keys each layer gathers for attention) within KEY_CELLS x that."""
        batch: list[Sequence] = []
        suffix, prompt = 0, 0
        for seq in self.admitted:
            if landing.prefill_ready(seq) and (lead is None or seq.rank <= lead or landing.others_wait(seq)):
                suffix_next = max(suffix, seq.prompt_len - seq.cache.prefix_len)
                prompt_next = max(prompt, seq.prompt_len)
                size = len(batch) + 1
                if batch and (size * suffix_next > self.prefill_tokens or size * prompt_next > self.key_cells):
                    break
                batch.append(seq)
                suffix, prompt = suffix_next, prompt_next
        return batch

    def prefilled(self, seqs: list[Sequence]) -> None:
        """Their prefill is queued: they decode next, and the blocks they registered are ready
        for any later prefill on the same stream."""
        for seq in seqs:
            seq.move(SeqStatus.DECODE)
            for block in seq.cache.writes:
                block.ready = True

    def finish(self, seq: Sequence, status: SeqStatus = SeqStatus.FINISHED) -> None:
        """The sequence ends with `status`. A waiting one leaves the queue; an admitted one gives
        its pages and row back. Its cached blocks stay (evictable once no one uses them), but for
        blocks it registered and never wrote (it stopped before its prefill), which leave the
        cache. Work already queued on the device for it runs before anything queued later, so
        the next owner of its pages cannot be overwritten."""
        waiting = seq.status == SeqStatus.WAITING
        seq.move(status)
        if waiting:
            self.waiting.remove(seq)
            return
        self.admitted.remove(seq)
        self.admitted_ranks -= Counter({seq.rank: 1})  # drops the rank at 0
        self.blocks.release(seq.kv.pages)
        unwritten = seq.cache.unwritten()
        dropped = {id(block) for block in unwritten}
        self.blocks.release_blocks([b for b in seq.cache.held if id(b) not in dropped])
        self.blocks.forget(unwritten)
        self.free_rows.append(seq.kv.row)
        seq.kv, seq.cache.reads, seq.cache.writes, seq.cache.restores = KVSlot(), [], [], []

    def drop_unreadable(self) -> list[Sequence]:
        """Waiting sequences at the head whose images failed to preprocess (admission stops at
        them), out of the queue and FAILED."""
        dropped = []
        while self.waiting and self.waiting[0].vision.pixels.failed:
            dropped.append(self.waiting[0])
            self.finish(self.waiting[0], SeqStatus.FAILED)
        return dropped

    def fail_all(self) -> list[Sequence]:
        """Every sequence it holds, FAILED, with its row and pages given back (a step failed)."""
        seqs = self.sequences()
        for seq in seqs:
            self.finish(seq, SeqStatus.FAILED)
        self.newly_admitted.clear()
        return seqs

    @property
    def num_admitted(self) -> int:
        return len(self.admitted)


def _runs(seq: Sequence, lead: int | None) -> bool:
    """Whether its vision and prefill may go now: no lane leads, it is of the leading lane, or a
    sequence waits to read blocks it writes."""
    return lead is None or seq.rank <= lead or seq.cache.others_wait


def _pages_key(seq: Sequence) -> bytes:
    """Orders sequences by their first group's pages: equal leading pages (a shared prefix) end
    up adjacent, like keys in a trie."""
    table = seq.kv.table
    return table[0].tobytes() if table is not None else b""


def _image_ids(seq: Sequence) -> set:
    """What identifies each of the sequence's images: its key (sha256), or (sequence, index)
    for an image without one."""
    return {(seq.id, i) if key is None else key for i, key in enumerate(seq.image_keys)}
