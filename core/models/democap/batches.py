"""Examples as the model sees them: images through the user's path, and token layouts.

`pixels` takes an image the way a user's goes (render -> PNG/JPEG file -> PIL decode -> the
processor's bilinear resize to S x S) and keeps it as uint8 [3, S, S], which the processor's
rescale + normalize maps to (x / 255 - 0.5) / 0.5. PNG is lossless, so a PNG spec skips the
file round trip (same pixels, less time). Used for validation during training; training
itself draws its images with `synth`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from wicore.models.democap.data import Spec, decode, encode, render
from wicore.models.democap.model import answer_text, chat


def pixels(spec: Spec, size: int) -> np.ndarray:
    """uint8 [3, S, S]: the processor's resize of the image `spec` describes, as a user sends it."""
    image = render(spec)
    if spec.fmt == "JPEG":
        image = decode(encode(spec, image))
    small = image.resize((size, size), Image.BILINEAR)  # Gemma3ImageProcessorPil's resample
    return np.asarray(small).transpose(2, 0, 1).copy()


def render_all(specs: list[Spec], size: int) -> torch.Tensor:
    """uint8 [N, 3, S, S], in spec order."""
    return torch.from_numpy(np.stack([pixels(s, size) for s in specs]))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, S, S] -> float [B, 3, S, S] in [-1, 1], as the processor rescales and normalizes."""
    return images.float().mul_(2 / 255).sub_(1.0)  # (x / 255 - 0.5) / 0.5 in two passes


@dataclass(frozen=True)
class Layout:
    """The token side of a batch of examples: one prompt (a conversation with one image), then
    each caption's answer tokens."""

    prompt_ids: torch.Tensor  # [P] long: <bos> ... <start_of_turn>model\n, 16 image soft tokens inside
    prompt_types: torch.Tensor  # [P] long: 1 on image soft tokens (bidirectional attention), else 0
    answers: dict[str, list[int]]  # caption -> its answer's ids (the caption or its JSON), ending with <end_of_turn>
    pad_id: int

    @classmethod
    def from_processor(
        cls, processor, captions: list[str], conversation: list[dict] | None = None, form: str = "caption"
    ) -> Layout:
        """The layout of `conversation` (default: `chat()`, the image then the default prompt),
        answered in `form` (`model.answer_text`)."""
        text = processor.apply_chat_template(conversation or chat(), add_generation_prompt=True)
        size = processor.image_processor.size["height"]
        blank = Image.new("RGB", (size, size))
        enc = processor(text=[text], images=[[blank]], add_special_tokens=False, return_tensors="pt")
        tok = processor.tokenizer
        answers = {c: tok(answer_text(c, form), add_special_tokens=False).input_ids for c in captions}
        return cls(enc["input_ids"][0], enc["token_type_ids"][0], answers, tok.pad_token_id)

    def batch(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """input_ids / token_type_ids / attention_mask [B, P + A] (answers right-padded) and
        labels [B, P + A]: the answer ids, -100 elsewhere (loss on the answer only)."""
        width = max(len(self.answers[c]) for c in captions)
        p = len(self.prompt_ids)
        ids = torch.full((len(captions), p + width), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        mask = torch.zeros_like(ids)
        ids[:, :p], mask[:, :p] = self.prompt_ids, 1
        for row, caption in enumerate(captions):
            answer = torch.tensor(self.answers[caption])
            ids[row, p : p + len(answer)] = labels[row, p : p + len(answer)] = answer
            mask[row, p : p + len(answer)] = 1
        types = torch.zeros_like(ids)
        types[:, :p] = self.prompt_types
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "labels": labels}
