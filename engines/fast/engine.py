"""`FastEngine`: the engine interface over a planner, a runner and a postprocess.

A step reads plan -> run -> postprocess (nano-vllm's `step`, vLLM v1's scheduler output): the
runner first takes in what landed on the device since the last step (vision batches, restores;
disk reads started for waiting sequences), the planner makes the step's one `StepPlan`
(admissions, the vision batch, the blocks to copy down, the prefill and decode batches), the
runner launches exactly it, and `Postprocess` books the results (sequences prefilled, tokens
read back, sequences ended, counters). `engine_builder` builds the parts.

`abort` stops sequences between steps (`sequence` has the lifecycle and its exception).
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Iterable
from dataclasses import asdict
from functools import partial

import torch

from wicore.engines.base import Completion, Engine, EngineConfig, EngineRequest, failed, is_out_of_memory
from wicore.engines.fast import engine_builder
from wicore.engines.fast.postprocess import unreadable
from wicore.engines.fast.sequence import Sequence
from wicore.engines.guided import Grammars
from wicore.engines.pending import Pending
from wicore.errors import JobInputError, PromptTooLong
from wicore.ops.image_preprocess import PreprocessSpec

log = logging.getLogger(__name__)
ADD_CHUNK = 64  # prompts `add` resizes and keys at a time (the reason: in `add`)


class FastEngine(Engine):
    name = "fast"

    def __init__(self, config: EngineConfig, *, fp8_anywhere: bool = False):
        """fp8_anywhere: run `gemm_dtype="fp8"` on any device torch's scaled matmul runs on (the
        CPU tests; slower than the model dtype there) instead of refusing all but FP8 GPUs."""
        super().__init__(config)
        parts = engine_builder.build(config, fp8_anywhere)
        self.resolved, self.weights, self.tokenizer = parts.options, parts.weights, parts.tokenizer
        self.inputs, self.runner, self.blocks, self.tiers = parts.inputs, parts.runner, parts.blocks, parts.tiers
        self.keyer, self.planner, self.pool, self.images = parts.keyer, parts.planner, parts.pool, parts.images
        self.step_runner, self.post, self.counters, self.rng = parts.step_runner, parts.post, parts.counters, parts.rng
        self.grammars = Grammars(self.tokenizer, self.runner.text_config.vocab_size, parts.eos_ids)

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

    def pixel_spec(self) -> PreprocessSpec | None:
        return self.inputs.pixel_spec  # None: a text-only checkpoint

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
                seq.abort_requested = True  # `Postprocess.book` stops it after its prefill
            else:
                done.append(self.post.abort(seq))
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
        self.runner = self.images = self.tiers = self.step_runner = self.post = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- a step -----------------------------------------------------------------------------

    def _step(self, done: list[Completion]) -> None:
        """Appends to `done` as sequences end, so a failure later in the step loses none."""
        vision_queued = self.step_runner.land(self.planner.waiting, self.blocks.cache)
        plan = self.planner.plan(self.counters.steps, vision_queued)
        done += map(unreadable, plan.unreadable)
        launched = self.step_runner.run(plan)
        self.post.book(plan, launched, done)

    # -- requests ---------------------------------------------------------------------------

    def _sequence(self, request: EngineRequest) -> Sequence:
        prompt = self.inputs.prompt(request.chat, len(request.images))
        params = request.params
        total = len(prompt.ids) + params.max_new_tokens
        if total > self.resolved.max_model_len:
            raise PromptTooLong(
                f"prompt of {len(prompt.ids)} tokens + {params.max_new_tokens} new tokens exceeds "
                f"max_model_len {self.resolved.max_model_len}"
            )
        if not self.planner.fits_ever(total):
            raise PromptTooLong(f"a {total}-token sequence does not fit in the KV cache")
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        grammar = self.grammars.state(params.guided)  # BadGrammar: this request alone fails
        return Sequence(request, prompt, seed, grammar=grammar)  # pixels: ImageStage.prepare; then `_key`

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

    def _fail_all(self, error: Exception) -> list[Completion]:
        seqs = self.planner.fail_all()
        self.step_runner.reset()
        self.blocks.drop_cache()  # blocks being written when the step failed are suspect
        if self.resolved.cuda and is_out_of_memory(error):
            # The failed step's blocks stay cached in the allocator, split to the sizes it asked
            # for: hand them back so the smaller batch the worker retries with can use them.
            gc.collect()
            torch.cuda.empty_cache()
        return [failed(seq.id, error, input_error=False) for seq in seqs]
