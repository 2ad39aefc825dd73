"""How many KV pages to allocate.

CPU: enough for `max_batch_size` sequences of `max_model_len` (or `num_kv_blocks`).
CUDA: after the weights are loaded, a warm-up at the largest shapes the engine will run
measures the activation peak of each phase: a full vision batch, a full packed prefill, a
max-batch decode with the sampling path. Vision runs on its own stream beside prefill/decode,
so the headroom is vision + max(prefill, decode). The pages get what is left of
`gpu_memory_utilization` of the device:
    budget = total * utilization - used_after_warm_up - headroom - reserve
(nano-vllm's rule, with per-phase peaks). The warm-up runs with a 2-page cache whose writes all
land on the null page.
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


def plan_pages(
    runner: ModelRunner, *, override, max_batch, max_len, vision_batch, prefill_tokens, utilization, reserve: int = 0
) -> int:
    """Pages in the pool, including the null page."""
    if override is not None:
        return override + 1
    if not runner.cuda:
        return max_batch * runner.layout.pages_for(max_len) + 1
    torch.cuda.empty_cache()
    runner.allocate_cache(2)
    peaks = warm_up(runner, vision_batch, prefill_tokens, max_batch)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    headroom = peaks["vision"] + max(peaks["prefill"], peaks["decode"])
    budget = total * utilization - (total - free) - headroom - reserve  # reserve: the vision cache
    c = runner.text_config
    pages = int(budget // runner.layout.page_bytes(c.num_key_value_heads, c.head_dim, runner.kv_dtype))
    gib = {phase: round(peak / 2**30, 2) for phase, peak in peaks.items()}
    log.info("KV budget %.2f GiB -> %d pages; activation peaks (GiB): %s", budget / 2**30, pages, gib)
    if pages < runner.layout.pages_for(max_len) + 1:
        raise ConfigError(
            f"only {max(pages, 0)} KV pages fit in GPU memory: not one {max_len}-token sequence "
            f"(budget {budget / 2**30:.2f} GiB = {total / 2**30:.1f} GiB x utilization {utilization} "
            f"- {(total - free) / 2**30:.2f} GiB in use - {headroom / 2**30:.2f} GiB activation headroom "
            f"- {reserve / 2**30:.2f} GiB vision cache)"
        )
    return pages


@torch.inference_mode()
def warm_up(runner: ModelRunner, vision_batch: int, prefill_tokens: int, max_batch: int) -> dict[str, int]:
    """Run each phase once at its largest shape; returns its activation peak in bytes."""
    return {
        "vision": _peak(lambda: _vision(runner, vision_batch)),
        "prefill": _peak(lambda: _prefill(runner, prefill_tokens)),
        "decode": _peak(lambda: _decode(runner, max_batch)),
    }


def _peak(run) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _vision(runner: ModelRunner, batch: int) -> None:
    if runner.parts.encoder is None:
        return  # a text-only checkpoint: no tower
    size = runner.parts.config.vision_config.image_size
    resized = torch.zeros(batch, size, size, 3, dtype=torch.uint8, device=runner.device)  # as uploaded
    runner.encode(runner.pixel_values(resized))


def _prefill(runner: ModelRunner, tokens: int) -> None:
    lengths = [PROFILE_PROMPT] * max(1, tokens // PROFILE_PROMPT)
    n, groups = sum(lengths), len(runner.layout.groups)

    def dev(array):
        return torch.from_numpy(np.asarray(array, dtype=np.int64)).to(runner.device)

    runner.prefill_logits(
        ids=dev(np.zeros(n)),
        positions=dev(np.concatenate([np.arange(k) for k in lengths])),
        slots=dev(np.zeros((groups, n))),
        image_rows=dev(np.zeros(0)),
        image_groups=dev(np.full((len(lengths), max(lengths)), -1)),
        last=dev(np.cumsum(lengths) - 1),
        layout=pack_layout(lengths, runner.device),
    )


def _decode(runner: ModelRunner, batch: int) -> None:
    rows = torch.full((batch,), runner.null_row, dtype=torch.int64, device=runner.device)
    logits = runner.decode_logits(rows, torch.zeros_like(rows))
    sampled = GenerationParams(temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True)
    runner.sampler(logits, SamplingBatch.build([sampled] * batch, [0] * batch, [0] * batch, runner.device))
