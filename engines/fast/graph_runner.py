"""CUDA graphs of one forward function at bucketed sizes (decode: batch sizes; short prefills
over their pages: token counts).

A graph's inputs are a few int64 columns ([K, size]: table rows, positions, ...) and, for
prefill, the input embeddings ([size, hidden]), copied into persistent buffers before a replay;
everything else (decode's token ids from `last_token`, cache slots, context lengths, block
tables) is read on the device by the captured code. A call with n entries replays the smallest
bucket >= n, padded with each column's inert value (the null row, position 0, ...); the padding's
results are ignored. Buckets are captured largest first into
one memory pool, which the next `GraphRunner` may share: graphs replay one at a time on one
stream, so decode and prefill graphs can use the same memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class GraphRunner:
    def __init__(
        self,
        forward: Callable,  # (columns [K, size], embeds [size, hidden] | None) -> output [size, ...]
        sizes: list[int],
        fills: list[int],  # K: the padding value of each input column
        device: torch.device,
        pool=None,  # a memory pool to share (`GraphRunner.pool` of another runner)
        embeds: tuple[int, torch.dtype] | None = None,  # (hidden, dtype) of an embeddings input
    ):
        self.sizes = sorted(sizes)
        self.fills = np.asarray(fills, dtype=np.int64)[:, None]
        self.columns = torch.tensor(self.fills, device=device).repeat(1, self.sizes[-1])
        self.embeds = None if embeds is None else torch.zeros(self.sizes[-1], embeds[0], dtype=embeds[1], device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> output [bucket, ...]
        self.replays = 0
        self.pool = pool
        self._capture(forward)

    @torch.inference_mode()
    def _capture(self, forward) -> None:
        for size in reversed(self.sizes):
            columns = self.columns[:, :size]
            embeds = None if self.embeds is None else self.embeds[:size]
            forward(columns, embeds)  # warm up: kernel selection, Triton compilation
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = forward(columns, embeds)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def pad(self, columns: np.ndarray) -> np.ndarray:
        """columns [K, n] -> [K, bucket(n)], padded with the fills."""
        n = columns.shape[1]
        return np.concatenate([columns, np.repeat(self.fills, self.bucket(n) - n, axis=1)], axis=1)

    def replay(self, columns: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the bucket of padded columns [K, size] on the device (embeds: [size, hidden]);
        returns the graph's output [size, ...], valid until the bucket's next replay."""
        size = columns.shape[1]
        self.columns[:, :size].copy_(columns)
        if embeds is not None:
            self.embeds[:size].copy_(embeds)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size]
