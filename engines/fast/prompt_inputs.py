"""Request -> model inputs, exactly as the reference engine's processor call produces them.

Token ids: the checkpoint's chat template, then every `<start_of_image>` expanded to the
processor's full image sequence ("\\n\\n<boi>" + soft tokens + "<eoi>\\n\\n") and tokenized
without special tokens: the same text `Gemma3Processor` tokenizes, without processing the
images a second time. Pixels: `resized` gives the uint8 images (host threads); the model runner
maps them through `pixel_spec.lut` on the device (`wicore.ops.image_preprocess.apply_lut`), which
gives the processor's float32 pixel values bit for bit.

A text-only checkpoint (`Gemma3ForCausalLM`) brings a tokenizer alone: its template renders the
conversation, images are the request's error, and there are no pixels (`pixel_spec` None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from wicore.errors import JobInputError
from wicore.ops.image_preprocess import PreprocessSpec, is_resized, resized_images, stack_resized

PROMPT_CACHE_SIZE = 1024


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    image_starts: list[int]  # position of each image's first soft token


class InputProcessor:
    def __init__(self, processor, image_token_id: int | None, tokens_per_image: int):
        """`processor`: the checkpoint's multimodal processor, or its tokenizer alone (text only)."""
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.takes_images = self.tokenizer is not processor
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.pixel_spec = PreprocessSpec.from_hf(processor.image_processor) if self.takes_images else None
        self._prompts: dict[str, Prompt] = {}  # conversation (JSON) -> prompt, oldest first

    def prompt(self, chat: list[dict[str, Any]], num_images: int) -> Prompt:
        """Token ids of a conversation; the same conversation (bulk jobs share one prompt) is
        tokenized once."""
        key = f"{num_images}:{json.dumps(chat, sort_keys=True)}"
        cached = self._prompts.get(key)
        if cached is None:
            cached = self._prompt(chat, num_images)
            if len(self._prompts) >= PROMPT_CACHE_SIZE:
                self._prompts.pop(next(iter(self._prompts)))
            self._prompts[key] = cached
        return cached

    def _prompt(self, chat: list[dict[str, Any]], num_images: int) -> Prompt:
        if num_images and not self.takes_images:
            raise JobInputError(f"this model reads text only; the request has {num_images} images")
        try:
            text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a malformed conversation is the request's fault
            raise JobInputError(f"chat template failed: {error}") from error
        if self.takes_images:
            text = self._expand_images(text, num_images)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(ids, self._image_starts(ids, num_images) if self.takes_images else [])

    def _expand_images(self, text: str, num_images: int) -> str:
        """Each `<start_of_image>` the template wrote -> the processor's full image sequence."""
        boi = self.processor.boi_token
        if text.count(boi) != num_images:
            raise JobInputError(f"the chat has {text.count(boi)} image parts but {num_images} images were given")
        return text.replace(boi, self.processor.full_image_sequence)

    def _image_starts(self, ids: list[int], num_images: int) -> list[int]:
        is_image = np.asarray(ids) == self.image_token_id
        starts = np.flatnonzero(is_image & ~np.concatenate(([False], is_image[:-1]))).tolist()
        ends = np.flatnonzero(is_image & ~np.concatenate((is_image[1:], [False]))).tolist()
        if len(starts) != num_images or any(
            e - s + 1 != self.tokens_per_image for s, e in zip(starts, ends, strict=False)
        ):
            raise JobInputError("the prompt's image placeholders do not match the images")
        return starts

    def resized(self, images: list) -> np.ndarray:
        """uint8 [N, H, W, 3] (N may be 0): the images as the HF image processor resizes them;
        `pixel_spec.lut` turns them into its float32 pixel values. Images that come resized
        (uint8 arrays, `EngineRequest.images`) are taken as they are."""
        if self.pixel_spec is None:
            return np.empty((0, 0, 0, 3), dtype=np.uint8)  # text only: `prompt` refused any image
        if is_resized(images):
            return stack_resized(images, self.pixel_spec)
        return resized_images(images, self.pixel_spec)
