"""The `reference` engine: Hugging Face `generate` on a left-padded static batch.

It is the yardstick every other engine is compared with, so it stays plain: the checkpoint's
own processor, chat template and model (any image-text-to-text or causal-LM checkpoint), one
`generate` call per group of requests that share sampling settings, and the shared
`finish_sequence` rule for where each output ends.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from wicore.engines.base import (
    Completion,
    EngineConfig,
    EngineRequest,
    StaticBatchEngine,
    Stopwatch,
    failed,
    is_out_of_memory,
    reject_options,
)
from wicore.engines.chat_inputs import ChatInputs, check_chat_model
from wicore.engines.checkpoint import load_hf_model, load_processor
from wicore.engines.guided import Grammars, GuidedLogitsProcessor
from wicore.engines.text import finish_sequence, stop_token_ids, token_logprobs
from wicore.errors import ConfigError, JobInputError, PromptTooLong
from wicore.ops.image_preprocess import PreprocessSpec
from wicore.schemas import GenerationParams, TokenLogprob

log = logging.getLogger(__name__)


class ReferenceEngine(StaticBatchEngine):
    name = "reference"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        reject_options(config, self.name)
        self.processor = load_processor(config.model_dir)
        check_chat_model(self.processor, config.model_dir)
        self.inputs = ChatInputs(self.processor)
        self.tokenizer = self.inputs.tokenizer
        self.model = load_hf_model(config.model_dir, config.device, config.dtype, config.seed)
        self.eos_ids = stop_token_ids(config.model_dir, self.tokenizer)
        text_config = self.model.config.get_text_config()
        self.max_len = text_config.max_position_embeddings
        self.grammars = Grammars(self.tokenizer, text_config.vocab_size, self.eos_ids)
        self._image_size = plain_resize_size(self.processor)

    def image_size(self) -> tuple[int, int] | None:
        return self._image_size

    def step(self) -> list[Completion]:
        requests = self.take_pending()
        # One generate call per sampling rule, text-only requests apart from those with images.
        groups: dict[tuple, list[tuple[EngineRequest, str]]] = defaultdict(list)
        done: list[Completion] = []
        for request in requests:
            try:
                text = self._prompt_text(request)
                if request.params.guided is not None:
                    self.grammars.compiled(request.params.guided)  # a bad one fails here, alone
            except JobInputError as error:
                done.append(failed(request.id, error, input_error=True))
                continue
            groups[(sampling_key(request), bool(request.images))].append((request, text))
        for group in groups.values():
            done.extend(self._run_isolating_failures(group))
        return done

    def _prompt_text(self, request: EngineRequest) -> str:
        return self.inputs.text(request.chat, len(request.images))

    def _run_isolating_failures(self, group: list[tuple[EngineRequest, str]]) -> list[Completion]:
        """One bad request must not fail its batch mates: on a batch error, run each alone. Out
        of memory is the batch's size, not a request: all of them go back to the worker, which
        retries them in smaller batches."""
        try:
            return self._generate(group)
        except Exception as batch_error:
            if len(group) == 1 or is_out_of_memory(batch_error):
                return [failed(r.id, batch_error, input_error=isinstance(batch_error, JobInputError)) for r, _ in group]
            log.warning("batch of %d failed (%s); running its requests one by one", len(group), batch_error)
            return [c for pair in group for c in self._run_isolating_failures([pair])]

    def _too_long(self, request: EngineRequest, prompt_len: int) -> Completion:
        new = request.params.max_new_tokens
        error = PromptTooLong(f"prompt of {prompt_len} tokens + {new} new tokens exceeds the model's {self.max_len}")
        return failed(request.id, error, input_error=True)

    @torch.inference_mode()
    def _generate(self, pairs: list[tuple[EngineRequest, str]]) -> list[Completion]:
        clock = Stopwatch()
        group, texts = [r for r, _ in pairs], [t for _, t in pairs]
        inputs = self.inputs.encode(texts, [r.images for r in group]).to(self.model.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        prompt_lens = inputs["attention_mask"].sum(dim=1).tolist()
        too_long = [(r, n) for r, n in zip(group, prompt_lens) if n + r.params.max_new_tokens > self.max_len]
        if too_long:  # those fail alone; their batch mates run without them
            rest = [pair for pair in pairs if all(pair[0] is not r for r, _ in too_long)]
            return [self._too_long(r, n) for r, n in too_long] + (self._generate(rest) if rest else [])
        params = [r.params for r in group]
        longest = max(p.max_new_tokens for p in params)
        first = params[0]
        if first.seed is not None:
            torch.manual_seed(first.seed)
        width = inputs["input_ids"].shape[1]
        output = self.model.generate(
            **inputs,
            max_new_tokens=longest,
            min_new_tokens=longest if first.ignore_eos else None,
            **self._sampling(first, group, width),
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.tokenizer.pad_token_id,
            output_scores=first.logprobs,
            return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, width:].tolist()
        engine_s = clock.elapsed()
        completions = []
        for row, (request, prompt_len, tokens) in enumerate(zip(group, prompt_lens, new_tokens)):
            ids, text, reason = finish_sequence(self.tokenizer, tokens, request.params, self.eos_ids)
            completion = Completion(request.id, text, ids, reason, prompt_tokens=prompt_len, engine_s=engine_s)
            if request.params.logprobs:
                completion.logprobs = self._logprobs(output.scores, row, ids, request.params.top_logprobs)
            completions.append(completion)
        return completions

    def _logprobs(self, scores: tuple[torch.Tensor, ...], row: int, ids: list[int], top: int) -> list[TokenLogprob]:
        """Per token of `ids`: log_softmax of `generate`'s processed scores (each [B, V] step)."""
        entries = []
        for step, token in enumerate(ids):
            logprobs = torch.log_softmax(scores[step][row].float(), dim=-1)
            best = logprobs.topk(top) if top else None
            pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            entries.append((logprobs[token].item(), pairs))
        return token_logprobs(self.tokenizer, ids, entries)

    def _sampling(self, params: GenerationParams, group: list[EngineRequest], prompt_len: int) -> dict[str, Any]:
        """`generate`'s sampling arguments for a group sharing `params`' rule. With a guided row the
        grammar's processor comes first and the warpers (temperature, top-k, top-p: HF's order)
        after it, so no warper leaves a row without a token its grammar allows."""
        repetition = {"repetition_penalty": params.repetition_penalty if params.repetition_penalty != 1.0 else None}
        guided = self._guided(group, prompt_len)
        processors = LogitsProcessorList([*(output_penalties(params, prompt_len) or []), *(guided or [])])
        warpers: dict[str, Any] = {"temperature": None, "top_p": None, "top_k": None}
        if not params.greedy and guided is None:
            warpers = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        elif not params.greedy:  # the grammar first, then the warpers
            processors.extend(sampling_warpers(params))
            warpers = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        return {"do_sample": not params.greedy, **warpers, **repetition, "logits_processor": processors or None}

    def _guided(self, group: list[EngineRequest], prompt_len: int) -> LogitsProcessorList | None:
        """The grammar rows of a batch (None: no request in it is guided)."""
        states = [self.grammars.state(r.params.guided) for r in group]
        if all(state is None for state in states):
            return None
        return LogitsProcessorList([GuidedLogitsProcessor(states, prompt_len)])


def sampling_warpers(params: GenerationParams) -> list:
    """The warpers `generate` makes for these settings, in its order."""
    warpers: list = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


def plain_resize_size(processor) -> tuple[int, int] | None:
    """The (height, width) the processor resizes every image to, when resizing is all it does
    to an image's size (what `PreprocessSpec` reproduces, as the fast engine does): a far larger
    image may then come shrunk near it, as it does to the fast engine. None for any other
    processor (pan-and-scan crops need the full image)."""
    try:
        return PreprocessSpec.from_hf(processor.image_processor).size
    except (ConfigError, AttributeError, TypeError, ValueError):  # not one PreprocessSpec reads
        return None


def sampling_key(request: EngineRequest) -> tuple:
    """Requests that can share one `generate` call: same sampling rule and penalties, logprobs
    or not (max_new_tokens differs freely: each output is cut to its own length afterwards). A
    seeded sampled request runs alone: `generate` draws every row from one generator, so batch
    mates would change its sample."""
    params = request.params
    penalties = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    shared = (params.ignore_eos, *penalties, params.logprobs, params.top_logprobs)
    if params.greedy:
        return ("greedy", *shared)
    if params.seed is not None:
        return ("seeded", request.id)
    return ("sample", params.temperature, params.top_p, params.top_k, *shared)


class OutputPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (those past the
    prompt's `width` columns of the left-padded batch), for `generate`."""

    def __init__(self, presence: float, frequency: float, width: int):
        self.presence, self.frequency, self.width = presence, frequency, width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        output = input_ids[:, self.width :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, output, torch.ones(output.shape, dtype=scores.dtype, device=scores.device)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def output_penalties(params: GenerationParams, width: int) -> LogitsProcessorList | None:
    if not (params.presence_penalty or params.frequency_penalty):
        return None
    return LogitsProcessorList([OutputPenalties(params.presence_penalty, params.frequency_penalty, width)])
