"""Every request shape on both engines: text only, several images, an image in a later turn,
multi-turn conversations with system turns. Greedy tokens of the fast engine equal the reference
engine's (HF `generate`); a conversation's earlier turns hit the prefix cache.

The tiny model has a 128-token sliding window and the fast engine 4-token blocks (as
test_fast_prefix_parity.py), so conversations are cached block by block.
"""

from __future__ import annotations

import pytest

from tests.fast_requests import image, mismatches, one_torch_thread  # noqa: F401 (fixture)
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine
from wicore.schemas import GenerationParams

pytestmark = pytest.mark.slow

IMAGE = {"type": "image"}


def text(words: str) -> dict:
    return {"type": "text", "text": words}


def chat_request(rid: str, chat: list[dict], images: int = 0, seed: int = 0, new: int = 12) -> EngineRequest:
    pictures = [image(seed * 7 + i, 24 + 8 * i, 30 - 2 * i) for i in range(images)]
    return EngineRequest(rid, chat, pictures, GenerationParams(max_new_tokens=new))


def first_turn() -> list[dict]:
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [IMAGE, text("What is in this picture?")]},
    ]


def follow_up() -> list[dict]:
    """`first_turn` answered, then asked again: its tokens start with the first turn's."""
    return [*first_turn(), {"role": "assistant", "content": "A square."}, {"role": "user", "content": "What colour?"}]


def shapes() -> list[EngineRequest]:
    return [
        chat_request("text-only", [{"role": "user", "content": "Tell me about red houses."}]),
        chat_request("text-parts", [{"role": "user", "content": [text("Two"), text("parts.")]}], new=9),
        chat_request("two-images", [{"role": "user", "content": [IMAGE, text("and"), IMAGE, text("differ?")]}], 2, 1),
        chat_request("three-images", [{"role": "user", "content": [text("Compare"), IMAGE, IMAGE, IMAGE]}], 3, 2),
        chat_request("text-first", [{"role": "user", "content": [text("Describe"), IMAGE]}], 1, 3),
        chat_request("image-only", [{"role": "user", "content": [IMAGE]}], 1, 4),
        chat_request(
            "later-turn-image",
            [
                {"role": "user", "content": "Hello."},
                {"role": "assistant", "content": "Hi, send a picture."},
                {"role": "user", "content": [IMAGE, text("Here.")]},
            ],
            1,
            5,
        ),
        chat_request("multi-turn", follow_up(), 1, 6, new=15),
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceEngine(EngineConfig(str(model_dir), max_batch_size=16))


@pytest.fixture(scope="module")
def expected(reference):
    """Each request alone on the reference engine (the yardstick: no padding at all)."""
    return {r.id: reference.generate([r])[0] for r in shapes()}


def fast_engine(model_dir) -> FastEngine:
    options = FastOptions(block_size=4, paged_prefill_tokens=128, torch_threads=1)
    return FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=options))


def test_every_shape_alone_and_batched_matches_the_reference(model_dir, reference, expected):
    assert all(c.ok and c.token_ids for c in expected.values())
    assert mismatches(reference.generate(shapes()), list(expected.values())) == []  # batched = alone
    fast = fast_engine(model_dir)
    out = fast.generate(shapes())
    assert all(c.ok for c in out), [c.error for c in out]
    assert mismatches(out, list(expected.values())) == []
    assert fast.stats()["images"] == 2 + 3 + 1 + 1 + 1 + 1


def test_text_only_requests_do_no_vision_work(model_dir, expected):
    fast = fast_engine(model_dir)
    requests = [r for r in shapes() if not r.images]
    out = fast.generate(requests)
    assert mismatches(out, [expected[r.id] for r in requests]) == []
    assert fast.stats()["images"] == 0 and not fast.stats()["vision_batch_sizes"]


def test_prompt_tokens_show_each_image(model_dir, expected):
    """Each image is one <start_of_image> + 16 soft tokens + <end_of_image> run."""
    inputs = fast_engine(model_dir).inputs
    for request in shapes():
        prompt = inputs.prompt(request.chat, len(request.images))
        assert len(prompt.image_starts) == len(request.images)
        assert len(prompt.ids) == expected[request.id].prompt_tokens


def test_a_conversations_earlier_turns_hit_the_prefix_cache(model_dir, expected, reference):
    fast = fast_engine(model_dir)
    picture = [image(6 * 7, 24, 30)]
    first = EngineRequest("first", first_turn(), picture, GenerationParams(max_new_tokens=5), ["a" * 64])
    [done] = fast.generate([first])
    assert done.ok and fast.stats()["images"] == 1
    later = EngineRequest("multi-turn", follow_up(), picture, GenerationParams(max_new_tokens=15), ["a" * 64])
    [out] = fast.generate([later])
    assert mismatches([out], [expected["multi-turn"]]) == []
    stats = fast.stats()
    assert stats["cached_prompt_tokens"] >= done.prompt_tokens - 4  # every full block of the first turn
    assert stats["images"] == 1  # the image lies in the cached prefix: no vision work again
