"""CUDA graphs of one forward function: at bucketed sizes (`GraphRunner`: decode batch sizes,
token counts of short prefills over their pages), or per exact input shape, captured once a shape
repeats or when asked (`ShapeGraphs`: the dense prefill, whose shapes repeat in bulk work; the
vision tower's full batch).

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

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)


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


class ShapeGraphs:
    """CUDA graphs of `forward` (a dict of device tensors -> one output tensor), one per exact
    set of input shapes. The first call of a shape runs eagerly (None: the caller runs it),
    which compiles and tunes its kernels; the second captures a graph, and every later one
    copies its inputs into the graph's buffers and replays it. At most `limit` shapes get a
    graph; others always run eagerly. The graphs share one memory pool (they replay one at a
    time on one stream), so an output is valid until the next replay of any of them.

    Capturing synchronizes the device once (torch.cuda.graph does); other threads may use CUDA
    meanwhile (a thread-local capture). A capture that fails (out of memory, an operation a
    graph cannot hold) is logged and ends the captures: the graphs made so far still replay.

    `own_stream`: capture on a stream of these graphs' own. PyTorch keys cuBLAS's workspace by
    (handle, stream), so every graph captured on torch.cuda.graph's default capture stream bakes
    in the same workspace: graphs replayed at the same time on different streams (the tower's
    beside the decoder's) would race on it and corrupt each other's GEMMs (split-K partials)."""

    def __init__(
        self, forward: Callable[[dict[str, torch.Tensor]], torch.Tensor], limit: int, own_stream: bool = False
    ):
        self.forward, self.limit, self.pool = forward, limit, None
        # From the high-priority pool: torch hands out pooled streams round-robin (32 a pool), so a
        # normal-priority one made 32 streams after torch.cuda.graph's default capture stream is
        # that stream again. A capture stream's priority only matters while capturing.
        self.capture_stream = torch.cuda.Stream(priority=-1) if own_stream else None  # None: the default
        self.seen: Counter[tuple] = Counter()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.replays = 0

    @staticmethod
    def key(inputs: dict[str, torch.Tensor]) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items()))

    @torch.inference_mode()
    def capture(self, inputs: dict[str, torch.Tensor]) -> bool:
        """Capture the shape of `inputs` now (after a warm-up call of `forward`: compiling and
        tuning are not captured); False when the capture failed (logged; this shape and new
        ones run eagerly)."""
        key = self.key(inputs)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(inputs)
            except Exception as error:  # out of memory, an op that cannot be captured: stay eager
                self.limit = len(self.graphs)
                log.warning("CUDA graph capture failed, new shapes run eagerly: %s", str(error).splitlines()[0])
                return False
        return True

    @torch.inference_mode()
    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The output of a replay (valid until the next replay of any graph in the pool), or None:
        the caller runs `forward` eagerly."""
        key = self.key(inputs)
        if key not in self.graphs:
            self.seen[key] += 1
            if self.seen[key] < 2 or len(self.graphs) >= self.limit or not self.capture(inputs):
                return None
        graph, static, output = self.graphs[key]
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        self.replays += 1
        return output

    def _capture(self, inputs: dict[str, torch.Tensor]):
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as torch.cuda.graph does: what is reserved after it is the pools'
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):
                output = self.forward(static)
        except Exception:
            # torch.cuda.graph leaves its capture stream current when ending a failed capture raises
            torch.cuda.set_stream(caller)
            raise
        self.pool = graph.pool()
        shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in inputs.items())
        grown = (torch.cuda.memory_reserved() - reserved) / 2**30
        log.info(
            "CUDA graph %d of at most %d captured (%s): %+.2f GiB reserved",
            len(self.graphs) + 1,
            self.limit,
            shapes,
            grown,
        )
        return graph, static, output
