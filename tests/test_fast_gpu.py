"""The fast engine's CUDA paths (Triton attention, CUDA graphs, side-stream vision, memory
planning) against the reference engine on the GPU. Skipped without CUDA."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from tests.fast_requests import mismatches, mixed_requests, request
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine
from wicore.schemas import Lane

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    reference = ReferenceEngine(EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=16))
    requests = mixed_requests() + [request("s", variant=8, max_new_tokens=40, stop=("zz",))]
    return {c.id: c for c in reference.generate(requests)}


@pytest.mark.parametrize(
    "options", [{}, {"cuda_graphs": False}, {"block_size": 4, "graph_batch_sizes": [1, 2], "graph_prefill_tokens": [8]}]
)
def test_cuda_greedy_matches_reference(tiny_model_dir, expected, options):
    # Graphs for every batch, eager decode, and a mix (batches of 3-4 exceed the buckets). This
    # model's 16-token window makes most prompts wrap their ring: dense prefills (the paged
    # path: test_fast_prefix_gpu.py).
    config = EngineConfig(
        str(tiny_model_dir), device="cuda", max_batch_size=4, options=FastOptions(num_kv_blocks=4096, **options)
    )
    engine = FastEngine(config)
    requests = mixed_requests() + [request("s", variant=8, max_new_tokens=40, stop=("zz",))]
    out = engine.generate(requests)
    assert mismatches(out, [expected[c.id] for c in out]) == []
    stats = engine.stats()
    if options.get("cuda_graphs", True):
        assert stats["graph_replays"] > 0
    assert stats["kv_pages_used"] == 0 and stats["vision_s"] > 0


def test_cuda_bfloat16_runs_and_sizes_kv_from_memory(tiny_model_dir):
    gc.collect()  # earlier tests' engines and graph pools
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # What earlier tests left in use (graph pools, workspaces) differs by card: the budget is 2 GiB
    # past it, a small share of any GPU, so that the pool is sized from memory, not from the cap.
    utilization = (total - free + 2 * 2**30) / total
    engine = FastEngine(
        EngineConfig(
            str(tiny_model_dir),
            device="cuda",
            dtype="bfloat16",
            max_batch_size=8,
            options=FastOptions(gpu_memory_utilization=utilization, vision_cache_bytes=0),
        )
    )
    assert engine.blocks.num_pages > 1000
    out = engine.generate(mixed_requests())
    assert all(c.ok and c.token_ids for c in out)


def test_cuda_seeded_sampling_ignores_batch_mates(tiny_model_dir):
    engine = FastEngine(
        EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=8, options=FastOptions(num_kv_blocks=4096))
    )
    sampled = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 12, "seed": 11}
    alone = engine.generate([request("x", variant=3, **sampled)])
    crowd = engine.generate([request("y", "Hi", variant=2, max_new_tokens=5), request("x", variant=3, **sampled)])
    assert alone[0].token_ids == crowd[1].token_ids


def test_steps_never_synchronize_implicitly(tiny_model_dir):
    # Only the explicit event waits of the one-step-late readback may block the host.
    config = EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=4, options=FastOptions(num_kv_blocks=4096))
    engine = FastEngine(config)
    engine.generate(mixed_requests()[:2])  # warm caches outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = engine.generate(
            mixed_requests() + [request("t", variant=2, temperature=0.7, top_p=0.9, max_new_tokens=6)]
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [c.error for c in out if not c.ok] == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_repeated_dense_prefill_shapes_replay_graphs_with_the_eager_tokens(tiny_model_dir, dtype):
    """Bulk-like work: one prompt, images of one size, prefilled four at a time, so the dense
    prefill's shape repeats: the second of a shape captures a graph, later ones replay it, and
    every token equals the eager dense prefill's (the graph replays the same kernels)."""
    bulk = [request(f"r{i}", variant=i, max_new_tokens=6, ignore_eos=True) for i in range(20)]
    runs = {}
    for shapes in (0, 2):
        options = FastOptions(num_kv_blocks=4096, dense_prefill_graphs=shapes, prefix_cache=False)
        engine = FastEngine(
            EngineConfig(str(tiny_model_dir), device="cuda", dtype=dtype, max_batch_size=4, options=options)
        )
        runs[shapes] = (engine.generate(bulk), engine.stats())
        engine.close()
    (eager, eager_stats), (graphed, stats) = runs[0], runs[2]
    assert eager_stats["dense_graph_replays"] == 0 and eager_stats["dense_graphs"] == 0
    assert 1 <= stats["dense_graphs"] <= 2 and stats["dense_graph_replays"] >= 2
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager] and all(c.ok for c in graphed)


def test_shape_graphs_replay_new_values_and_stay_eager_when_a_capture_fails():
    from wicore.engines.fast.graph_runner import ShapeGraphs

    x = torch.arange(4.0, device="cuda")
    graphs = ShapeGraphs(lambda t: t["x"] * 3, limit=1)
    assert graphs.run({"x": x}) is None, "a shape's first call runs eagerly"
    assert torch.equal(graphs.run({"x": x}), x * 3) and torch.equal(graphs.run({"x": x + 1}), (x + 1) * 3)
    wider = {"x": torch.ones(5, device="cuda")}
    assert graphs.run(wider) is None and graphs.run(wider) is None, "past the limit: eager"
    assert graphs.replays == 2 and len(graphs.graphs) == 1

    def syncs(t):  # reads a value on the host: a graph cannot capture that
        return t["x"] * (2 if t["x"].sum().item() > 0 else 1)

    failing = ShapeGraphs(syncs, limit=4)
    caller = torch.cuda.current_stream()
    assert failing.run({"x": x}) is None and failing.run({"x": x}) is None
    assert failing.limit == 0 and not failing.graphs
    assert torch.cuda.current_stream() == caller, "the failed capture gave the caller's stream back"
    assert torch.equal(syncs({"x": x}), x * 2), "the device still works after the failed capture"

    asked = ShapeGraphs(lambda t: t["x"] + 1, limit=1)
    assert asked.capture({"x": x}) and torch.equal(asked.run({"x": x * 2}), x * 2 + 1), "captured: replays at once"
    assert not ShapeGraphs(syncs, limit=1).capture({"x": x}), "a capture asked for fails as one on repeat does"


def test_graphs_replayed_side_by_side_on_two_streams_give_what_each_gives_alone():
    """The tower's graph (captured on its own stream) replays on the side stream while a
    decoder's graph (captured on the default capture stream) replays on the main one. PyTorch
    keys cuBLAS's workspace by (handle, capture stream), so captured on one stream they would
    share it and their split-K GEMMs (a long reduction into few rows and columns) race on it."""
    from wicore.engines.fast.graph_runner import ShapeGraphs

    # A generator of its own: after a failed capture (the test before) torch's default CUDA generator
    # stays in capture mode and every draw from it raises (torch skips its epilogue when ending fails).
    seeded = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(16384, 128, device="cuda", dtype=torch.bfloat16, generator=seeded) for _ in range(2)]

    def gemms(w):
        return lambda t: torch.stack([(t["x"] * (1 + i / 16)) @ w for i in range(16)])

    tower, decoder = ShapeGraphs(gemms(weights[0]), limit=1, own_stream=True), ShapeGraphs(gemms(weights[1]), limit=1)
    inputs = [{"x": torch.randn(32, 16384, device="cuda", dtype=torch.bfloat16, generator=seeded)} for _ in range(2)]
    for graphs, x in ((tower, inputs[0]), (decoder, inputs[1])):
        graphs.forward(x)  # cuBLAS's handle and its eager algorithms before capturing, as the engine does
        assert graphs.capture(x)
    alone = [tower.run(inputs[0]).clone(), decoder.run(inputs[1]).clone()]
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(main)
    outputs = []
    for _ in range(50):
        with torch.cuda.stream(side):
            ours = tower.run(inputs[0]).clone()
        outputs.append((ours, decoder.run(inputs[1]).clone()))
    main.wait_stream(side)
    torch.cuda.synchronize()
    assert all(torch.equal(a, alone[0]) and torch.equal(b, alone[1]) for a, b in outputs)


def test_an_own_capture_stream_is_never_the_default_capture_stream_however_many_streams_came_before():
    from wicore.engines.fast.graph_runner import ShapeGraphs

    graphs = ShapeGraphs(lambda t: t["x"] * 2, limit=1)
    assert graphs.capture({"x": torch.ones(4, device="cuda")})  # torch.cuda.graph makes its default stream
    default = torch.cuda.graphs.graph.default_capture_stream
    for made in range(64):  # torch's pool of streams wraps around every 32
        own = ShapeGraphs(lambda t: t["x"] * 2, limit=1, own_stream=True).capture_stream
        assert own.cuda_stream != default.cuda_stream, f"after {made} streams"


def test_full_vision_batches_replay_one_graph_each_with_its_own_embeddings(tiny_model_dir):
    """Batches of 2 images, two queued on the side stream at once: every replay's embeddings are
    the tower's for its own images (bit for bit), and the tokens equal launching the tower. The
    tower compiles without autotuning: two tunings may pick different kernels, and round apart."""
    tokens, requests = {}, [request(f"v{i}", variant=30 + i, max_new_tokens=10) for i in range(7)]
    for graph in (True, False):
        options = FastOptions(
            num_kv_blocks=4096, vision_batch_size=2, vision_batches_queued=2, vision_graph=graph,
            vision_compile_mode="default",
        )  # fmt: skip
        engine = FastEngine(EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=8, options=options))
        tokens[graph] = {c.id: c.token_ids for c in engine.generate(requests)}
        assert (engine.stats()["vision_graph_replays"] > 0) == graph
        if graph:
            runner = engine.runner
            size = runner.parts.config.vision_config.image_size
            images = [np.random.RandomState(i).randint(0, 256, (size, size, 3), dtype=np.uint8) for i in range(4)]
            first, _ = runner.encode_images(images[:2])
            second, _ = runner.encode_images(images[2:])  # queued behind the first replay
            torch.cuda.synchronize()
            for embeds, batch in ((first, images[:2]), (second, images[2:])):
                pixels = runner.pixel_values(torch.from_numpy(np.stack(batch)).cuda())
                assert torch.equal(embeds, runner.encode(pixels))
        engine.close()
    assert tokens[True] == tokens[False]


def test_a_high_lane_request_overtakes_bulk_with_its_vision_on_the_main_stream(tiny_model_dir):
    """Bulk requests decoding, a high-lane one of the same length added three steps later: its
    image goes through the tower on the main stream beside the side stream's, it ends first, and
    every request keeps the reference engine's tokens."""
    config = EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=8, options=FastOptions(num_kv_blocks=4096))
    engine = FastEngine(config)
    bulk = [request(f"b{i}", variant=10 + i, max_new_tokens=48, ignore_eos=True) for i in range(6)]
    high = request("h", variant=20, max_new_tokens=48, ignore_eos=True)
    high.priority = Lane.HIGH
    assert engine.add(bulk) == []
    ended = engine.step() + engine.step() + engine.step()
    assert engine.add([high]) == []
    while engine.num_unfinished():
        ended += engine.step()
    assert [c.id for c in ended][0] == "h"
    reference = ReferenceEngine(EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=8))
    assert mismatches(ended, reference.generate([*bulk, high])) == []


def test_a_worker_serving_it_on_the_gpu_decodes_images_in_processes_by_default(tiny_model_dir):
    from wicore.config import Settings
    from wicore.defaults import gpu_decode_processes
    from wicore.worker.factory import decode_processes

    options = FastOptions(cuda_graphs=False, num_kv_blocks=256)
    engine = FastEngine(EngineConfig(str(tiny_model_dir), device="cuda", max_batch_size=4, options=options))
    try:
        assert decode_processes(Settings(), engine) == gpu_decode_processes(os.cpu_count() or 2) > 0
        assert decode_processes(Settings(decode_processes=0), engine) == 0, "threads when asked"
    finally:
        engine.close()
