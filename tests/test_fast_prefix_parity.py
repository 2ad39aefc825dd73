"""The prefix cache end to end: greedy tokens with caching on equal the reference engine's (and so
caching off), for hits in the GPU pool, hits restored from the host tier and from the disk tier.

The tiny model here has a 128-token sliding window and the engines use 4-token blocks, so that
the test prompts (36-83 tokens, images of 16 soft tokens at 9..24) never wrap a sliding ring and
are cached: questions about one image share 7 blocks (28 tokens).
"""

from __future__ import annotations

import pytest

from tests.fast_requests import image, mismatches, mixed_requests, one_torch_thread, request  # noqa: F401
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine

pytestmark = pytest.mark.slow
QUESTIONS = ["What colour is it?", "How many things are there?", "Where is this?", "Describe it briefly."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


def vqa(prefix="q", variant=1):
    return [request(f"{prefix}{i}", text, variant=variant, max_new_tokens=8) for i, text in enumerate(QUESTIONS)]


def several_images():
    """Two images; three others; m1's first image with another second one (m3 shares m1's
    blocks up to its second image, which alone goes through the vision tower)."""
    m3 = request("m3", "Compare them.", images=2, variant=3, max_new_tokens=10)
    m3.images[1] = image(999, 30, 26)
    return [
        request("m1", "Compare them.", images=2, variant=3, max_new_tokens=10),
        request("m2", "Compare them.", images=3, variant=6, max_new_tokens=10),
        m3,
    ]


def all_requests():
    return mixed_requests() + vqa() + vqa("r", variant=2) + several_images()


@pytest.fixture(scope="module")
def expected(model_dir):
    reference = ReferenceEngine(EngineConfig(str(model_dir), max_batch_size=16))
    return {c.id: c for c in reference.generate(all_requests())}


def engine(model_dir, **options):
    """Short prefills attend over their pages (as on CUDA) unless the options say otherwise."""
    options = {"block_size": 4, "paged_prefill_tokens": 128, **options}
    return FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=FastOptions(**options)))


def check(out, expected):
    assert all(c.ok for c in out)
    assert mismatches(out, [expected[c.id] for c in out]) == []


@pytest.mark.parametrize("paged", [0, 128])
def test_caching_off_matches_reference(model_dir, expected, paged):
    # Dense prefills, or every prompt (36-83 tokens, images included) over its pages.
    fast = engine(model_dir, prefix_cache=False, paged_prefill_tokens=paged)
    check(fast.generate(all_requests()), expected)
    stats = fast.stats()
    assert "gpu" not in stats["cache"]
    assert stats["paged_prefilled"] == (len(all_requests()) if paged else 0)


def test_repeated_requests_hit_the_gpu_pool(model_dir, expected):
    fast = engine(model_dir)
    check(fast.generate(mixed_requests()), expected)
    images = fast.stats()["images"]
    check(fast.generate(mixed_requests()), expected)
    stats = fast.stats()
    assert stats["cache"]["gpu"]["hits"] > 0 and stats["cached_prompt_tokens"] > 0
    assert stats["images"] == images  # every image was in a cached prefix: no vision the 2nd time
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_cached"] > 0


@pytest.mark.parametrize("paged", [0, 128])
def test_same_image_questions_admitted_together(model_dir, expected, paged):
    # The follow-ups attend over the cached prefix gathered from the pages (dense), or over
    # their pages alone (paged).
    fast = engine(model_dir, paged_prefill_tokens=paged)
    check(fast.generate(vqa()), expected)
    stats = fast.stats()
    assert stats["images"] == 1  # the tower ran for the first question only
    assert stats["cache"]["gpu"]["hits"] == 3 * 7  # 28 shared tokens: image + template
    assert stats["cached_prompt_tokens"] == 3 * 28
    assert stats["paged_prefilled"] == (4 if paged else 0)


def test_requests_join_mid_decode(model_dir, expected):
    fast = engine(model_dir)
    requests = {r.id: r for r in all_requests()}
    done = fast.add([requests["q0"], requests["a"]])
    for _ in range(3):
        done += fast.step()
    fast.add([requests["q1"], requests["r0"]])
    done += fast.step()
    fast.add([requests["q2"], requests["r1"], requests["m1"]])
    while fast.num_unfinished():
        done += fast.step()
    check(done, expected)
    assert fast.stats()["cache"]["gpu"]["hits"] >= 2 * 7


def test_several_images(model_dir, expected):
    fast = engine(model_dir)
    first, second, third = several_images()
    check(fast.generate([first, second]), expected)  # no image in common: the template's 8 tokens
    assert fast.stats()["cached_prompt_tokens"] == 8
    check(fast.generate([third]), expected)
    stats = fast.stats()
    assert stats["cached_prompt_tokens"] == 8 + 28 and stats["images"] == 5 + 2  # m3: both encoded, one used
    check(fast.generate(several_images()), expected)  # all cached now: no vision at all
    assert fast.stats()["images"] == 7


def test_small_gpu_pool_moves_blocks_to_the_host_and_back(model_dir, expected):
    # 60 pages: about two sequences at a time; everything finished is evicted again and again.
    fast = engine(model_dir, num_kv_blocks=60, host_cache_bytes=2**20)
    requests = mixed_requests()[:4] + vqa()
    check(fast.generate(requests), expected)
    check(fast.generate(requests), expected)
    cache = fast.stats()["cache"]
    assert cache["gpu"]["evictions"] > 0 and cache["host"]["bytes_in"] > 0
    assert cache["host"]["hits"] > 0 and cache["gpu"]["bytes_in"] > 0  # restored into pages


def test_disk_tier_hits_after_a_restart(model_dir, expected, tmp_path):
    options = {"num_kv_blocks": 60, "host_cache_bytes": 4 * 2048, "disk_cache_dir": str(tmp_path / "kv")}
    first = engine(model_dir, **options)  # a 4-block host tier: most blocks end up on disk
    requests = mixed_requests()[:4]
    check(first.generate(requests + vqa()), expected)
    first.tiers.disk.flush()
    assert first.stats()["cache"]["disk"]["bytes_in"] > 0
    first.close()
    second = engine(model_dir, **options)  # another process would find the same keys
    check(second.generate(requests), expected)
    cache = second.stats()["cache"]
    assert cache["disk"]["hits"] > 0 and cache["gpu"]["bytes_in"] > 0  # disk -> pages
    assert second.stats()["cached_prompt_tokens"] > 0
    second.close()


def test_keys_hashed_in_threads_and_from_given_image_hashes(model_dir, expected):
    fast = engine(model_dir, preprocess_threads=2)  # pixel digests in the pool (no hashes given)
    check(fast.generate(vqa()), expected)
    assert fast.stats()["cached_prompt_tokens"] == 3 * 28
    given = vqa()
    for req in given:
        req.image_hashes = ["ab" * 32]  # the caller's hash of the image's bytes: a new key
    check(fast.generate(given), expected)
    assert fast.stats()["cached_prompt_tokens"] == 3 * 28 + 8 + 3 * 28  # the template, then shared


def test_a_failed_step_drops_the_cache_and_the_engine_recovers(model_dir, expected, monkeypatch):
    fast = engine(model_dir, num_kv_blocks=60, host_cache_bytes=2**20)
    check(fast.generate(vqa()), expected)
    assert fast.stats()["kv_pages_cached"] > 0
    with monkeypatch.context() as patch:
        patch.setattr(fast.runner, "prefill", lambda seqs: (_ for _ in ()).throw(RuntimeError("device lost")))
        out = fast.generate(mixed_requests()[:2])
    assert all("device lost" in c.error for c in out)
    stats = fast.stats()
    assert stats["kv_pages_cached"] == stats["kv_pages_used"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages"] == 60
    check(fast.generate(vqa()), expected)


@pytest.mark.parametrize("block_size, split, shared", [(8, False, 8), (8, True, 24), (16, True, 16)])
def test_prefix_ending_inside_an_image(model_dir, expected, block_size, split, shared):
    # The questions share 28 tokens; the image's soft tokens are 9..24. Cut back to the image's
    # block by default; with prefix_split_images the later questions reuse the blocks through the
    # image's first part and prefill its tail from their own embeddings.
    options = {"block_size": block_size, "prefix_split_images": split}
    fast = FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=FastOptions(**options)))
    check(fast.generate(vqa()), expected)
    stats = fast.stats()
    assert stats["cached_prompt_tokens"] == 3 * shared and stats["images"] == 4


def test_random_arrivals_through_every_tier_match_caching_off(model_dir, tmp_path):
    # 60 requests over 4 images, mixed image counts and lengths, arriving in random chunks while
    # the engine steps; a GPU pool of 80 pages, a host tier of 8 blocks, a disk tier.
    import random

    rng = random.Random(0)
    questions = ["What colour?", "How many?", "Where is it?", "Describe it.", "Why?"]
    requests = [
        request(f"r{i}", rng.choice(questions), images=rng.choice([0, 1, 1, 2]), variant=rng.randrange(4),
                max_new_tokens=rng.randrange(1, 12))
        for i in range(60)
    ]  # fmt: skip
    want = {c.id: c for c in engine(model_dir, prefix_cache=False).generate(requests)}
    fast = engine(model_dir, num_kv_blocks=80, host_cache_bytes=8 * 2048, disk_cache_dir=str(tmp_path))
    done, pending = [], list(requests)
    while pending or fast.num_unfinished():
        if pending and rng.random() < 0.5:
            count = rng.randrange(1, 5)
            done += fast.add(pending[:count])
            pending = pending[count:]
        done += fast.step()
    check(done, want)
    fast.tiers.disk.flush()  # (disk hits depend on the writer thread's timing; outputs never do)
    cache, blocks = fast.stats()["cache"], fast.blocks
    assert cache["gpu"]["hits"] > 0 and cache["host"]["hits"] > 0 and cache["disk"]["bytes_in"] > 0
    assert blocks.num_used == 0 and blocks.cache.policy.num_pinned == 0
    assert all(block.users == 0 and block.ready for block in blocks.cache.blocks.values())
    fast.close()


def test_close_lets_go_of_the_kv_pool_and_the_host_tier(model_dir, expected):
    # `close` must give the memory back while the engine object is still referenced (the cache
    # benchmark's `release` runs with its caller holding the engine): the scheduler keeps the
    # tiers' `holds`, and the host tier's eviction hook points back at the tiers.
    import gc
    import weakref

    fast = engine(model_dir, num_kv_blocks=60, host_cache_bytes=2**20)
    check(fast.generate(vqa()), expected)
    buffers = {"KV pool": weakref.ref(fast.runner.cache.tensor), "host tier": weakref.ref(fast.tiers.host.pool)}
    fast.close()
    gc.collect()
    assert [name for name, buffer in buffers.items() if buffer() is not None] == []
