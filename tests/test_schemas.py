"""Job payloads: validation at the boundary and content-derived ids; the shipped file formats."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tests.helpers import wicore
from wicore.cli.formats import Format, schema_text, shipped_path
from wicore.schemas import DEFAULT_PROMPT, CaptionJob, GenerationParams, ImageRef, Lane

SHA = "b" * 64


def job(**fields):
    return CaptionJob(image=ImageRef(sha256=SHA), model="tiny", **fields)


def test_job_id_is_derived_from_the_work_only():
    base = job(prompt="hello")
    assert base.job_id == job(prompt="hello", priority=Lane.HIGH, metadata={"x": 1}, deadline=5.0).job_id
    assert base.job_id != job(prompt="hello!").job_id
    assert base.job_id != job(prompt="hello", params=GenerationParams(max_new_tokens=3)).job_id
    assert base.job_id != CaptionJob(image=ImageRef(sha256="c" * 64), model="tiny", prompt="hello").job_id
    assert base.job_id.startswith("wc-") and len(base.job_id) == 35


def test_default_prompt_and_chat_shape():
    chat = job().chat()
    assert chat == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_PROMPT}]}]


def test_messages_need_exactly_one_image():
    ok = job(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}])
    assert ok.chat()[0]["content"][1]["text"] == "what?"
    with pytest.raises(ValidationError):
        job(messages=[{"role": "user", "content": "no image"}])
    with pytest.raises(ValidationError):
        job(prompt="x", messages=[{"role": "user", "content": [{"type": "image"}]}])


@pytest.mark.parametrize(
    "bad",
    [
        {"model": "has.dot"},
        {"model": "x", "params": {"max_new_tokens": 0}},
        {"model": "x", "params": {"top_p": 0}},
        {"model": "x", "params": {"stop": [""]}},
        {"model": "x", "unknown_key": 1},
        {"model": "x", "image": {"sha256": "not-a-hash"}},
    ],
)
def test_bad_payloads_fail_validation(bad):
    payload = {"image": {"sha256": SHA}, **bad}
    with pytest.raises(ValidationError):
        CaptionJob.model_validate(payload)


def test_round_trip_through_json():
    original = job(prompt="p", params=GenerationParams(stop=("\n",), seed=3), metadata={"k": [1, 2]})
    assert CaptionJob.model_validate_json(original.model_dump_json()) == original


def test_the_shipped_json_schemas_are_the_models_and_wicore_schema_prints_them():
    for fmt in Format:
        assert shipped_path(fmt).read_text() == schema_text(fmt), "regenerate core/json_schemas (wicore schema)"
        assert wicore("schema", fmt.value).stdout == shipped_path(fmt).read_text()
    manifest = json.loads(shipped_path(Format.manifest).read_text())
    assert "required" not in manifest and manifest["additionalProperties"] is False  # own keys: metadata
    assert {"image", "prompt", "messages", "params", "metadata", "temperature"} <= set(manifest["properties"])
    result = json.loads(shipped_path(Format.result).read_text())
    assert set(result["required"]) == {"input", "job_id", "status"} and result["additionalProperties"] is False
