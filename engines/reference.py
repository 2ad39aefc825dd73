"""The `reference` engine: Hugging Face `generate` on a left-padded static batch.

It is the yardstick every other engine is compared with, so it stays plain: the checkpoint's
own processor and model, one `generate` call per group of requests that share sampling
settings, and the shared `finish_sequence` rule for where each output ends.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from wicore.engines.base import (
    Completion,
    EngineConfig,
    EngineRequest,
    StaticBatchEngine,
    Stopwatch,
    failed,
    reject_options,
)
from wicore.engines.checkpoint import load_hf_model, load_processor
from wicore.engines.text import finish_sequence, stop_token_ids
from wicore.errors import JobInputError, PromptTooLong
from wicore.schemas import GenerationParams

log = logging.getLogger(__name__)


class ReferenceEngine(StaticBatchEngine):
    name = "reference"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        reject_options(config, self.name)
        self.processor = load_processor(config.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.model = load_hf_model(config.model_dir, config.device, config.dtype, config.seed)
        self.eos_ids = stop_token_ids(config.model_dir, self.tokenizer)
        self.max_len = self.model.config.text_config.max_position_embeddings

    def step(self) -> list[Completion]:
        requests = self.take_pending()
        groups: dict[tuple, list[EngineRequest]] = defaultdict(list)
        for request in requests:
            groups[sampling_key(request.params)].append(request)
        done: list[Completion] = []
        for group in groups.values():
            done.extend(self._run_isolating_failures(group))
        return done

    def _run_isolating_failures(self, group: list[EngineRequest]) -> list[Completion]:
        """One bad request must not fail its batch mates: on a batch error, run each alone."""
        try:
            return self._generate(group)
        except Exception as batch_error:
            if len(group) == 1:
                return [failed(group[0].id, batch_error, input_error=isinstance(batch_error, JobInputError))]
            log.warning("batch of %d failed (%s); running its requests one by one", len(group), batch_error)
            return [c for request in group for c in self._run_isolating_failures([request])]

    @torch.inference_mode()
    def _generate(self, group: list[EngineRequest]) -> list[Completion]:
        clock = Stopwatch()
        texts = [self.processor.apply_chat_template(r.chat, add_generation_prompt=True) for r in group]
        inputs = self.processor(
            text=texts,
            images=[r.images for r in group],
            padding=True,
            return_tensors="pt",
            add_special_tokens=False,  # the chat template already starts with <bos>
        ).to(self.model.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        prompt_lens = inputs["attention_mask"].sum(dim=1).tolist()
        params = [r.params for r in group]
        longest = max(p.max_new_tokens for p in params)
        for request, prompt_len in zip(group, prompt_lens):
            if prompt_len + request.params.max_new_tokens > self.max_len:
                raise PromptTooLong(
                    f"prompt of {prompt_len} tokens + {request.params.max_new_tokens} new tokens exceeds "
                    f"the model's {self.max_len}"
                )
        first = params[0]
        if first.seed is not None:
            torch.manual_seed(first.seed)
        output = self.model.generate(
            **inputs,
            max_new_tokens=longest,
            min_new_tokens=longest if first.ignore_eos else None,
            do_sample=not first.greedy,
            temperature=first.temperature if not first.greedy else None,
            top_p=first.top_p if not first.greedy else None,
            top_k=first.top_k if not first.greedy else None,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        new_tokens = output[:, inputs["input_ids"].shape[1] :].tolist()
        engine_s = clock.elapsed()
        completions = []
        for request, prompt_len, tokens in zip(group, prompt_lens, new_tokens):
            ids, text, reason = finish_sequence(self.tokenizer, tokens, request.params, self.eos_ids)
            completions.append(Completion(request.id, text, ids, reason, prompt_tokens=prompt_len, engine_s=engine_s))
        return completions


def sampling_key(params: GenerationParams) -> tuple:
    """Requests that can share one `generate` call: same sampling rule (max_new_tokens differs
    freely: each output is cut to its own length afterwards)."""
    if params.greedy:
        return ("greedy", params.ignore_eos)
    return ("sample", params.temperature, params.top_p, params.top_k, params.seed, params.ignore_eos)
