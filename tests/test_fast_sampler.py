"""The device sampler: greedy, seeded Gumbel-max sampling, top-k / top-p, EOS suppression."""

from __future__ import annotations

from collections import Counter

import torch

from wicore.engines.fast.sampler import Sampler, SamplingBatch, mix32, request_key
from wicore.schemas import GenerationParams

VOCAB = 50
EOS = frozenset({1, 7})


def sample(logits, params, seeds, indices):
    sampler = Sampler(VOCAB, EOS, "cpu")
    return sampler(logits, SamplingBatch.build(params, seeds, indices, "cpu")).tolist()


def logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_and_ignore_eos_masks_eos():
    x = logits(3)
    x[1, 7] = 100.0  # EOS would win row 1
    params = [GenerationParams(), GenerationParams(ignore_eos=True), GenerationParams()]
    out = sample(x, params, [0, 0, 0], [0, 0, 0])
    want = x.argmax(-1).tolist()
    assert out[0] == want[0] and out[2] == want[2]
    masked = x[1].clone()
    masked[[1, 7]] = float("-inf")
    assert out[1] == masked.argmax().item()


def test_seeded_rows_do_not_depend_on_batch_mates():
    x = logits(4, seed=1)
    p = GenerationParams(temperature=1.0, seed=5)
    alone = sample(x[2:3], [p], [5], [3])
    crowd = sample(
        x,
        [GenerationParams(), GenerationParams(temperature=0.5), p, GenerationParams(top_k=3)],
        [0, 9, 5, 1],
        [0, 1, 3, 2],
    )
    assert crowd[2] == alone[0]
    assert sample(x[2:3], [p], [5], [3]) == alone  # reproducible


def test_noise_changes_with_seed_and_token_index():
    keys = {request_key(seed, index) for seed in range(20) for index in range(20)}
    assert len(keys) == 400 and all(0 <= k < 2**32 for k in keys)
    assert mix32(torch.tensor([12345]))[0].item() == mix32(12345)  # host and device agree
    assert request_key(2**40 + 3, 0) != request_key(3, 0)  # high seed bits count


def test_top_k_and_top_p_are_respected():
    x = logits(1, seed=2)
    allowed_k = set(torch.topk(x[0], 4).indices.tolist())
    probs = torch.softmax(x[0], -1)
    order = torch.argsort(probs, descending=True)
    mass = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((mass < 0.6).sum()) + 1].tolist())
    seen_k, seen_p = set(), set()
    for seed in range(300):
        seen_k.update(sample(x, [GenerationParams(temperature=1.0, top_k=4)], [seed], [0]))
        seen_p.update(sample(x, [GenerationParams(temperature=1.0, top_p=0.6)], [seed], [0]))
    assert seen_k == allowed_k
    assert seen_p == nucleus


def test_sampling_follows_the_softmax():
    x = torch.full((1, VOCAB), -30.0)
    x[0, 10], x[0, 20], x[0, 30] = 0.0, 1.0, 2.0  # probabilities ~ 0.09, 0.24, 0.67
    draws = Counter(sample(x, [GenerationParams(temperature=1.0)], [s], [0])[0] for s in range(3000))
    probs = torch.softmax(x[0], -1)
    for token in (10, 20, 30):
        assert abs(draws[token] / 3000 - probs[token].item()) < 0.03
    hot = Counter(sample(x, [GenerationParams(temperature=5.0)], [s], [0])[0] for s in range(1000))
    assert hot[10] > draws[10] * 1000 / 3000  # a higher temperature flattens the distribution
