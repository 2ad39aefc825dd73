"""Requests shared by the fast engine's tests (a fixtures module, imported by the tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from wicore.engines.base import EngineRequest
from wicore.schemas import GenerationParams


def image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def request(rid: str, text: str = "Describe this image in detail.", images: int = 1, variant: int = 0, **params):
    """`variant` picks the images; `params` are GenerationParams."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    pictures = [
        image(variant * 31 + i, 20 + 13 * ((variant + i) % 5), 24 + 9 * ((variant * 3 + i) % 7)) for i in range(images)
    ]
    return EngineRequest(rid, [{"role": "user", "content": content}], pictures, GenerationParams(**params))


def mixed_requests() -> list[EngineRequest]:
    """Mixed prompt lengths, image counts and sizes, max_new_tokens; one text-only request."""
    return [
        request("a", variant=1, max_new_tokens=20),
        request("b", "Hi", variant=2, max_new_tokens=9),
        request("c", "What is shown here? Answer in a few words, please.", images=2, variant=3, max_new_tokens=31),
        request("d", "Describe the colours.", variant=4, max_new_tokens=14, ignore_eos=True),
        request("e", "Tell me a story about a red house near a tree.", images=0, variant=5, max_new_tokens=17),
        request("f", "A dog", images=3, variant=6, max_new_tokens=25),
        request("g", "Photo", variant=7, max_new_tokens=3),
    ]


def mismatches(fast, reference) -> list[str]:
    """Ids of the requests whose completions differ (ids, text or finish reason)."""
    ref = {c.id: c for c in reference}
    return [
        c.id
        for c in fast
        if (c.token_ids, c.text, c.finish_reason) != (ref[c.id].token_ids, ref[c.id].text, ref[c.id].finish_reason)
    ]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run faster on one thread, and much faster on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
