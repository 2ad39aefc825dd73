"""The device sampler: greedy, seeded Gumbel-max sampling, top-k / top-p, EOS suppression,
penalties, logprobs."""

from __future__ import annotations

from collections import Counter

import torch

from wicore.engines.fast.penalties import Penalties
from wicore.engines.fast.sampler import Sampler, SamplingBatch, mask_top_k, mix32, request_key
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


def naive_penalties(row: torch.Tensor, prompt: list[int], output: list[int], params: GenerationParams) -> torch.Tensor:
    """One row, token by token: transformers' repetition penalty over prompt and output, OpenAI's
    presence and frequency penalties over the output."""
    row = row.clone()
    for token in set(prompt + output):
        value = row[token]
        row[token] = value * params.repetition_penalty if value < 0 else value / params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def test_penalties_equal_a_row_by_row_reference():
    x = logits(4, seed=3)
    params = [
        GenerationParams(repetition_penalty=1.3),
        GenerationParams(),
        GenerationParams(presence_penalty=0.5, frequency_penalty=-0.3),
        GenerationParams(repetition_penalty=0.7, frequency_penalty=1.5),
    ]
    prompts = [[2, 3, 3], [4], [5, 6], [9, 9, 8, 2]]
    outputs = [[3, 11, 11], [4, 4], [6, 12, 12, 12], []]
    width = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    seen = torch.full((4, width), VOCAB)
    output = torch.full((4, width), VOCAB)
    for row, (prompt, out) in enumerate(zip(prompts, outputs)):
        seen[row, : len(prompt) + len(out)] = torch.tensor(prompt + out)
        output[row, len(prompt) : len(prompt) + len(out)] = torch.tensor(out, dtype=torch.int64)
    floats = lambda name: torch.tensor([getattr(p, name) for p in params])  # noqa: E731
    slots = (torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    values = (floats("presence_penalty"), floats("frequency_penalty"), floats("repetition_penalty"))
    got = Penalties(None, *values, seen, output, slots).apply(x)
    for row in range(4):
        assert torch.allclose(got[row], naive_penalties(x[row], prompts[row], outputs[row], params[row]))
    assert torch.equal(got[1], x[1]), "a row without penalties keeps its logits"
    picked = torch.tensor([0, 2, 3])  # only the penalized rows are worked on: the others are copied
    some = Penalties(picked, *(v[picked] for v in values), seen[picked], output[picked], slots).apply(x)
    assert torch.equal(some, got)


def test_logprobs_are_of_the_distribution_the_token_was_drawn_from():
    x = logits(3, seed=4)
    params = [
        GenerationParams(logprobs=True, top_logprobs=2),
        GenerationParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5),
        GenerationParams(temperature=1.0),
    ]
    batch = SamplingBatch.build(params, [1, 2, 3], [0, 0, 0], "cpu", top_logprobs=5, logprob_rows=[0, 1])
    tokens, scores = Sampler(VOCAB, EOS, "cpu").sample(x, batch)
    assert batch.top_logprobs == 5 and scores.top_ids.shape == (2, 5), "the rows that ask, alone"
    greedy = torch.log_softmax(x[0], -1)
    assert scores.chosen[0] == greedy[tokens[0]] and scores.top_ids[0, 0] == x[0].argmax()
    warped = torch.log_softmax(mask_top_k(x[1:2] / 0.5, torch.tensor([3])), -1)[0]
    assert torch.allclose(scores.top_logprobs[1, :3], warped.topk(3).values)
    assert torch.isinf(scores.top_logprobs[1, 3:]).all(), "past top_k nothing can be drawn"
    assert scores.chosen[1] == warped[tokens[1]]
    quiet = SamplingBatch.build([GenerationParams(temperature=1.0)], [3], [0], "cpu")
    assert quiet.top_logprobs is None and Sampler(VOCAB, EOS, "cpu").sample(x[2:], quiet).scores is None
