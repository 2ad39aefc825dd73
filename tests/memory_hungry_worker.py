"""A worker process whose engine needs memory in proportion to its batch, run under an
address-space limit (RLIMIT_AS), so that a batch past the limit really fails to allocate.
tests/test_engine_gate.py starts it:

    python -m tests.memory_hungry_worker REDIS_URL BUDGET_MB

The engine asks PyTorch's CPU allocator for PER_REQUEST bytes per request in its batch (HUGE for
a request whose prompt says "huge"); the worker's EngineGate must split the batches that do not
fit. Prints {"done": jobs ended, "limit": the gate's batch limit at the end} as JSON.
"""

from __future__ import annotations

import json
import resource
import sys

import torch
from redis import Redis

from wicore.engines.base import Completion, EngineConfig, failed
from wicore.engines.null import NullEngine
from wicore.scheduler.policy import BatchPolicy
from wicore.worker.loop import BatchingWorker
from wicore.worker.worker_config import WorkerConfig

PER_REQUEST = 300 * 2**20
HUGE = 200 * PER_REQUEST  # does not fit even alone


class MemoryHungryEngine(NullEngine):
    name = "memory-hungry"

    def step(self) -> list[Completion]:
        batch = self.take_pending()
        need = sum(HUGE if "huge" in json.dumps(r.chat) else PER_REQUEST for r in batch)
        try:
            block = torch.empty(need, dtype=torch.uint8)  # address space only: never touched
        except RuntimeError as error:  # PyTorch's CPU allocator: "can't allocate memory"
            return [failed(r.id, error, input_error=False) for r in batch]
        del block
        return [Completion(r.id, text="", token_ids=[], finish_reason="length") for r in batch]


def address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    url, budget_mb = sys.argv[1], int(sys.argv[2])
    engine = MemoryHungryEngine(EngineConfig(model_dir="", max_batch_size=8))
    config = WorkerConfig("hungry", policy=BatchPolicy(max_batch_size=8, max_queue_delay_s=0), burst=True)
    worker = BatchingWorker(Redis.from_url(url), engine, config)
    limit = address_space_bytes() + budget_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(json.dumps({"done": worker.run(), "limit": worker.gate.limit}))


if __name__ == "__main__":
    main()
