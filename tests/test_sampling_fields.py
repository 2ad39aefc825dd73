"""The request's sampling fields on both engines, tiny Gemma-3 on CPU: penalties (greedy tokens of
the fast engine equal the reference engine's, which runs HF `generate`), logprobs (the fast
engine's equal a log_softmax of `generate`'s processed scores), `n` samples (reproducible with a
seed, different from each other, the first one the n = 1 sample; samples 2..n read the first
one's prefix-cache blocks), and stop strings that span tokens.

The model here has a 128-token sliding window and the fast engine 4-token blocks, so prompts are
cached (test_fast_prefix_parity.py has the same setting).
"""

from __future__ import annotations

import pytest

from tests.fast_requests import mismatches, one_torch_thread, request  # noqa: F401 (fixture)
from wicore.engines.base import EngineConfig
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine

pytestmark = pytest.mark.slow
PENALTIES = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"presence_penalty": -0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.1},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-w128", sliding_window=128)


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceEngine(EngineConfig(str(model_dir), max_batch_size=8))


@pytest.fixture(scope="module")
def fast(model_dir):
    options = FastOptions(torch_threads=1, block_size=4, paged_prefill_tokens=128)
    return FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=options))


def penalized(tag: str, **params):
    return [
        request(f"{tag}-img", variant=1, max_new_tokens=24, **params),
        request(f"{tag}-txt", "Tell me about the house.", images=0, max_new_tokens=20, **params),
    ]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_greedy_with_penalties_matches_the_reference(fast, reference, penalty):
    requests = penalized("p", **penalty)
    out, expected = fast.generate(requests), reference.generate(requests)
    assert all(c.ok for c in out) and mismatches(out, expected) == []
    plain = fast.generate(penalized("plain"))
    assert [c.token_ids for c in out] != [c.token_ids for c in plain], "the penalty changes the output"


def test_rows_without_penalties_keep_their_tokens_beside_penalized_ones(fast):
    alone = fast.generate(penalized("alone"))
    mixed = fast.generate(penalized("mixed") + penalized("pen", repetition_penalty=1.5, frequency_penalty=1.0))
    assert [c.token_ids for c in mixed[:2]] == [c.token_ids for c in alone]


@pytest.mark.parametrize("params", [{}, {"repetition_penalty": 1.2, "presence_penalty": 0.5}])
def test_logprobs_match_a_log_softmax_of_generates_scores(fast, reference, params):
    requests = penalized("lp", logprobs=True, top_logprobs=3, **params)
    out, expected = fast.generate(requests), reference.generate(requests)
    assert mismatches(out, expected) == []
    for mine, theirs in zip(out, expected, strict=True):
        assert mine.logprobs is not None and theirs.logprobs is not None
        assert len(mine.logprobs) == len(mine.token_ids) == len(theirs.logprobs)
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
            assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-4)
            assert a.top_logprobs[0].logprob == pytest.approx(a.logprob), "greedy: the token is the best one"
            assert a.bytes is not None and len(a.top_logprobs) == 3


def test_sampled_logprobs_are_those_of_the_warped_distribution(fast):
    [warm] = fast.generate([request("warm", variant=2, max_new_tokens=8, temperature=0.7, top_k=5, seed=3, logprobs=True, top_logprobs=8)])  # fmt: skip
    for entry in warm.logprobs:
        kept = [t for t in entry.top_logprobs if t.logprob > -9999.0]
        assert len(kept) == 5, "top_k=5 leaves five tokens; the others cannot be drawn"
        assert sum(2.718281828459045**t.logprob for t in kept) == pytest.approx(1.0, abs=1e-4)
        assert entry.logprob in [t.logprob for t in kept]
    [quiet] = fast.generate([request("quiet", variant=2, max_new_tokens=8)])
    assert quiet.logprobs is None, "no logprobs unless asked for"


def test_n_samples_are_reproducible_distinct_and_share_the_prompts_cached_blocks(model_dir):
    options = FastOptions(torch_threads=1, block_size=4, paged_prefill_tokens=128)
    engine = FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=options))
    ask = dict(variant=5, max_new_tokens=10, temperature=1.0, seed=11)
    [three] = engine.generate([request("n3", "What colour is it?", n=3, **ask)])
    stats = engine.stats()
    assert len(three.samples) == 3 and three.token_ids == three.samples[0].token_ids
    assert len({tuple(s.token_ids) for s in three.samples}) == 3, "three different samples at temperature 1"
    # samples 2 and 3 read sample 1's blocks: every full block of the prompt, its image included
    prompt = three.prompt_tokens
    assert stats["cached_prompt_tokens"] >= 2 * (prompt - 4) and stats["images"] == 1
    [again] = engine.generate([request("again", "What colour is it?", n=3, **ask)])
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in three.samples]
    [one] = engine.generate([request("one", "What colour is it?", **ask)])
    assert one.token_ids == three.samples[0].token_ids and one.samples == []


def test_a_seeded_penalized_sample_is_the_same_alone_and_among_others(fast):
    ask = dict(variant=3, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=21, repetition_penalty=1.2, logprobs=True)
    [alone] = fast.generate([request("alone", **ask)])
    crowd = [request(f"mate{i}", variant=i, max_new_tokens=6 + i, temperature=1.0) for i in range(3)]
    among = {c.id: c for c in fast.generate([crowd[0], request("among", **ask), *crowd[1:]])}["among"]
    assert among.token_ids == alone.token_ids
    assert [e.logprob for e in among.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)


def test_n_samples_on_the_reference_engine_are_reproducible(reference):
    ask = dict(variant=5, max_new_tokens=10, temperature=1.0, seed=11, n=3)
    first, second = (reference.generate([request(tag, **ask)])[0] for tag in ("r1", "r2"))
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in second.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) == 3


def spanning_stop(pieces: list[str]) -> tuple[str, int]:
    """A 4-character stop string: the last 2 characters of one token's text and the first 2 of the
    next, found nowhere earlier; and how many tokens it takes to complete it."""
    for k in range(1, len(pieces) - 1):
        end = len(pieces[k])
        stop = pieces[k + 1][end - 2 : end + 2]
        if end - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) - end >= 2 and stop not in pieces[k]:
            return stop, k + 1
    raise AssertionError("no two consecutive tokens of 2+ characters")


@pytest.mark.parametrize("engine_name", ["fast", "reference"])
def test_a_stop_string_spanning_two_tokens_ends_the_text_before_it(fast, reference, engine_name):
    engine = fast if engine_name == "fast" else reference
    ask = dict(variant=1, max_new_tokens=24, repetition_penalty=1.5)  # varied text
    [free] = engine.generate([request("free", **ask)])
    tokenizer = reference.tokenizer
    pieces = [tokenizer.decode(free.token_ids[:i], skip_special_tokens=True) for i in range(len(free.token_ids) + 1)]
    stop, tokens = spanning_stop(pieces)
    [cut] = engine.generate([request("cut", stop=(stop,), **ask)])
    assert cut.finish_reason == "stop_string" and cut.text == free.text[: free.text.find(stop)]
    assert cut.token_ids == free.token_ids[:tokens], "the ids end with the token that completed the stop"
