"""Manifest lines with `messages` (and text-only prompts) through `wicore caption` on the demo
captioner, and the `max_images_per_request` setting at each layer: the producer's per-input
error, the worker's per-job error (nothing else in the batch affected), a bad value's exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import start_worker, stop, wicore
from wicore.embedded import EmbeddedRedis

pytestmark = pytest.mark.slow

IMAGES = sorted((Path(__file__).resolve().parents[1] / "examples" / "images").iterdir())
TEXT = {"type": "text", "text": "Describe this image in detail."}


def caption_of(path: Path) -> str:
    color, shape, _, background = path.stem.split("-")
    article = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


def picture(path: Path) -> dict:
    return {"type": "image", "image": path.name}


def user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


def demo_prompt_tokens(chat: list[dict], images: int) -> int:
    from transformers import AutoConfig, AutoProcessor

    from wicore.engines.fast.prompt_inputs import InputProcessor
    from wicore.models import DEMOCAP_DIR

    config = AutoConfig.from_pretrained(DEMOCAP_DIR)
    inputs = InputProcessor(
        AutoProcessor.from_pretrained(DEMOCAP_DIR), config.image_token_id, config.mm_tokens_per_image
    )
    return len(inputs.prompt(chat, images).ids)


def test_caption_does_what_each_manifest_line_says(tmp_path):
    for image in IMAGES:
        shutil.copy(image, tmp_path / image.name)
    first, second, third = IMAGES[:3]
    lines = [
        {"messages": user(picture(first), TEXT), "input": "image-first"},
        {
            "messages": [{"role": "system", "content": "Short."}, *user(picture(first), picture(second), TEXT)],
            "input": "two",
        },
        {"prompt": "Name a colour.", "input": "text-only"},
        {"messages": user(picture(first), picture(second), picture(third)), "input": "three"},
        {"messages": user({"type": "image", "image": "missing.png"}, TEXT), "input": "missing"},
        {"messages": user(picture(first)) + [{"role": "assistant", "content": "done"}], "input": "ends-with-assistant"},
        {"image": second.name, "input": "one-image-shorthand"},
    ]
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "WICORE_MAX_IMAGES_PER_REQUEST": "2"}
    done = wicore("caption", str(manifest), "-o", str(out), "--max-new-tokens", "24", env=env, check=False)
    assert done.returncode == 1, done.stderr  # some inputs failed
    by_input = {line["input"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert by_input["image-first"]["text"] == caption_of(first)
    assert by_input["one-image-shorthand"]["text"] == caption_of(second)
    two_chat = [{"role": "system", "content": "Short."}, *user({"type": "image"}, {"type": "image"}, TEXT)]
    assert by_input["two"]["status"] == "finished"
    assert by_input["two"]["prompt_tokens"] == demo_prompt_tokens(two_chat, 2)
    assert by_input["text-only"]["status"] == "finished" and by_input["text-only"]["output_tokens"] > 0
    assert "max_images_per_request" in by_input["three"]["error"]
    assert "missing.png: no such file" in by_input["missing"]["error"]
    assert "the last turn must be the user's" in by_input[f"{manifest}:6"]["error"]  # not a line: keyed by place


def test_a_bad_max_images_per_request_is_one_line_exit_2(tmp_path):
    done = wicore("caption", str(IMAGES[0]), "-o", str(tmp_path / "o.jsonl"), env={"WICORE_MAX_IMAGES_PER_REQUEST": "-1"},
                  check=False)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "max_images_per_request" in done.stderr


def test_the_worker_fails_a_job_over_its_image_limit_alone(tmp_path):
    from wicore.producer import Producer, Submission
    from wicore.schemas import GenerationParams

    with EmbeddedRedis() as server:
        worker = start_worker(
            "--redis-url", server.url, "--engine", "fast", "--engine-option", "torch_threads=1",
            env={"WICORE_MAX_IMAGES_PER_REQUEST": "1"}, log=tmp_path / "worker.log",
        )  # fmt: skip
        try:
            producer = Producer(server.url, model="democap")
            params = GenerationParams(max_new_tokens=24)
            two = Submission(prompt="Both?", images=(IMAGES[0].read_bytes(), IMAGES[1].read_bytes()), params=params)
            one = Submission(IMAGES[2].read_bytes(), params=params)
            over, fine = producer.submit_many([two, one])
            assert "TooManyImages" in producer.outcome(over, timeout=120).error
            assert producer.outcome(fine, timeout=120).result.text == caption_of(IMAGES[2])
        finally:
            stop(worker)


def test_enqueue_makes_one_job_per_line_holding_its_conversation(tmp_path):
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from wicore.schemas import CaptionJob

    for image in IMAGES[:2]:
        shutil.copy(image, tmp_path / image.name)
    lines = [{"messages": user(picture(IMAGES[0]), TEXT, picture(IMAGES[1]))}, {"prompt": "Text only."}]
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with EmbeddedRedis() as server:
        enqueued = wicore("enqueue", str(manifest), "--redis-url", server.url)
        ids = [line.split("\t")[0] for line in enqueued.stdout.splitlines()]
        connection = Redis.from_url(server.url)
        jobs = [
            CaptionJob.model_validate(Job.fetch(i, connection=connection, serializer=JSONSerializer).args[0])
            for i in ids
        ]
    pair, text = jobs
    assert len(pair.images) == 2 and pair.chat()[0]["content"][1] == TEXT
    assert text.images == () and text.chat() == [{"role": "user", "content": [{"type": "text", "text": "Text only."}]}]
