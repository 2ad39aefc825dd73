"""Building the fast engine's parts from its config, in the order the device needs.

The options are resolved first, from the checkpoint's config (`resolve_options`); devices that
cannot run the asked precision are refused before the slow load; the weights load (and are
quantized for FP8 GEMMs); the model runner is built, compiled and captured before the KV budget
is measured (graph pools stay taken); the pool is allocated and the prefix cache's parts built
on it; then the step's owners: `StepPlanner`, `StepRunner`, `Postprocess`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from wicore.engines.base import EngineConfig
from wicore.engines.checkpoint import load_processor, require_gemma3, torch_dtype
from wicore.engines.fast.device_handles import Readbacks
from wicore.engines.fast.engine_stats import EngineStats
from wicore.engines.fast.fit import ModelDoesNotFit, check_fit
from wicore.engines.fast.image_stage import ImageStage
from wicore.engines.fast.kv_budget import plan_pages
from wicore.engines.fast.kv_setup import build_prefix_cache, build_tiers
from wicore.engines.fast.model import fp8 as fp8_weights
from wicore.engines.fast.model.loader import FP8Plan, load_gemma3
from wicore.engines.fast.model.weights import Gemma3Parts
from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.postprocess import Postprocess
from wicore.engines.fast.prompt_inputs import InputProcessor
from wicore.engines.fast.sampler import Sampler
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.fast.step_runner import StepRunner
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.kv_layout import KVCache, KVLayout
from wicore.engines.kvcache.prefix_keys import PromptKeyer, model_fingerprint
from wicore.engines.kvcache.tiers import KVTiers
from wicore.engines.options import ResolvedFastConfig, resolve_options
from wicore.engines.text import stop_token_ids
from wicore.ops.attention import KV_FP8
from wicore.priority_pool import PriorityPool

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    options: ResolvedFastConfig
    tokenizer: Any
    eos_ids: frozenset[int]
    weights: dict  # what `stats` reports of the weights and the start (bytes, FP8 figures, seconds to ready)
    inputs: InputProcessor
    runner: ModelRunner
    blocks: BlockManager
    tiers: KVTiers
    keyer: PromptKeyer
    planner: StepPlanner
    pool: PriorityPool | None  # the pixel threads (a better lane's images first); None: inline
    images: ImageStage
    step_runner: StepRunner
    post: Postprocess
    counters: EngineStats
    rng: random.Random  # seeds for sampled requests that bring none


def build(config: EngineConfig, fp8_anywhere: bool) -> EngineParts:
    """The engine's parts; running out of device memory on the way is a one-line refusal
    (exit 2), as the fit check's, whose estimate it outran."""
    require_gemma3(config.model_dir)
    try:
        return build_parts(config, fp8_anywhere)
    except torch.OutOfMemoryError as error:
        first = str(error).splitlines()[0] if str(error) else "out of memory"
        raise ModelDoesNotFit(
            f"the model does not fit: the device ran out of memory while starting ({first}); try --dtype fp8, "
            "a lower max_model_len or --batch-size, or a GPU with more memory"
        ) from None


def build_parts(config: EngineConfig, fp8_anywhere: bool) -> EngineParts:
    device = torch.device(config.device)
    check_device(config, device, fp8_anywhere)  # before the slow load
    options = resolve_options(
        config.options, config.model_dir, device=config.device, max_batch_size=config.max_batch_size, cache=config.cache
    )
    check_fit(config, options)  # before the slow load: one line and exit 2, not an OOM
    phases: dict[str, float] = {}
    started = time.perf_counter()
    processor = load_processor(config.model_dir)  # a tokenizer alone for a text-only checkpoint
    tokenizer = getattr(processor, "tokenizer", processor)
    eos_ids = stop_token_ids(config.model_dir, tokenizer)
    model = load_gemma3(config.model_dir, device, config.dtype, config.seed, fp8_plan(config))
    phases["load_s"] = model.report["load_s"]
    tower = None if model.encoder is None else model.encoder.vision_tower
    if tower is not None and config.options.gemm_dtype == "fp8" and config.options.fp8_vision_attention:
        fp8_weights.prepare_attention(tower, options.vision_batch_size)
    if options.torch_threads is not None:
        torch.set_num_threads(options.torch_threads)  # process-wide: a worker process runs one engine
    inputs = InputProcessor(processor, model.image_token_id, model.tokens_per_image)
    sampler = Sampler(model.text_config.vocab_size, eos_ids, device)
    with timed(phases, "compile_s"):
        runner = model_runner(config, options, model, inputs, sampler)
    blocks = kv_pool(config, options, runner, phases)
    if tower is not None:
        fp8_weights.forget_attention_scales(tower)  # what the warm-ups saw
    if options.cuda:
        torch.cuda.synchronize()  # setup ran on the default stream; steps run on others
    phases["ready_s"] = time.perf_counter() - started
    log_ready(phases, model.report)
    text = model.text_config
    tiers = build_tiers(allocated(runner), options, text.num_key_value_heads, text.head_dim)
    pool = PriorityPool(options.preprocess_threads, "wicore-pixels") if options.preprocess_threads else None
    images = ImageStage(runner, inputs, pool, options.vision_cache_bytes)
    step_runner = StepRunner(runner, images, tiers, Readbacks())
    planner = step_planner(config, options, runner.layout, blocks, step_runner)
    counters = EngineStats()
    post = Postprocess(planner, images, step_runner.readbacks, counters, runner.clock, tokenizer, eos_ids)
    keyer = PromptKeyer(prefix_model_id(config, runner.layout), options.block_size, model.tokens_per_image)
    weights = {**model.report, **{key: round(value, 3) for key, value in phases.items()}}
    return EngineParts(
        options, tokenizer, eos_ids, weights, inputs, runner, blocks, tiers, keyer, planner, pool, images,
        step_runner, post, counters, random.Random(config.seed),
    )  # fmt: skip


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's seconds to `phases[name]` (device work synchronized at its end)."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def log_ready(phases: dict[str, float], report: dict) -> None:
    """Time to ready at INFO: the load, compiling (with the vision graph's first run), the KV
    budget's warm-up (where the text layers compile), graph capture."""
    parts = ", ".join(f"{name.removesuffix('_s')} {seconds:.1f} s" for name, seconds in phases.items())
    peak = report.get("load_peak_bytes")
    peak_text = (
        ""
        if peak is None
        else f"; load peak {peak / 2**30:.2f} GiB for {report['weight_bytes'] / 2**30:.2f} GiB of weights"
    )
    log.info("engine ready: %s%s", parts, peak_text)


def fp8_plan(config: EngineConfig) -> FP8Plan | None:
    """FP8 GEMMs: the weights quantized layer by layer as they load."""
    if config.options.gemm_dtype != "fp8":
        return None
    return FP8Plan(vision_attention=config.options.fp8_vision_attention)


def check_device(config: EngineConfig, device: torch.device, fp8_anywhere: bool) -> None:
    """Refuse FP8 GEMMs, attention or KV pages on a device without them. `fp8_anywhere`: the
    GEMMs run wherever torch's scaled matmul does (the CPU tests)."""
    options = config.options
    if options.gemm_dtype == "fp8" and not fp8_anywhere:
        fp8_weights.check_device(device, config.dtype)
        if options.fp8_vision_attention:
            fp8_weights.check_attention_device(device)
    if options.fp8_kv_cache:
        fp8_weights.check_kv_device(device)


def model_runner(
    config: EngineConfig, options: ResolvedFastConfig, model: Gemma3Parts, inputs: InputProcessor, sampler: Sampler
) -> ModelRunner:
    """The model runner, compiled and its vision graph captured (before the KV budget: the
    graph's memory pool stays taken)."""
    text = model.text_config
    runner = ModelRunner(
        model,
        KVLayout.build(text, options.block_size, options.max_model_len),
        config.max_batch_size,
        sampler,
        torch.device(config.device),
        torch_dtype(config.dtype),
        options.overlap_vision,
        pixel_lut=None if inputs.pixel_spec is None else inputs.pixel_spec.lut,
        paged_suffix=options.paged_prefill_tokens,
        kv_dtype=KV_FP8 if config.options.fp8_kv_cache else None,
    )
    vision = model.encoder is not None  # a text-only checkpoint has no tower to compile or capture
    if vision and options.compile_vision:
        runner.compile_vision(options.vision_batch_size, options.vision_compile_mode)
    if options.compile_text:
        runner.compile_text()
    if vision and options.vision_graph:
        runner.capture_vision(options.vision_batch_size)
    return runner


def kv_pool(config: EngineConfig, options: ResolvedFastConfig, runner: ModelRunner, phases: dict) -> BlockManager:
    """The KV pages that fit beside everything else, allocated, their graphs captured."""
    with timed(phases, "kv_warm_up_s"):
        num_pages = plan_pages(
            runner,
            override=options.num_kv_blocks,
            max_batch=config.max_batch_size,
            max_len=options.max_model_len,
            vision_batch=options.vision_batch_size,
            prefill_tokens=options.max_prefill_tokens,
            utilization=options.gpu_memory_utilization,
            reserve=options.vision_cache_bytes,
        )
        runner.allocate_cache(num_pages)
    if options.cuda_graphs:
        with timed(phases, "graph_capture_s"):
            runner.capture_graphs(
                list(options.graph_batch_sizes), list(options.graph_prefill_tokens), options.dense_prefill_graphs
            )
    return BlockManager(num_pages, build_prefix_cache(options, num_pages, runner.layout))


def allocated(runner: ModelRunner) -> KVCache:
    if runner.cache is None:
        raise RuntimeError("the KV pool is built before the prefix cache's tiers")
    return runner.cache


def step_planner(
    config: EngineConfig, options: ResolvedFastConfig, layout: KVLayout, blocks: BlockManager, step_runner: StepRunner
) -> StepPlanner:
    return StepPlanner(
        layout,
        blocks,
        config.max_batch_size,
        options.vision_batch_size,
        options.max_prefill_tokens,
        step_runner.sequence_tiers.holds,
        options.prefix_split_images,
        options.decode_interval_s,
        options.vision_batches_queued,
        synchronous=not options.cuda,
    )


def prefix_model_id(config: EngineConfig, layout: KVLayout) -> str:
    """What salts every prefix key: the checkpoint and its numbers (FP8 GEMMs and attention write
    other K/V; FP8 pages hold other bytes)."""
    kv_tag = "kv-fp8" if config.options.fp8_kv_cache else None
    precision = "+".join(filter(None, (config.dtype, config.options.numerics_tag(), kv_tag)))
    return model_fingerprint(config.model_dir, precision, layout)
