"""The prefix cache's lower tiers as sequences meet them: disk reads started ahead for waiting
sequences (so admission can count those blocks as hits), whether a block a sequence asks for is
held below the GPU pool, and the restores of a newly admitted sequence. The tiers themselves
(`wicore.engines.kvcache.tiers.KVTiers`) move blocks by key and know no sequence.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from wicore.engines.fast.sequence import Sequence
from wicore.engines.kvcache.block_hashes import BlockHash
from wicore.engines.kvcache.gpu_tier import PrefixCache
from wicore.engines.kvcache.tiers import KVTiers
from wicore.engines.pending import Pending

log = logging.getLogger(__name__)
PREFETCH_AHEAD = 64  # waiting sequences (from the head) whose disk blocks are read ahead


class SequenceTiers:
    def __init__(self, tiers: KVTiers):
        self.tiers = tiers

    def holds(self, seq: Sequence, key: BlockHash) -> bool:
        """Whether the host tier, or the blocks prefetched from disk for `seq`, have `key`."""
        return self.tiers.in_host(key) or key in self._prefetched(seq)

    def prefetch(self, waiting: Iterable[Sequence], cache: PrefixCache | None) -> None:
        """Start disk reads for the first PREFETCH_AHEAD waiting sequences (`KVTiers.read_ahead`).
        Starting after a block no tier holds is useful too: a sequence admitted earlier may
        compute the missing blocks first (after a restart the hottest, first blocks of a prompt
        are usually nowhere, having never left the GPU). The blocks read wait in pinned memory
        until admission."""
        if self.tiers.disk is None or cache is None:
            return
        for seq in itertools.islice(waiting, PREFETCH_AHEAD):
            state = seq.cache
            hashing = state.keys is not None and not state.keys.ready
            unreadable = seq.vision.pixels.failed  # it fails before admission
            if not state.disk_lookup or state.prefetched is not None or hashing or unreadable:
                continue
            keys = seq.prompt_keys()
            if keys is None:
                state.disk_lookup = False
                continue
            state.prefetched = self.tiers.read_ahead(keys.keys, len(cache.match(keys.keys)))

    def start(self, seq: Sequence) -> None:
        """Queue the copies of an admitted sequence's `restores` (host or prefetched blocks)."""
        prefetched, seq.cache.prefetched = self._prefetched(seq), None
        keys = seq.prompt_keys()
        lookups = len(keys.keys) - len(seq.cache.reads) if keys is not None else 0
        self.tiers.queue_restores(seq.cache, prefetched, lookups)

    def _prefetched(self, seq: Sequence) -> dict:
        """The blocks read from disk for `seq` (once ready); a failed read leaves none."""
        read = seq.cache.prefetched
        if read is not None and read.failed:
            log.warning("disk tier: reading blocks for %s failed: %s", seq.id, read.error)
            seq.cache.prefetched = read = Pending.now({})
        return read.value if read is not None else {}
