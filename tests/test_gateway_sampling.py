"""The sampling fields over HTTP and through the queue: a real `wicore serve`, a real redis-server
and a CPU worker (fast engine) on the bundled demo captioner, through the official `openai`
client and httpx. `n` choices with their logprobs, penalties accepted, every malformed field a
400 naming it, and a job over the worker's cap failed alone beside a good one."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import httpx
import pytest

from tests.helpers import served_with_a_worker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
IMAGE = sorted((ROOT / "examples" / "images").iterdir())[0]
MODEL = "democap"


def caption_of(path: Path) -> str:
    color, shape, _, background = path.stem.split("-")
    article = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


def messages() -> list[dict]:
    url = f"data:image/png;base64,{base64.b64encode(IMAGE.read_bytes()).decode()}"
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Describe this image in detail."},
    ]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gateway URL, Redis URL), the worker with a lower max_n than the gateway's."""
    with served_with_a_worker(tmp_path_factory.mktemp("logs"), worker_env={"WICORE_MAX_N": "4"}) as served:
        yield served.url, served.redis_url


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120)


def test_n_choices_each_with_its_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=messages(), max_tokens=12, n=3, temperature=1.0, seed=5, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    tokens = 0
    for choice in reply.choices:
        content = choice.logprobs.content
        assert "".join(entry.token for entry in content).startswith(choice.message.content)
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes for e in content)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
        tokens += len(content)
    assert reply.usage.completion_tokens == tokens, "usage counts every choice's tokens"
    again = client.chat.completions.create(
        model=MODEL, messages=messages(), max_tokens=12, n=3, temperature=1.0, seed=5, logprobs=True, top_logprobs=2
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_greedy_choices_with_penalties_answer(client):
    reply = client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=24, n=2)
    assert [c.message.content for c in reply.choices] == [caption_of(IMAGE)] * 2 and reply.choices[0].logprobs is None
    penalized = client.chat.completions.create(
        model=MODEL,
        messages=messages(),
        max_completion_tokens=24,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.1},
    )
    assert penalized.choices[0].message.content  # each word of a caption appears once: the penalties barely bite
    probs = client.chat.completions.create(model=MODEL, messages=messages(), max_tokens=24, logprobs=True)
    content = probs.choices[0].logprobs.content
    assert content and all(e.top_logprobs == [] for e in content)
    assert math.exp(sum(e.logprob for e in content)) > 0.5, "the demo captioner is sure of its caption"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_each_malformed_field_is_a_400_naming_it(served, fields, param):
    body = {"model": MODEL, "messages": messages(), **fields}
    reply = httpx.post(served[0] + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert param in error["message"] and (error["param"] is None or param in error["param"])


def test_native_jobs_take_the_fields_and_refuse_a_bad_one(served):
    url = served[0]
    image = base64.b64encode(IMAGE.read_bytes()).decode()
    job = {"image": image, "prompt": "Describe this image in detail.", "params": {"n": 2, "logprobs": True}}
    accepted = httpx.post(url + "/v1/jobs", json=job, timeout=60).json()
    view = httpx.get(url + f"/v1/jobs/{accepted['job_id']}", params={"wait": 120}, timeout=130).json()
    result = view["result"]
    assert [c["index"] for c in result["choices"]] == [0, 1] and result["text"] == caption_of(IMAGE)
    assert len(result["logprobs"]) == len(result["token_ids"]) and result["output_tokens"] == 2 * len(
        result["token_ids"]
    )
    bad = httpx.post(url + "/v1/jobs", json={**job, "params": {"n": 99}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    worse = httpx.post(url + "/v1/jobs", json={**job, "params": {"presence_penalty": "lots"}}, timeout=60)
    assert worse.status_code == 400 and worse.json()["error"]["param"] == "params.presence_penalty"


def test_a_job_over_the_workers_cap_fails_alone(served):
    from wicore.producer import Producer, ProducerConfig, Submission
    from wicore.schemas import GenerationParams, SamplingLimits

    producer = Producer(served[1], model=MODEL, config=ProducerConfig(sampling=SamplingLimits(max_n=16)))
    over = Submission(IMAGE.read_bytes(), params=GenerationParams(n=8, max_new_tokens=24))
    fine = Submission(IMAGE.read_bytes(), params=GenerationParams(n=2, max_new_tokens=24))
    over_id, fine_id = producer.submit_many([over, fine])
    failed = producer.outcome(over_id, timeout=120)
    assert failed.error.startswith("OverLimit: n: 8 samples") and "max_n" in failed.error
    assert [c.text for c in producer.outcome(fine_id, timeout=120).result.choices] == [caption_of(IMAGE)] * 2
