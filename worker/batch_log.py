"""What a worker's log says about its work: one INFO line per batch once all of its jobs have
ended (bucket, size, how many failed or were canceled, milliseconds, output tokens per second) and
one WARNING per failed job with its reason. A batch is what one claim took from one bucket queue;
with continuous batching its jobs end at different steps, so its line comes with the last of them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from wicore.worker.rq_bridge import Claimed, Finished

log = logging.getLogger("wicore.worker.batches")


@dataclass
class Batch:
    queue: str
    size: int
    open: int  # jobs not ended yet
    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    failed: int = 0
    canceled: int = 0

    def line(self) -> str:
        seconds = max(1e-9, time.perf_counter() - self.started)
        ended = [f"{n} {word}" for n, word in ((self.failed, "failed"), (self.canceled, "canceled")) if n]
        notes = f" ({', '.join(ended)})" if ended else ""
        return (
            f"batch {self.queue}: {self.size} jobs{notes} in {seconds * 1000:.0f} ms, "
            f"{self.tokens / seconds:.1f} tokens/s"
        )


class BatchLog:
    def __init__(self) -> None:
        self.batches: dict[str, Batch] = {}  # run -> its batch

    def claimed(self, claimed: list[Claimed]) -> None:
        if claimed:
            batch = Batch(claimed[0].origin, len(claimed), open=len(claimed))
            self.batches.update((c.run, batch) for c in claimed)

    def ended(self, items: list[Finished]) -> None:
        for item in items:
            if item.error is not None:
                retry = " (will retry if it has retries left)" if item.retry else ""
                log.warning("job %s failed: %s%s", item.claimed.id, item.error, retry)
            batch = self.batches.pop(item.claimed.run, None)
            if batch is not None:
                self._count(batch, item)

    def _count(self, batch: Batch, item: Finished) -> None:
        batch.open -= 1
        batch.failed += item.error is not None
        batch.canceled += item.canceled
        tokens = (item.result or {}).get("output_tokens")
        batch.tokens += tokens if isinstance(tokens, int) else 0
        if batch.open == 0:
            log.info("%s", batch.line())
