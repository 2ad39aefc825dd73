"""The fast engine against the reference (HF `generate`) engine: greedy tokens must be equal.

The tiny model has 2 text layers, one sliding (window 16, shorter than every prompt) and one
full; fp32 on CPU. `eos_model_dir` is the same model with its EOS row of the tied embedding set
to 1.01 x the row of a token the model emits at varied points, so that greedy outputs end early
at different lengths.
"""

from __future__ import annotations

import copy
import hashlib
import io
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fast_requests import image, mismatches, mixed_requests, one_torch_thread, request  # noqa: F401 (fixture)
from tests.model_shapes import LIKE_12B, LIKE_27B, reshaped
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine, plain_resize_size
from wicore.errors import ConfigError
from wicore.ops.image_decode import decode_image
from wicore.ops.image_load import ImageSource, LoadRules, load_pixels

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return ReferenceEngine(EngineConfig(str(tiny_model_dir), max_batch_size=16))


@pytest.fixture(scope="module")
def fast(tiny_model_dir):
    return FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4))


@pytest.fixture(scope="module")
def expected(reference):
    """Reference completions of `mixed_requests()`, by id (greedy: independent of batching)."""
    return {c.id: c for c in reference.generate(mixed_requests())}


def by_id(expected, completions):
    return [expected[c.id] for c in completions]


def test_mixed_batch_matches_reference(fast, expected):
    # 7 requests, max_batch_size 4: later ones join as earlier ones finish.
    out = fast.generate(mixed_requests())
    assert all(c.ok for c in out)
    assert mismatches(out, by_id(expected, out)) == []
    assert [len(c.token_ids) for c in out] == [20, 9, 31, 14, 17, 25, 3]
    assert fast.num_unfinished() == 0
    stats = fast.stats()
    assert stats["kv_pages_used"] == 0 and stats["max_decode_batch"] == 4
    launches = stats["vision_batch_sizes"]  # images -> launches: every image encoded counts once
    assert sum(size * n for size, n in launches.items()) == stats["images"] > 0 and max(launches) <= 8
    trace = stats["start_trace"]  # this run's start from idle: [phase, start ms, end ms] per launch
    assert trace[0][0] == "vision" and {"prefill", "decode"} <= {phase for phase, _, _ in trace}
    assert all(0 <= start <= end for _, start, end in trace) and 40 < len(trace) <= 48, "the first (up to 48) launches"
    assert [start for _, start, _ in trace] == sorted(start for _, start, _ in trace)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_batch_sizes(fast, expected, size):
    requests = mixed_requests()[:size]
    out = fast.generate(requests)
    assert mismatches(out, by_id(expected, out)) == []


def test_requests_join_mid_decode(fast, expected):
    requests = {r.id: r for r in mixed_requests()}
    done = []
    assert fast.add([requests["c"], requests["a"]]) == []
    for _ in range(4):
        done += fast.step()
    fast.add([requests["f"], requests["b"]])
    done += fast.step()
    fast.add([requests["e"]])
    while fast.num_unfinished():
        done += fast.step()
    assert sorted(c.id for c in done) == ["a", "b", "c", "e", "f"]
    assert mismatches(done, by_id(expected, done)) == []


def test_small_blocks_and_one_slot(tiny_model_dir, expected):
    # block_size 4: the sliding layer's ring (5 pages) wraps many times; one sequence at a time.
    engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=1, options=FastOptions(block_size=4)))
    out = engine.generate(mixed_requests()[:4])
    assert mismatches(out, by_id(expected, out)) == []


def test_stop_strings(fast, reference, expected):
    text = expected["a"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    requests = [
        request("s1", variant=1, max_new_tokens=20, stop=(stop,)),
        request("s2", "Hi", variant=2, max_new_tokens=9, stop=("never-there", expected["b"].text[-2:])),
    ]
    out, ref = fast.generate(requests), reference.generate(requests)
    assert out[0].finish_reason == "stop_string"
    assert mismatches(out, ref) == []


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, expected, tmp_path_factory):
    token = _varied_token([c.token_ids for c in expected.values()])
    out = tmp_path_factory.mktemp("models") / "tiny-eos"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(out / "model.safetensors")
    embed = weights["language_model.model.embed_tokens.weight"]
    embed[1] = 1.01 * embed[token]  # <eos> is id 1 in the tiny tokenizer
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _varied_token(outputs: list[list[int]]) -> int:
    """The token whose first appearance in the outputs falls at the most distinct indices."""
    firsts: dict[int, set[int]] = {}
    for ids in outputs:
        for token in set(ids):
            firsts.setdefault(token, set()).add(ids.index(token))
    counts = Counter({token: len(indices) for token, indices in firsts.items()})
    return counts.most_common(1)[0][0]


def test_eos_and_ignore_eos(eos_model_dir):
    requests = mixed_requests() + [request("h", variant=1, max_new_tokens=20, ignore_eos=True)]
    config = EngineConfig(str(eos_model_dir), max_batch_size=4)
    out, ref = FastEngine(config).generate(requests), ReferenceEngine(config).generate(requests)
    assert mismatches(out, ref) == []
    reasons = Counter(c.finish_reason for c in ref)
    assert reasons["stop"] >= 2 and reasons["length"] >= 2
    assert len(out[-1].token_ids) == 20 and out[-1].finish_reason == "length"


def test_seeded_sampling_ignores_batch_mates(fast):
    sampled = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 12}
    alone = fast.generate([request("x", variant=3, seed=11, **sampled)])
    crowd = fast.generate(
        [request("y", "Hi", variant=2, max_new_tokens=5), request("x", variant=3, seed=11, **sampled)]
        + [request(f"z{i}", variant=i, temperature=1.0, max_new_tokens=7) for i in range(3)]
    )
    other = fast.generate([request("x", variant=3, seed=12, **sampled)])
    assert alone[0].token_ids == crowd[1].token_ids
    assert other[0].token_ids != alone[0].token_ids


def test_rejects_bad_requests(fast):
    too_long = request("long", max_new_tokens=4090)
    wrong_images = request("imgs", images=2)
    wrong_images.images.pop()
    rejected = fast.add([too_long, wrong_images])
    assert [(c.id, c.input_error) for c in rejected] == [("long", True), ("imgs", True)]
    assert "PromptTooLong" in rejected[0].error
    assert fast.num_unfinished() == 0


def test_unknown_option_fails_loudly(tiny_model_dir):
    with pytest.raises(ConfigError, match="blok_size"):
        FastEngine(EngineConfig(str(tiny_model_dir), options=FastOptions.parse({"blok_size": 8})))


def test_matches_reference_in_bfloat16(tiny_model_dir):
    # Not asserted token for token (bf16 rounding differs between kernels); both must run and
    # agree on the first tokens of most requests.
    config = EngineConfig(str(tiny_model_dir), dtype="bfloat16", max_batch_size=4)
    requests = mixed_requests()[:4]
    out, ref = FastEngine(config).generate(requests), ReferenceEngine(config).generate(requests)
    agree = sum(o.token_ids[:2] == r.token_ids[:2] for o, r in zip(out, ref, strict=True))
    assert agree >= 3
    assert torch.get_default_dtype() == torch.float32


def test_config_only_checkpoint(tiny_model_dir, tmp_path):
    # No safetensors, a seed file: both engines seed the same HF model on the device.
    seeded = tmp_path / "tiny-seeded"
    shutil.copytree(tiny_model_dir, seeded, ignore=shutil.ignore_patterns("*.safetensors"))
    (seeded / "wicore_init.json").write_text('{"seed": 3}')
    config = EngineConfig(str(seeded), max_batch_size=4)
    requests = mixed_requests()[:3]
    out, ref = FastEngine(config).generate(requests), ReferenceEngine(config).generate(requests)
    assert mismatches(out, ref) == []


def test_padded_decode_rows_do_not_change_results(fast):
    # What a CUDA graph bucket sees: real rows followed by null rows at position 0.
    fast.add(mixed_requests()[:3])
    while not any(s.wants_decode for s in fast.planner.admitted):
        fast.step()
    seqs = [s for s in fast.planner.admitted if s.wants_decode]
    rows = torch.tensor([s.kv.row for s in seqs])
    positions = torch.tensor([s.next_position for s in seqs])
    null = torch.full((5,), fast.runner.null_row)
    with torch.inference_mode():
        plain = fast.runner.decode_logits(rows, positions)
        padded = fast.runner.decode_logits(
            torch.cat([rows, null]), torch.cat([positions, torch.zeros(5, dtype=torch.long)])
        )
    torch.testing.assert_close(padded[: len(seqs)], plain, rtol=1e-5, atol=1e-5)
    while fast.num_unfinished():
        fast.step()


def test_warm_up_phases_run(fast):
    # The CUDA memory profile's phases, on CPU at small sizes (shapes and arguments only).
    from wicore.engines.fast.kv_budget import _decode, _prefill, _vision

    with torch.inference_mode():
        _vision(fast.runner, 2)
        _prefill(fast.runner, 2048)
        _decode(fast.runner, 3)


@pytest.mark.parametrize("threads", [0, 2])
def test_pixels_in_threads_and_unreadable_images(tiny_model_dir, expected, threads):
    engine = FastEngine(
        EngineConfig(str(tiny_model_dir), max_batch_size=4, options=FastOptions(preprocess_threads=threads))
    )
    broken = request("broken", variant=9)
    broken.images[0] = object()  # not an image: the image processor raises
    done = engine.add([broken, *mixed_requests()[:3]])
    while engine.num_unfinished():
        done += engine.step()
    failures = [c for c in done if not c.ok]
    assert [(c.id, c.input_error) for c in failures] == [("broken", True)]
    good = [c for c in done if c.ok]
    assert mismatches(good, by_id(expected, good)) == [] and len(good) == 3


def test_kv_pool_bounds_admission_and_rejects_what_never_fits(tiny_model_dir, expected):
    # 12 pages: one request of ~60 positions needs 4 full-layer pages + a 2-page sliding ring.
    engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4, options=FastOptions(num_kv_blocks=12)))
    rejected = engine.add([request("huge", max_new_tokens=400)])
    assert [(c.id, c.input_error) for c in rejected] == [("huge", True)] and "KV cache" in rejected[0].error
    out = engine.generate(mixed_requests()[:4])
    assert mismatches(out, by_id(expected, out)) == []
    assert engine.stats()["max_decode_batch"] < 4  # pages, not rows, bounded the batch


def test_compiled_decoder_matches_reference(tiny_model_dir, expected):
    """The inductor-compiled decoder layers (the CUDA default) give the reference's tokens."""
    engine = FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=4, options=FastOptions(compile_text=True)))
    out = engine.generate(mixed_requests())
    assert mismatches(out, by_id(expected, out)) == []


def test_torch_threads_option_sets_the_process_threads(tiny_model_dir):
    # CUDA engines default to one intra-op thread (options test); a CPU engine keeps the
    # process's setting unless the option names one.
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=2))
        assert torch.get_num_threads() == 3
        FastEngine(EngineConfig(str(tiny_model_dir), max_batch_size=2, options=FastOptions(torch_threads=2)))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_a_far_larger_image_shrunk_on_load_gives_both_engines_the_same_tokens(fast, reference):
    """The worker's decoders shrink an image far larger than the model's input near it
    (`decode_image(fit=)`); both engines then resize the same smaller image, to the same tokens,
    whether the fast engine gets it decoded or resized in a decode process (`load_pixels`)."""
    assert reference.image_size() == fast.image_size() == fast.pixel_spec().size
    height, width = fast.image_size()
    big = image(99, width * 9 + 5, height * 7 + 3)  # random pixels: what averaging disturbs most
    buffer = io.BytesIO()
    big.save(buffer, "PNG")
    data = buffer.getvalue()
    decoded = decode_image(data, fit=fast.image_size())
    assert decoded.size == (-(-big.width // 3), -(-big.height // 2))  # reduced by (3, 2)
    source = ImageSource(hashlib.sha256(data).hexdigest(), data)
    pixels, error, _, _ = load_pixels(source, LoadRules(), fast.pixel_spec())
    assert error == ""
    expected = reference.generate([request_with(decoded)])
    for shrunk in (decoded, pixels):
        assert mismatches(fast.generate([request_with(shrunk)]), expected) == []


def request_with(picture) -> EngineRequest:
    asked = request("big", max_new_tokens=12)
    asked.images = [picture]
    return asked


def test_the_reference_engine_decodes_whole_images_for_a_processor_that_crops(reference):
    processor = copy.deepcopy(reference.processor)
    processor.image_processor.do_pan_and_scan = True  # crops of the full image: no shrinking first
    assert plain_resize_size(processor) is None
    assert plain_resize_size(reference.processor) == reference.image_size()


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_seeded_sampling_gives_the_same_text_in_any_batch(engine, both_engines):
    """Batch mates with the same seed and parameters, other sampled ones, greedy ones: a seeded
    request's tokens are those it gets alone, on either engine."""
    runner = both_engines[engine]
    sampled = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 12}
    alone = runner.generate([request("x", variant=3, seed=11, **sampled)])
    crowd = runner.generate(
        [request("twin", variant=1, seed=11, **sampled), request("y", "Hi", variant=2, max_new_tokens=5)]
        + [request("x", variant=3, seed=11, **sampled)]
        + [request(f"z{i}", variant=i, temperature=1.0, max_new_tokens=7) for i in range(3)]
    )
    assert [c.token_ids for c in crowd if c.id == "x"] == [alone[0].token_ids]


@pytest.fixture(scope="module")
def both_engines(reference, fast):
    return {"reference": reference, "fast": fast}


@pytest.fixture(scope="module", params=["12b", "27b"])
def shaped_model_dir(request, tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint's text model reshaped as Gemma-3-12B's or 27B's ratios (heads to KV
    heads, head_dim against hidden, query_pre_attn_scalar; 5 sliding layers to 1 full)."""
    shape = {"12b": LIKE_12B, "27b": LIKE_27B}[request.param]
    return reshaped(tiny_model_dir, tmp_path_factory.mktemp("models") / f"like-{request.param}", shape, weights=True)


def test_12b_and_27b_shapes_match_reference(shaped_model_dir):
    config = EngineConfig(str(shaped_model_dir), max_batch_size=4)
    requests = mixed_requests()
    out, ref = FastEngine(config).generate(requests), ReferenceEngine(config).generate(requests)
    assert mismatches(out, ref) == []
    assert len({tuple(c.token_ids) for c in ref}) > 1  # the outputs are not all alike


def test_12b_and_27b_shapes_config_only_match_reference(shaped_model_dir, tmp_path):
    # Seeded weights drawn tensor by tensor into the fast engine's fused buffers, and into HF's model.
    seeded = tmp_path / "seeded"
    shutil.copytree(shaped_model_dir, seeded, ignore=shutil.ignore_patterns("*.safetensors"))
    (seeded / "wicore_init.json").write_text('{"seed": 5}')
    config = EngineConfig(str(seeded), max_batch_size=4)
    requests = mixed_requests()[:4]
    out, ref = FastEngine(config).generate(requests), ReferenceEngine(config).generate(requests)
    assert mismatches(out, ref) == []
