"""`FastEngine`: the engine interface over scheduler + model runner.

A step: mark finished vision batches, schedule (admit, pick a vision batch, a prefill batch and
the decode batch), launch vision on the side stream, prefill and decode on the main stream,
then read back the sampled tokens that have reached the host and return the sequences that
ended. Tokens are read when they have landed, and waited for only once READ_LAG steps old: the
host plans and launches the next steps while the device runs, and a slow turn of the worker's
loop (results written, jobs claimed) finds steps queued on the device rather than an idle one.
A sequence that ended is decoded at most READ_LAG times more and those tokens are dropped (a
sequence that ends at max_new_tokens is never decoded past it).

The prefix cache (`kvcache.gpu_tier`, `kvcache.tiers`) adds to a step: disk reads started for waiting
sequences, restores from the host / disk tier queued for newly admitted ones, copies down for the
blocks admission evicted (before anything can write their pages), then the queued restores
started and finished ones landed in their pages before the prefill batch is picked.

`abort` stops sequences between steps (`sequence` has the lifecycle and its exception).
"""

from __future__ import annotations

import gc
import logging
import random
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict
from functools import partial

import torch

from wicore.engines.base import Completion, Engine, EngineConfig, EngineRequest, aborted, failed, is_out_of_memory
from wicore.engines.checkpoint import load_processor, torch_dtype
from wicore.engines.fast.device_handles import Readbacks
from wicore.engines.fast.engine_stats import EngineStats
from wicore.engines.fast.image_stage import ImageStage
from wicore.engines.fast.kv_budget import plan_pages
from wicore.engines.fast.kv_setup import build_prefix_cache, build_tiers
from wicore.engines.fast.model import fp8 as fp8_weights
from wicore.engines.fast.model.fp8 import weight_bytes
from wicore.engines.fast.model.weights import load_gemma3
from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.prompt_inputs import InputProcessor
from wicore.engines.fast.sampler import Sampler
from wicore.engines.fast.sequence import SeqStatus, Sequence
from wicore.engines.fast.sequence_tiers import SequenceTiers
from wicore.engines.fast.step_planner import StepPlanner
from wicore.engines.kvcache.block_manager import BlockManager
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.kvcache.prefix_keys import PromptKeyer, model_fingerprint
from wicore.engines.options import resolve_options
from wicore.engines.pending import Pending
from wicore.engines.text import finish_sequence, first_stop, stop_token_ids
from wicore.errors import JobInputError, PromptTooLong
from wicore.ops.attention import KV_FP8
from wicore.ops.image_preprocess import PreprocessSpec
from wicore.priority_pool import PriorityPool
from wicore.schemas import Lane

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.02  # longest wait inside a step that launched nothing
# A step's tokens are waited for once this many later steps have launched: with 2 the device ran
# out of queued work 6-8% of a bulk run on an H200 while the host was between steps, with 3 ~1%.
READ_LAG = 3
ADD_CHUNK = 64  # prompts `add` resizes and keys at a time (the reason: in `add`)


class FastEngine(Engine):
    name = "fast"

    def __init__(self, config: EngineConfig, *, fp8_anywhere: bool = False):
        """fp8_anywhere: run `gemm_dtype="fp8"` on any device torch's scaled matmul runs on (the
        CPU tests; slower than the model dtype there) instead of refusing all but FP8 GPUs."""
        super().__init__(config)
        self.resolved = opts = resolve_options(
            config.options,
            config.model_dir,
            device=config.device,
            max_batch_size=config.max_batch_size,
            cache=config.cache,
        )
        device = torch.device(config.device)
        fp8 = config.options.gemm_dtype == "fp8"
        fp8_attention = config.options.fp8_vision_attention
        if fp8 and not fp8_anywhere:
            fp8_weights.check_device(device, config.dtype)  # before the slow load
            if fp8_attention:
                fp8_weights.check_attention_device(device)
        if config.options.fp8_kv_cache:
            fp8_weights.check_kv_device(device)
        processor = load_processor(config.model_dir)
        self.tokenizer = processor.tokenizer
        self.eos_ids = stop_token_ids(config.model_dir, self.tokenizer)
        parts = load_gemma3(config.model_dir, device, config.dtype, config.seed)
        self.weights = (
            fp8_weights.quantize(parts, fp8_attention).as_dict() if fp8 else {"weight_bytes": weight_bytes(parts)}
        )
        if fp8_attention:
            fp8_weights.prepare_attention(parts.encoder.vision_tower, opts.vision_batch_size)
        self.max_len = opts.max_model_len
        if opts.torch_threads is not None:
            torch.set_num_threads(opts.torch_threads)  # process-wide: a worker process runs one engine
        self.inputs = InputProcessor(processor, parts.image_token_id, parts.tokens_per_image)
        self.runner, self.blocks = self._device_state(parts, device)
        text = parts.config.text_config
        layout = self.runner.layout
        self.tiers = build_tiers(self.runner.cache, opts, text.num_key_value_heads, text.head_dim)
        self.seq_tiers = SequenceTiers(self.tiers)
        # FP8 GEMMs (and attention) write other K/V; FP8 pages hold other bytes
        kv_tag = "kv-fp8" if config.options.fp8_kv_cache else None
        precision = "+".join(filter(None, (config.dtype, config.options.numerics_tag(), kv_tag)))
        model_id = model_fingerprint(config.model_dir, precision, layout)  # salts every key
        self.keyer = PromptKeyer(model_id, opts.block_size, parts.tokens_per_image)
        self.planner = StepPlanner(
            layout,
            self.blocks,
            config.max_batch_size,
            opts.vision_batch_size,
            opts.max_prefill_tokens,
            self.seq_tiers.holds,
            opts.prefix_split_images,
            opts.decode_interval_s,
        )
        threads = opts.preprocess_threads
        self.pool = PriorityPool(threads, "wicore-pixels") if threads else None  # a better lane's images first
        self.rng = random.Random(config.seed)  # seeds for sampled requests that bring none
        self.images = ImageStage(self.runner, self.inputs, self.pool, opts.vision_cache_bytes)
        self.readbacks = Readbacks()
        self.counters = EngineStats()

    def _device_state(self, parts, device) -> tuple[ModelRunner, BlockManager]:
        """The model runner with its KV cache sized and (CUDA) its graphs captured."""
        opts, config = self.resolved, self.config
        text = parts.config.text_config
        layout = KVLayout.build(text, opts.block_size, opts.max_model_len)
        sampler = Sampler(text.vocab_size, self.eos_ids, device)
        runner = ModelRunner(
            parts,
            layout,
            config.max_batch_size,
            sampler,
            device,
            torch_dtype(config.dtype),
            opts.overlap_vision,
            pixel_lut=self.inputs.pixel_spec.lut,
            paged_suffix=opts.paged_prefill_tokens,
            kv_dtype=KV_FP8 if config.options.fp8_kv_cache else None,
        )
        if opts.compile_vision:
            runner.compile_vision(opts.vision_batch_size, opts.vision_compile_mode)
        if opts.compile_text:
            runner.compile_text()
        if opts.vision_graph:  # before the KV budget: the graph's memory pool stays taken
            runner.capture_vision(opts.vision_batch_size)
        num_pages = plan_pages(
            runner,
            override=opts.num_kv_blocks,
            max_batch=config.max_batch_size,
            max_len=opts.max_model_len,
            vision_batch=opts.vision_batch_size,
            prefill_tokens=opts.max_prefill_tokens,
            utilization=opts.gpu_memory_utilization,
            reserve=opts.vision_cache_bytes,
        )
        runner.allocate_cache(num_pages)
        if opts.cuda_graphs:
            runner.capture_graphs(
                list(opts.graph_batch_sizes), list(opts.graph_prefill_tokens), opts.dense_prefill_graphs
            )
        fp8_weights.forget_attention_scales(parts.encoder.vision_tower)  # what the warm-ups saw
        if opts.cuda:
            torch.cuda.synchronize()  # setup ran on the default stream; steps run on others
        return runner, BlockManager(num_pages, build_prefix_cache(opts, num_pages, layout))

    # -- the interface ----------------------------------------------------------------------

    def add(self, requests: list[EngineRequest]) -> list[Completion]:
        if requests and not self.planner.num_unfinished:
            self.runner.clock.begin_trace()  # how this start fills the device (stats: start_trace)
        self.requests_seen += len(requests)
        rejected, seqs = [], []
        for request in requests:
            try:
                seqs.append(self._sequence(request))
            except JobInputError as error:
                rejected.append(failed(request.id, error, input_error=True))
        # A chunk at a time: its resizes go to the pool, then its prefix keys are hashed (here
        # for the first chunk, in the pool behind the chunk's resizes for the rest). Hashing 1,024
        # VQA prompts takes ~0.1 s: all of it before the first launch would leave the device idle,
        # all of it behind every resize of the call would hold admission back.
        for start in range(0, len(seqs), ADD_CHUNK):
            chunk = seqs[start : start + ADD_CHUNK]
            bad = {id(seq): error for seq, error in self.images.prepare(chunk)}
            for seq in chunk:
                if id(seq) in bad:
                    rejected.append(failed(seq.id, bad[id(seq)], input_error=True))
                    continue
                self._key(seq, inline=start == 0)
                self.planner.add(seq)
        self.counters.rejected += len(rejected)
        return rejected

    def attach_vision_cache(self, store) -> None:
        """A shared embedding store (`EmbeddingStore`: the worker's Redis layer) behind the
        engine's local vision cache."""
        self.images.attach_shared(store)

    def num_unfinished(self) -> int:
        return self.planner.num_unfinished

    def handover_size(self) -> int:
        return self.resolved.vision_batch_size

    def pixel_spec(self) -> PreprocessSpec:
        return self.inputs.pixel_spec

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Stop requests between steps: a waiting one leaves the queue, an admitted one gives its
        row and pages back now (a decode still in flight for it runs; its token is dropped). One
        whose cached blocks other sequences wait to read stops once its prefill is launched and
        its completion comes from that `step`. Ids it does not hold are ignored."""
        wanted = set(request_ids)
        done = []
        for seq in self.planner.sequences():
            if seq.id not in wanted or seq.abort_requested:
                continue
            if seq.cache.others_wait:
                seq.abort_requested = True  # `_step` stops it after its prefill
            else:
                done.append(self._abort(seq))
        return done

    def step(self) -> list[Completion]:
        done: list[Completion] = []
        failure: Exception | None = None
        try:
            with self.runner.on_main_stream():
                self._step(done)
        except Exception as error:  # a device failure must not take the worker down
            log.exception("fast engine step failed; failing %d requests", self.num_unfinished())
            failure = error
        if failure is not None:
            # The traceback's frames hold the failed step's activations and masks (gigabytes after
            # an out-of-memory prefill), and a log handler may keep the record: free their locals.
            traceback.clear_frames(failure.__traceback__)
            done += self._fail_all(failure)
        return done

    def describe(self) -> dict:
        return {**super().describe(), **asdict(self.resolved)}

    def stats(self) -> dict:
        report = self.counters.report(self.runner, self.blocks, self.planner)
        report = {**super().stats(), **report, **self.images.stats(), **self.tiers.counters(), **self.weights}
        report["cache"] = self.tiers.cache_stats(self.blocks.cache).to_dict()  # prefix KV tiers
        return report

    def close(self) -> None:
        """Give the device memory back now: the KV pool, graphs and weights are also reachable
        from the image stage, the tiers and reference cycles, so drop them at the source."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.tiers.close()
        self.images.close()
        if self.runner is not None:
            self.runner.release()
        self.runner = self.images = self.tiers = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- a step -----------------------------------------------------------------------------

    def _step(self, done: list[Completion]) -> None:
        """Appends to `done` as sequences end, so a failure later in the step loses none."""
        self._fail_unreadable_images(done)
        self.images.collect()
        self.seq_tiers.prefetch(self.planner.waiting, self.blocks.cache)
        # A full vision batch may queue behind another; a partial one only goes when no vision
        # work is queued (the device would idle), so the tower mostly runs full, compiled batches.
        queued = self.images.num_queued
        vision = self.planner.schedule_vision(self.resolved.vision_batches_queued - queued, allow_partial=not queued)
        for seq in self.planner.take_admitted():
            self.runner.set_table(seq.kv.row, seq.kv.table)
            self.seq_tiers.start(seq)  # pins its host blocks: `demote` cannot reuse their slots
        self.tiers.demote(self.blocks.take_evicted())  # before anything writes the reused pages
        if vision:  # a leading lane's batch is urgent (`StepPlanner`)
            self.counters.record_vision(self.images.launch(vision, urgent=self.planner.lead_rank is not None))
            self.images.collect()  # on CPU it is done already
        self.tiers.land()
        prefill, decode = self.planner.schedule_model(vision_busy=self.images.num_queued > 0)
        # Decode first: the device runs it while the host launches the prefill (a short
        # prefix-cached prefill costs more host time than device time).
        launched = 0
        step = self.counters.steps
        if decode:
            readback, graphed = self.runner.decode(decode)
            self.readbacks.add(step, readback)
            self.counters.record_decode(len(decode), graphed)
            launched += 1
        if prefill:  # its sequences decode from the next step on
            self.readbacks.add(step, self.runner.prefill(prefill))
            self.counters.record_prefill(prefill)
            self.planner.prefilled(prefill)
            done += [self._abort(seq) for seq in prefill if seq.abort_requested]
            launched += 1
        finished = self._read_tokens(step - READ_LAG, done)
        if not launched and not finished:
            self._wait_for_work()
        self.counters.steps += 1
        self.runner.clock.collect()  # fold finished GPU timings in; keeps the pending list short

    def _read_tokens(self, due: int, done: list[Completion]) -> int:
        """Process the readbacks whose tokens have landed, oldest first, waiting for those
        launched in step `due` or before unless a vision batch is done meanwhile (the side stream
        then gets its next batch rather than idling behind a prefill on the main one); returns
        how many sequences ended."""
        ended, wake = 0, self.images.any_done if self.images.num_queued else None
        for readback in self.readbacks.landed(due, wake):
            for seq, token in zip(readback.seqs, readback.tokens(), strict=True):
                if not seq.ended and self._append(seq, token):
                    done.append(self._finish(seq))
                    ended += 1
        return ended

    def _append(self, seq: Sequence, token: int) -> bool:
        """Record a token; True when the sequence ends with it."""
        generated = seq.tokens.generated
        generated.append(token)
        if len(generated) == 1:
            seq.timeline["first_token"] = time.perf_counter()
        params = seq.request.params
        if len(generated) >= seq.max_new or (not params.ignore_eos and token in self.eos_ids):
            return True
        if params.stop:
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            return first_stop(text, params.stop) is not None
        return False

    def _finish(self, seq: Sequence) -> Completion:
        ids, text, reason = finish_sequence(self.tokenizer, seq.tokens.generated, seq.request.params, self.eos_ids)
        self.planner.finish(seq)
        self.counters.record_finish(len(ids))
        if seq.request.priority is Lane.HIGH:
            self.counters.record_timeline(seq)
        first = seq.timeline.get("first_token")
        first_token_s = None if first is None else first - seq.added_at
        return Completion(
            seq.id, text, ids, reason, prompt_tokens=seq.prompt_len, engine_s=seq.age(), first_token_s=first_token_s
        )

    def _abort(self, seq: Sequence) -> Completion:
        self.images.drop(seq)
        self.planner.finish(seq, SeqStatus.ABORTED)
        self.counters.aborted += 1
        return aborted(seq.id, prompt_tokens=seq.prompt_len, engine_s=seq.age())

    def _wait_for_work(self) -> None:
        """Nothing ran this step: wait (briefly, so the worker can keep admitting) for what
        everything waits on instead of spinning."""
        if self.images.num_queued:  # until it finishes, or a paced decode batch is due
            self.images.wait(min(IDLE_WAIT_S, self.planner.decode_due_in()))
        elif self.readbacks:
            self.readbacks.wait_oldest()
        elif self.planner.waiting:
            self.planner.waiting[0].vision.pixels.wait(IDLE_WAIT_S)  # admission takes the head first

    # -- requests ---------------------------------------------------------------------------

    def _sequence(self, request: EngineRequest) -> Sequence:
        prompt = self.inputs.prompt(request.chat, len(request.images))
        params = request.params
        total = len(prompt.ids) + params.max_new_tokens
        if total > self.max_len:
            raise PromptTooLong(
                f"prompt of {len(prompt.ids)} tokens + {params.max_new_tokens} new tokens exceeds "
                f"max_model_len {self.max_len}"
            )
        if not self.planner.fits_ever(total):
            raise PromptTooLong(f"a {total}-token sequence does not fit in the KV cache")
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        return Sequence(request, prompt, seed)  # pixels or embeddings: ImageStage.prepare; then `_key`

    def _key(self, seq: Sequence, inline: bool) -> None:
        """Prefix-cache keys for a sequence that can be cached (one that never wraps a sliding
        ring). Hashed here with `inline`, else in the pixel threads behind the resizes queued
        before it, as are keys that hash decoded images (no hashes given)."""
        if self.blocks.cache is None or self.runner.layout.wraps(seq.max_len):
            return
        job = partial(self.keyer, seq.request, seq.prompt)
        hash_pixels = seq.request.images and not seq.request.image_hashes
        if self.pool is not None and (hash_pixels or not inline):
            seq.cache.keys = Pending(self.pool.submit(job, rank=seq.rank))
        else:
            seq.cache.keys = Pending.now(job())
        seq.cache.disk_lookup = self.tiers.disk is not None

    def _fail_unreadable_images(self, done: list[Completion]) -> None:
        """Images that failed to preprocess, at the head of the queue (admission stops there)."""
        for seq in self.planner.drop_unreadable():
            error = seq.vision.pixels.error
            done.append(failed(seq.id, f"image preprocessing failed: {error}", input_error=True))

    def _fail_all(self, error: Exception) -> list[Completion]:
        seqs = self.planner.fail_all()
        self.tiers.reset()
        self.blocks.drop_cache()  # blocks being written when the step failed are suspect
        self.images.reset()
        self.readbacks.clear()
        if self.resolved.cuda and is_out_of_memory(error):
            # The failed step's blocks stay cached in the allocator, split to the sizes it asked
            # for: hand them back so the smaller batch the worker retries with can use them.
            gc.collect()
            torch.cuda.empty_cache()
        return [failed(seq.id, error, input_error=False) for seq in seqs]
