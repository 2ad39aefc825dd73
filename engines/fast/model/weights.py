"""The fast engine's Gemma-3 model as the engine holds it: the config, the image encoder (None
for a text-only checkpoint) and the text decoder (`loader.load_gemma3` builds it from a
checkpoint or seeded weights)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wicore.engines.fast.model.text_decoder import TextDecoder
from wicore.engines.fast.model.vision_tower import ImageEncoder
from wicore.engines.weight_names import our_name

__all__ = ["Gemma3Parts", "our_name"]


@dataclass
class Gemma3Parts:
    config: Any  # transformers Gemma3Config, or Gemma3TextConfig (text only)
    encoder: ImageEncoder | None  # None: a text-only checkpoint
    decoder: TextDecoder
    report: dict = field(default_factory=dict)  # the load's figures (`loader.load_report`)

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config()

    @property
    def image_token_id(self) -> int | None:
        return getattr(self.config, "image_token_id", None)

    @property
    def tokens_per_image(self) -> int:
        return getattr(self.config, "mm_tokens_per_image", 0)
