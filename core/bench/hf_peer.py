"""The peer: Hugging Face `generate` on the same model, prompts (`caption_variants`: their images
and text) and token counts, at a static batch size. Returns prompts/s and images/s, the generated ids (for the parity report) and, at every step, how
far the chosen token's logit led the runner-up's (a sequence that another kernel's rounding can
turn has a small lead where it turns)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from PIL import Image
from transformers import LogitsProcessorList


@dataclass
class PeerRun:
    batch_size: int
    prompts: int
    images: int
    seconds: float
    tokens: list[list[int]] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)  # per sequence and step: top-1 - top-2 logit

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds

    @property
    def prompts_per_s(self) -> float:
        return self.prompts / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


class MarginRecorder:
    """A logits processor that leaves the scores as they are and keeps, on the device, the
    lead of each row's best logit over its second (read back once the timed loop is over).
    Passed to `generate` it runs after the built-in processors, so a masked EOS is not counted."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []  # [batch] float32 each

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = scores.float().topk(2, dim=-1).values
        self.steps.append(top[:, 0] - top[:, 1])
        return scores

    def rows(self) -> list[list[float]]:
        return torch.stack(self.steps, dim=1).tolist() if self.steps else []


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class PeerPrompt:
    chat: list[dict]  # one user turn: an {"type": "image"} part per image, and text
    images: list[Image.Image]


@torch.inference_mode()
def run_generate(
    model, processor, prompts: list[PeerPrompt], new_tokens: int, batch_size: int, eos_ids: list[int]
) -> PeerRun:
    """Static batches of `batch_size`, greedy, exactly `new_tokens` new tokens (EOS masked, as
    the engines do for `ignore_eos`).
    Preprocessing is inside the timed loop, as it is for wicore."""
    images = sum(len(p.images) for p in prompts)
    run = PeerRun(batch_size, len(prompts), images, 0.0)
    recorders = []
    sync()
    start = time.perf_counter()
    for begin in range(0, len(prompts), batch_size):
        chunk = prompts[begin : begin + batch_size]
        texts = [processor.apply_chat_template(p.chat, add_generation_prompt=True) for p in chunk]
        pictures = [p.images for p in chunk] if images else None
        inputs = processor(text=texts, images=pictures, return_tensors="pt", padding=True, add_special_tokens=False).to(
            model.device
        )
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        recorders.append(MarginRecorder())
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=eos_ids,
            logits_processor=LogitsProcessorList([recorders[-1]]),
        )  # fmt: skip
        run.tokens += out[:, inputs["input_ids"].shape[1] :].tolist()
    sync()
    run.seconds = time.perf_counter() - start
    run.margins = [row for recorder in recorders for row in recorder.rows()]
    return run
