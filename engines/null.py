"""The `null` engine: answers every request at once with an empty text. It measures the queue
path alone (`wicore bench queue`) and needs neither torch nor a model."""

from __future__ import annotations

from wicore.engines.base import Completion, Engine, EngineRequest, reject_options


class NullEngine(Engine):
    name = "null"

    def __init__(self, config):
        super().__init__(config)
        reject_options(config, self.name)
        self.pending: list[EngineRequest] = []

    def add(self, requests: list[EngineRequest]) -> list[Completion]:
        self.requests_seen += len(requests)
        self.pending.extend(requests)
        return []

    def step(self) -> list[Completion]:
        done, self.pending = self.pending, []
        return [Completion(r.id, text="", token_ids=[], finish_reason="length") for r in done]

    def num_unfinished(self) -> int:
        return len(self.pending)
