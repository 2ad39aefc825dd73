"""A request for `n` samples runs as `n` engine requests of one sample each, and their `n`
completions come back as one.

Sample i's request has id `<id>#sample<i>` and `params.sample(i)`: one sequence, its own seed
derived from the request's (`schemas.sample_seed`). The samples share the prompt, so on an engine
with a prefix cache samples 2..n read the first one's cached blocks. The merged completion is the
first sample's, with every sample in `Completion.samples`; if any sample failed it is that
failure (an abort stops all of them). Engines stay unaware of n: the worker's `EngineGate` and
`Engine.generate` split and merge.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

# engines.base's `EngineRequest` and `Completion` (dataclasses): `Engine.generate` runs through
# this module, so it names them without importing them.
EngineRequest = Any
Completion = Any

SEPARATOR = "#sample"


def sample_id(request_id: str, index: int) -> str:
    return f"{request_id}{SEPARATOR}{index}"


class SampleGroups:
    """The requests of n > 1 samples in flight: split on the way in, merged on the way out."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Completion | None]] = {}  # request id -> its samples' completions so far

    def split(self, requests: Iterable[EngineRequest]) -> list[EngineRequest]:
        """Each request of n > 1 samples as n requests; the others as they are."""
        out: list[EngineRequest] = []
        for request in requests:
            n = request.params.n
            if n == 1:
                out.append(request)
                continue
            self.groups[request.id] = [None] * n
            out += [replace(request, id=sample_id(request.id, i), params=request.params.sample(i)) for i in range(n)]
        return out

    def expand(self, request_ids: Iterable[str]) -> set[str]:
        """Request ids with each split request's replaced by its samples' ids."""
        ids: set[str] = set()
        for request_id in request_ids:
            samples = self.groups.get(request_id)
            ids |= {request_id} if samples is None else {sample_id(request_id, i) for i in range(len(samples))}
        return ids

    def merge(self, completions: Iterable[Completion]) -> list[Completion]:
        """The completions of whole requests: a sample's waits for its siblings."""
        out = []
        for completion in completions:
            parent, _, index = completion.id.rpartition(SEPARATOR)
            samples = self.groups.get(parent) if parent else None
            if samples is None:
                out.append(completion)
                continue
            samples[int(index)] = completion
            if all(sample is not None for sample in samples):
                del self.groups[parent]
                out.append(merged(parent, [s for s in samples if s is not None]))
        return out


def merged(request_id: str, samples: list[Completion]) -> Completion:
    """One completion of a request from its samples' (in index order)."""
    failed = next((s for s in samples if not s.ok), None)
    if failed is not None:
        return replace(failed, id=request_id, samples=[])
    first = samples[0]
    starts = [s.first_token_s for s in samples if s.first_token_s is not None]
    return replace(
        first,
        id=request_id,
        engine_s=max(s.engine_s for s in samples),
        first_token_s=min(starts) if starts else None,
        samples=samples,
    )
