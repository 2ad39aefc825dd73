"""Honest sampling and request fields at the producer and the worker: an unseeded sampled request
is a new job each time; a seeded or greedy one is deduplicated; a job's JSON keeps which
parameters it set, and the worker fills the rest from the checkpoint's generation_config.json
(or not, with generation_config = none). Real Redis, the tiny Gemma-3 checkpoint."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.helpers import png_bytes
from wicore.config import load_settings
from wicore.errors import ConfigError, ImageError
from wicore.producer import Producer, Submission
from wicore.schemas import CaptionJob, GenerationParams
from wicore.worker.factory import build_engine, build_worker, generation_defaults

MODEL = "tiny"


def test_unseeded_sampling_is_a_new_job_each_time_and_the_rest_dedup(redis_conn):
    producer = Producer(redis_conn, model=MODEL)
    image = png_bytes(1)

    def twice(params: GenerationParams) -> set[str]:
        return {producer.submit(image, "x", params=params) for _ in range(2)}

    assert len(twice(GenerationParams(temperature=0.8))) == 2
    assert len(twice(GenerationParams(temperature=0.8, seed=5))) == 1
    assert len(twice(GenerationParams())) == 1
    assert len(twice(GenerationParams(temperature=0.0))) == 1


def test_a_job_keeps_which_parameters_it_set():
    job = CaptionJob(image={"sha256": "0" * 64}, model=MODEL, params=GenerationParams(temperature=0.5))
    again = CaptionJob.model_validate(json.loads(job.model_dump_json()))
    assert again.params.model_fields_set == {"temperature"} and again.job_id == job.job_id
    defaults = {"temperature": 0.9, "top_k": 64, "max_new_tokens": 5}
    filled = again.params.with_defaults(defaults)
    assert (filled.temperature, filled.top_k, filled.max_new_tokens) == (0.5, 64, 5)
    unset = CaptionJob(image={"sha256": "0" * 64}, model=MODEL)
    explicit = CaptionJob(image={"sha256": "0" * 64}, model=MODEL, params=GenerationParams(max_new_tokens=64))
    assert unset.job_id != explicit.job_id, "left to the checkpoint is not the same work as set"


def test_a_producer_names_a_missing_image(redis_conn):
    producer = Producer(redis_conn, model=MODEL)
    with pytest.raises(ImageError, match=r"^image must be a file path, a URL or the image's bytes, got int$"):
        producer.submit(3, "x")  # None is no image: a text-only job
    with pytest.raises(ImageError, match=r"^image: https://: the URL names no host \(or bucket\)$"):
        producer.submit("https://", "x")


def test_a_url_job_carries_the_url_and_no_blob(redis_conn):
    producer = Producer(redis_conn, model=MODEL)
    url = "https://me:pw@images.example.com/cat.jpg?X-Amz-Signature=abc"
    job_id = producer.submit(url, "x")
    assert producer.submit(url, "x") == job_id, "the URL and the work are the job's identity"
    record = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    payload = CaptionJob.model_validate(record.args[0])
    assert payload.images[0].url == url and payload.images[0].sha256 is None
    assert record.description == "caption https://me:***@images.example.com/cat.jpg?X-Amz-Signature=***"
    assert not list(redis_conn.scan_iter("wicore:blob:*"))


def test_a_job_of_several_images_mixes_urls_and_blobs(redis_conn):
    producer = Producer(redis_conn, model=MODEL)
    url, image = "s3://bucket/photos/a.jpg", png_bytes(3)
    job_id = producer.submit_many([Submission(images=(url, image), prompt="compare")])[0]
    record = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
    first, second = CaptionJob.model_validate(record.args[0]).images
    assert (first.url, first.sha256, second.url) == (url, None, None) and second.is_blob
    assert record.description == f"caption {url}"
    assert [key.decode() for key in redis_conn.scan_iter("wicore:blob:*")] == [f"wicore:blob:{second.sha256}"]
    alone = producer.submit_many([Submission(images=(image,), prompt="compare")])[0]
    assert alone != job_id, "the URL is part of the work"


def checkpoint_with(tiny_model_dir, tmp_path, config: dict):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


def test_generation_config_gives_the_defaults_and_the_log_says_so(tiny_model_dir, tmp_path, caplog):
    model = checkpoint_with(
        tiny_model_dir, tmp_path, {"top_k": 64, "top_p": 0.95, "do_sample": True, "bos_token_id": 2}
    )
    caplog.set_level(logging.INFO, logger="wicore.worker.factory")
    assert generation_defaults(load_settings(), model) == {"top_k": 64, "top_p": 0.95}
    assert f"generation defaults from {model / 'generation_config.json'}" in caplog.text
    assert generation_defaults(load_settings(generation_config="none"), model) == {}
    assert "generation defaults: wicore's own (generation_config = none)" in caplog.text
    (model / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ConfigError, match=r"top_p"):
        generation_defaults(load_settings(), model)


def test_a_worker_applies_the_checkpoints_defaults_to_unset_parameters(redis_url, redis_conn, tiny_model_dir, tmp_path):
    model = checkpoint_with(tiny_model_dir, tmp_path, {"max_new_tokens": 2})
    settings = load_settings(redis_url=redis_url, engine="reference", max_queue_delay_ms=0)
    producer = Producer(redis_conn, model=MODEL)
    unset, given = producer.submit_many(
        [Submission(png_bytes(2), "x"), Submission(png_bytes(2), "x", params=GenerationParams(max_new_tokens=4))]
    )
    engine = build_engine(settings, model)
    build_worker(settings, redis_conn, engine, MODEL, burst=True).run()
    assert producer.result(unset, timeout=30).output_tokens <= 2
    assert producer.result(given, timeout=30).output_tokens == 4


@pytest.mark.slow
def test_caption_does_what_each_manifest_line_says(tmp_path):
    """`wicore caption` (the installed command, the demo captioner): a line's stop string, its
    token budget, its seeded sampling (the same text twice), its metadata."""
    from tests.helpers import wicore
    from tests.url_servers import EXAMPLES
    from wicore.schemas import ResultLine

    star = str(EXAMPLES / "red-star-on-purple.png")
    sampled = {"temperature": 1.5, "top_k": 5, "seed": 3, "max_new_tokens": 12}
    lines = [
        {"image": star, "input": "plain"},
        {"image": star, "input": "stop", "stop": "purple"},
        {"image": star, "input": "short", "params": {"max_new_tokens": 2}},
        {"image": star, "input": "seeded-1", **sampled},
        {"image": star, "input": "seeded-2", "params": sampled, "metadata": {"shelf": 4}},
    ]
    manifest = tmp_path / "lines.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    wicore("caption", str(manifest), "-o", str(out), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    got = {line.input: line for line in map(ResultLine.model_validate_json, out.read_text().splitlines())}
    assert got["plain"].text == "a red star on a purple background"
    assert (got["stop"].text, got["stop"].finish_reason) == ("a red star on a ", "stop_string")
    assert (got["short"].output_tokens, got["short"].finish_reason) == (2, "length")
    assert got["seeded-1"].job_id == got["seeded-2"].job_id and got["seeded-1"].text == got["seeded-2"].text
