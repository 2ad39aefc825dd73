"""The fast engine's image stage: repeated images are encoded once, cached embeddings skip the
vision tower (locally and through the Redis-shared layer), and outputs never change."""

from __future__ import annotations

import hashlib
import io

import pytest

from tests.fast_requests import image, mismatches, one_torch_thread  # noqa: F401 (fixture)
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine
from wicore.schemas import GenerationParams
from wicore.worker.shared_vision_cache import RedisVisionCache

pytestmark = pytest.mark.slow
QUESTIONS = ["Describe this image.", "What colour is it?", "Is there a dog?", "Count the shapes."]


def question(rid: str, picture, text: str) -> EngineRequest:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    sha = hashlib.sha256(buffer.getvalue()).hexdigest()
    return EngineRequest(rid, chat, [picture], GenerationParams(max_new_tokens=6), [sha])


def vqa(images: int = 2) -> list[EngineRequest]:
    pictures = [image(40 + i, 36 + 8 * i, 30) for i in range(images)]
    return [question(f"i{i}q{q}", p, text) for i, p in enumerate(pictures) for q, text in enumerate(QUESTIONS)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    reference = ReferenceEngine(EngineConfig(str(tiny_model_dir), max_batch_size=8))
    return reference.generate(vqa())


def fast(model_dir, **options) -> FastEngine:
    return FastEngine(EngineConfig(str(model_dir), max_batch_size=8, options=FastOptions(**options)))


def test_questions_about_one_image_encode_it_once(tiny_model_dir, expected):
    engine = fast(tiny_model_dir)
    out = engine.generate(vqa())
    assert mismatches(out, expected) == []
    assert engine.stats()["images_encoded"] == 2  # 8 requests, 2 distinct images
    again = engine.generate(vqa())
    assert mismatches(again, expected) == []
    stats = engine.stats()
    assert stats["images_encoded"] == 2, "the second round came from the cache"
    assert stats["vision_cache"]["hits"] == 2  # one lookup per distinct image of the call


def test_no_cache_encodes_every_image(tiny_model_dir, expected):
    engine = fast(tiny_model_dir, vision_cache_bytes=0)
    assert mismatches(engine.generate(vqa()), expected) == []
    assert mismatches(engine.generate(vqa()), expected) == []
    assert engine.stats()["images_encoded"] == 4  # within a batch still once per image


def test_shared_redis_layer_serves_another_engine(tiny_model_dir, expected, redis_conn):
    first = fast(tiny_model_dir)
    first.attach_vision_cache(RedisVisionCache(redis_conn, namespace="tiny", max_bytes=2**24, ttl_s=60))
    first.generate(vqa())
    first.close()  # writes the embeddings still queued for the shared store
    second = fast(tiny_model_dir)  # a fresh engine (another worker): empty local cache
    shared = RedisVisionCache(redis_conn, namespace="tiny", max_bytes=2**24, ttl_s=60)
    second.attach_vision_cache(shared)
    out = second.generate(vqa())
    assert mismatches(out, expected) == []
    stats = second.stats()
    assert stats["images_encoded"] == 0 and stats["vision_cache_shared"]["hits"] == 2
