"""Counters of the fast engine, for the benchmark and `wicore status`."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import torch

TIMELINES_KEPT = 64


@dataclass
class EngineStats:
    steps: int = 0
    images: int = 0
    prefill_batches: int = 0
    prefilled: int = 0  # sequences
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, taken from the prefix cache (not prefilled)
    decode_steps: int = 0
    generated_tokens: int = 0  # tokens of finished requests (after cutting at EOS / stop)
    graph_replays: int = 0
    eager_decodes: int = 0
    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    decode_batch_sizes: Counter = field(default_factory=Counter)  # batch size -> steps
    # images -> vision-tower launches; a launch short of `vision_batch_size` runs the eager tower
    vision_batch_sizes: Counter = field(default_factory=Counter)
    # The last high-lane sequences' timelines: seconds from `add` to each status, to the launch of
    # their vision batch and to their first token (where an interactive job's time goes).
    high_lane_timelines: deque = field(default_factory=lambda: deque(maxlen=TIMELINES_KEPT))

    def record_step(self, images: int, decode: list, graphed: bool, prefill: list) -> None:
        """A step's launches: `images` encoded by its vision batch, its decode and prefill
        batches (empty: not launched)."""
        self.record_vision(images)
        if decode:
            self.record_decode(len(decode), graphed)
        if prefill:
            self.record_prefill(prefill)
        self.steps += 1

    def record_prefill(self, seqs) -> None:
        self.prefill_batches += 1
        self.prefilled += len(seqs)
        self.prompt_tokens += sum(s.prompt_len for s in seqs)
        self.cached_prompt_tokens += sum(s.cache.prefix_len for s in seqs)

    def record_decode(self, batch: int, graphed: bool) -> None:
        self.decode_steps += 1
        self.decode_batch_sizes[batch] += 1
        if graphed:
            self.graph_replays += 1
        else:
            self.eager_decodes += 1

    def record_vision(self, images: int) -> None:
        if images:
            self.images += images
            self.vision_batch_sizes[images] += 1

    def record_finish(self, tokens: int) -> None:
        self.finished += 1
        self.generated_tokens += tokens

    def record_timeline(self, seq) -> None:
        self.high_lane_timelines.append({k: round(t - seq.added_at, 4) for k, t in seq.timeline.items()})

    def report(self, runner, blocks, planner) -> dict:
        seconds = runner.clock.collect() if runner is not None else {}
        steps = sum(self.decode_batch_sizes.values())
        mean_batch = sum(b * n for b, n in self.decode_batch_sizes.items()) / steps if steps else 0.0
        dense = runner.dense_graphs if runner is not None else None
        vision = runner.vision_graphs if runner is not None else None
        return {
            "vision_s": seconds.get("vision", 0.0),
            "prefill_s": seconds.get("prefill", 0.0),
            "decode_s": seconds.get("decode", 0.0),
            # The latest start from idle: [phase, start ms, end ms] of its first launches (`PhaseClock`).
            "start_trace": sorted(runner.clock.trace, key=lambda launch: launch[1]) if runner is not None else [],
            "steps": self.steps,
            "images": self.images,
            "prefill_batches": self.prefill_batches,
            "prompt_tokens": self.prompt_tokens,
            "mean_prompt_tokens": self.prompt_tokens / self.prefilled if self.prefilled else None,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "decode_steps": self.decode_steps,
            "generated_tokens": self.generated_tokens,
            "finished": self.finished,
            "rejected": self.rejected,
            "aborted": self.aborted,
            "mean_decode_batch": mean_batch,
            "max_decode_batch": max(self.decode_batch_sizes, default=0),
            "decode_batch_sizes": dict(sorted(self.decode_batch_sizes.items())),
            "vision_batch_sizes": dict(sorted(self.vision_batch_sizes.items())),
            "high_lane_timelines": list(self.high_lane_timelines),
            "graph_replays": self.graph_replays,
            "eager_decodes": self.eager_decodes,
            # Host seconds of guided steps: waiting for the last tokens, then filling the masks.
            **(runner.guided.stats() if runner is not None else {}),
            # Prefills over the pages alone (short suffixes) and how many replayed a graph.
            "paged_prefilled": runner.paged_prefilled if runner is not None else 0,
            "prefill_graph_replays": runner.prefill_graphs.replays
            if runner is not None and runner.prefill_graphs is not None
            else 0,
            # Dense prefills that replayed a graph of their shape, and the shapes graphed.
            "dense_graph_replays": dense.replays if dense is not None else 0,
            "dense_graphs": len(dense.graphs) if dense is not None else 0,
            # Full vision batches that replayed the tower's graph.
            "vision_graph_replays": vision.replays if vision is not None else 0,
            "kv_pages": blocks.num_pages - 1,  # the pool (without the null page): sized from memory on CUDA
            "kv_pages_used": blocks.num_used,
            "kv_pages_free": blocks.num_free,
            "kv_pages_cached": blocks.num_cached,  # held only by the prefix cache (evictable)
            "kv_block_size": planner.layout.block_size,
            "kv_dtype": str(runner.kv_dtype).removeprefix("torch.") if runner is not None else None,
            "waiting": len(planner.waiting),
            "admitted": planner.num_admitted,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(runner.device)
            if runner is not None and runner.cuda
            else None,
        }
