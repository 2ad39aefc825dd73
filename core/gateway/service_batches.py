"""What the Files and Batches routes share: the file store, the Redis records, and the batch
runner thread every gateway runs beside its routes. Over a sharded redis_url, files, batches and
the batches' jobs live on the first shard."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis

from wicore.gateway.batch_driver import BatchSettings
from wicore.gateway.batch_runner import BatchRunner
from wicore.gateway.batch_state import BatchRecords, FileRecords
from wicore.gateway.file_store import open_store
from wicore.gateway.state import GatewayConfig

STOP_WAIT_S = 10.0  # how long shutdown waits for the runner's current step


class BatchService:
    def __init__(self, config: GatewayConfig):
        first_shard = config.redis_url.split(",")[0]
        self.connection = Redis.from_url(first_shard)
        self.store = open_store(config.files, self.connection)
        self.files = FileRecords(self.connection)
        self.batches = BatchRecords(self.connection)
        self.window_s = config.batch_window_s
        settings = BatchSettings(
            default_model=config.model,
            allowed_roots=config.allowed_roots,
            producer=config.producer,
            window_s=config.batch_window_s,
        )
        self.runner = BatchRunner(Redis.from_url(first_shard), self.store, settings)

    @contextmanager
    def running(self) -> Iterator[None]:
        """The runner's thread, for the app's lifetime; its leases go when it stops."""
        stop = threading.Event()
        thread = threading.Thread(target=self.runner.run, args=(stop,), name="batch-runner", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(STOP_WAIT_S)
            self.connection.close()
