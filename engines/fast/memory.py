"""How many KV pages to allocate.

CPU: enough for `max_batch_size` sequences of `max_model_len` (or `num_kv_blocks`).
CUDA: after the weights are loaded, one warm-up pass at the largest shapes the engine will run
(a full vision batch, a full packed prefill, a max-batch decode with the sampling path) measures
peak activation memory; the pages are what is left of `gpu_memory_utilization` of the device:
    budget = total * utilization - used_now - (peak_activations - allocated_now)
(nano-vllm's rule). The warm-up runs with a 2-page cache whose writes all land on the null page.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.sampler import SamplingBatch
from wicore.errors import ConfigError
from wicore.ops.attention import pack_layout
from wicore.schemas import GenerationParams

log = logging.getLogger(__name__)
PROFILE_PROMPT = 1024  # tokens per dummy prompt of the warm-up prefill


def plan_pages(runner: ModelRunner, *, override, max_batch, max_len, vision_batch, prefill_tokens, utilization) -> int:
    """Pages in the pool, including the null page."""
    if override is not None:
        return override + 1
    if not runner.cuda:
        return max_batch * runner.layout.pages_for(max_len) + 1
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runner.allocate_cache(2)
    warm_up(runner, vision_batch, prefill_tokens, max_batch)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(runner.device)
    peak, current = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    budget = total * utilization - (total - free) - (peak - current)
    c = runner.text_config
    pages = int(budget // runner.layout.page_bytes(c.num_key_value_heads, c.head_dim, runner.dtype))
    log.info(
        "KV budget %.2f GiB -> %d pages (peak activations %.2f GiB)", budget / 2**30, pages, (peak - current) / 2**30
    )
    if pages < runner.layout.pages_for(max_len) + 1:
        raise ConfigError(f"only {max(pages, 0)} KV pages fit in GPU memory: not one {max_len}-token sequence")
    return pages


@torch.inference_mode()
def warm_up(runner: ModelRunner, vision_batch: int, prefill_tokens: int, max_batch: int) -> None:
    vision = runner.parts.config.vision_config
    pixels = torch.zeros(
        vision_batch, 3, vision.image_size, vision.image_size, device=runner.device, dtype=runner.dtype
    )
    runner.encode(pixels)
    lengths = [PROFILE_PROMPT] * max(1, prefill_tokens // PROFILE_PROMPT)
    n, groups = sum(lengths), len(runner.layout.groups)

    def dev(array):
        return torch.from_numpy(np.asarray(array, dtype=np.int64)).to(runner.device)

    logits = runner.prefill_logits(
        ids=dev(np.zeros(n)),
        positions=dev(np.concatenate([np.arange(k) for k in lengths])),
        slots=dev(np.zeros((groups, n))),
        image_rows=dev(np.zeros(0)),
        image_groups=dev(np.full((len(lengths), max(lengths)), -1)),
        last=dev(np.cumsum(lengths) - 1),
        layout=pack_layout(lengths, runner.device),
    )
    del logits
    rows = torch.full((max_batch,), runner.null_row, dtype=torch.int64, device=runner.device)
    logits = runner.decode_logits(rows, torch.zeros_like(rows))
    sampled = GenerationParams(temperature=1.0, top_k=50, top_p=0.9)
    runner.sampler(logits, SamplingBatch.build([sampled] * max_batch, [0] * max_batch, [0] * max_batch, runner.device))
