"""The peer: Hugging Face `generate` on the same model, images and token counts, at a static
batch size. Returns images/s and the generated ids (for the parity report)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from PIL import Image


@dataclass
class PeerRun:
    batch_size: int
    images: int
    seconds: float
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def run_generate(
    model, processor, images: list[Image.Image], prompt: str, new_tokens: int, batch_size: int, eos_ids: list[int]
) -> PeerRun:
    """Static batches of `batch_size`, greedy, exactly `new_tokens` new tokens (EOS masked, as
    the engines do for `ignore_eos`).
    Preprocessing is inside the timed loop, as it is for wicore."""
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    run = PeerRun(batch_size, len(images), 0.0)
    sync()
    start = time.perf_counter()
    for begin in range(0, len(images), batch_size):
        chunk = images[begin : begin + batch_size]
        inputs = processor(
            text=[text] * len(chunk), images=[[im] for im in chunk], return_tensors="pt", padding=True,
            add_special_tokens=False,
        ).to(model.device)  # fmt: skip
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=eos_ids
        )
        run.tokens += out[:, inputs["input_ids"].shape[1] :].tolist()
    sync()
    run.seconds = time.perf_counter() - start
    return run
