"""CUDA graphs for decode, one per batch-size bucket.

A decode step's inputs are two small int64 vectors (table rows and positions); everything else
(token ids from `last_token`, cache slots, context lengths, block tables) is read on the device
by the captured code. A batch of B sequences replays the smallest bucket >= B, the extra rows
pointing at the null row (page 0, position 0), whose results are ignored. Buckets are captured
largest first and share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from wicore.ops.transfer import upload


class GraphRunner:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        sizes: list[int],
        null_row: int,
        device: torch.device,
    ):
        self.sizes = sorted(sizes)
        self.null_row = null_row
        largest = self.sizes[-1]
        self.rows = torch.full((largest,), null_row, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> logits [bucket, vocab]
        self.replays = 0
        self._capture(forward)

    @torch.inference_mode()
    def _capture(self, forward) -> None:
        pool = None
        for size in reversed(self.sizes):
            rows, positions = self.rows[:size], self.positions[:size]
            forward(rows, positions)  # warm up: kernel selection, Triton compilation
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward(rows, positions)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def bucket(self, batch: int) -> int:
        return next(size for size in self.sizes if size >= batch)

    def run(self, rows: list[int], positions: list[int]) -> torch.Tensor:
        """Replay for len(rows) sequences; returns logits [len(rows), vocab] (a view of the
        graph's output, valid until the next replay of the same bucket)."""
        batch = len(rows)
        size = self.bucket(batch)
        pad = size - batch
        inputs = upload([rows + [self.null_row] * pad, positions + [0] * pad], self.rows.device, torch.int64)
        self.rows[:size].copy_(inputs[0])
        self.positions[:size].copy_(inputs[1])
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:batch]
