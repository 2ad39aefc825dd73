"""A request's conversation -> the model's inputs, as Hugging Face's own
`apply_chat_template(..., tokenize=True)` makes them, for any checkpoint the reference engine runs.

The checkpoint's chat template renders the text. A processor (image-text-to-text) tokenizes it
with the images, adding special tokens unless the text already starts with `<bos>` (the rule
`ProcessorMixin.apply_chat_template` applies); a tokenizer alone (a causal LM) tokenizes it
without special tokens (`PreTrainedTokenizerBase.apply_chat_template`'s rule).
"""

from __future__ import annotations

from typing import Any

from wicore.errors import ConfigError, JobInputError


def check_chat_model(processor, model_dir: str) -> None:
    """A ConfigError naming what is missing when the checkpoint cannot lay out a conversation."""
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    if not isinstance(processor, ProcessorMixin | PreTrainedTokenizerBase):
        kind = type(processor).__name__
        raise ConfigError(
            f"--model {model_dir}: unsupported processor {kind} (need a tokenizer or a multimodal processor)"
        )
    tokenizer = getattr(processor, "tokenizer", processor)
    if not (getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)):
        raise ConfigError(
            f"--model {model_dir}: no chat template (chat_template.jinja or tokenizer_config.json's chat_template); "
            "every prompt is laid out by it"
        )


class ChatInputs:
    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tokenizer.padding_side = "left"  # generate continues every row from its last column
        self.takes_images = self.tokenizer is not processor
        # What the template writes for each image: Gemma-3's <start_of_image>, else the image token.
        self.placeholder = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
        # Text a user must not write: the token the processor expands each placeholder into.
        expanded = getattr(self.tokenizer, "image_token", None)
        self.reserved = expanded if expanded != self.placeholder else None

    def text(self, chat: list[dict[str, Any]], num_images: int) -> str:
        """The conversation as the model reads it; one that does not render, or whose placeholders
        do not match its images, is the request's error."""
        if num_images and not self.takes_images:
            raise JobInputError(f"this model reads text only; the request has {num_images} images")
        try:
            text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # a malformed conversation is the request's fault
            raise JobInputError(f"chat template failed: {error}") from error
        self._check_placeholders(text, num_images)
        return text

    def _check_placeholders(self, text: str, num_images: int) -> None:
        if self.reserved is not None and self.reserved in text:
            raise JobInputError(f"the prompt holds the image token text {self.reserved}")
        found = text.count(self.placeholder) if self.placeholder else num_images
        if found != num_images:
            raise JobInputError(
                f"the prompt holds {found} image placeholders ({self.placeholder}) for {num_images} images"
            )

    def encode(self, texts: list[str], images: list[list]) -> Any:
        """Padded `return_tensors="pt"` inputs of a batch whose texts share a template (so one
        special-token rule holds for all); `images`: each text's, none at all for a text batch."""
        if not self.takes_images:
            return self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        bos = self.tokenizer.bos_token
        add_special = not (bos is not None and texts[0].startswith(bos))
        pictures = images if any(images) else None
        return self.processor(
            text=texts, images=pictures, padding=True, return_tensors="pt", add_special_tokens=add_special
        )
