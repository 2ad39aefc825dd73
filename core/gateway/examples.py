"""The example bodies the gateway's docs show (Swagger UI's "Try it out" sends them as they are):
each one runs against a gateway with a live worker and answers 2xx. Their `model` is the
gateway's own, set when the schema is made (`with_model`); images travel as data URLs."""

from __future__ import annotations

import json
from typing import Any

MODEL = "__gateway_model__"  # replaced by the gateway's model in the published schema
# A 32x32 PNG: a red circle on a blue background.
RED_CIRCLE_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAAAg0lEQVR42mOUsznBQEvAxEBjMGrBwFvAQqS6fY/CMAWd5FYR1MhIMJl"
    "iNZp4a5goNJ2gGiYKTSeokoly0/GrZ6KK6Xh0DUQ+IM/5uPSOFhWjFtDEAmLKSOILvgEKIvI8gVUXE3mlPPHqmciuSYhUyURJbUWMGk"
    "YiW3Y0rJNHc/KQtwAAP+grx4gUSQUAAAAASUVORK5CYII="
)
DATA_URL = "data:image/png;base64," + RED_CIRCLE_PNG
PROMPT = "Describe this image in detail."

CHAT = {
    "model": MODEL,
    "messages": [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": PROMPT}],
        }
    ],
    "max_tokens": 32,
}
CHAT_STREAM = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
COMPLETION = {"model": MODEL, "prompt": "Name a colour.", "max_tokens": 16}
JOB = {"image": RED_CIRCLE_PNG, "prompt": PROMPT, "params": {"max_new_tokens": 32}}
JOB_STREAM = {**JOB, "params": {"max_new_tokens": 32, "stream": True}}
JOB_BATCH = [JOB, {"prompt": "Name a shape.", "params": {"max_new_tokens": 8}}]
BATCH_LINE = {"custom_id": "line-1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def examples(**named: Any) -> dict[str, dict[str, Any]]:
    """OpenAPI `examples` (name -> {summary, value}), the summary from the name."""
    return {name: {"summary": name.replace("_", " "), "value": value} for name, value in named.items()}


def jsonl(*lines: dict) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def with_model(schema: dict[str, Any], model: str) -> dict[str, Any]:
    """`schema` with every example's `MODEL` placeholder set to `model`."""
    return json.loads(json.dumps(schema).replace(MODEL, model))
