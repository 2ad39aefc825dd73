"""The `null` engine: answers every request at once with an empty text. It measures the queue
path alone (`wicore bench queue`) and needs neither torch nor a model."""

from __future__ import annotations

from wicore.engines.base import Completion, StaticBatchEngine, reject_options


class NullEngine(StaticBatchEngine):
    name = "null"

    def __init__(self, config):
        super().__init__(config)
        reject_options(config, self.name)

    def step(self) -> list[Completion]:
        return [Completion(r.id, text="", token_ids=[], finish_reason="length") for r in self.take_pending()]
