"""Every message shape through the official `openai` client and the native route, end to end:
a real `wicore serve`, a real redis-server and a CPU worker (fast engine) on the bundled demo
captioner. Image first, text first and image only each caption all six examples right, and a
prompt asking for JSON under a JSON schema names their fields right in both orders; a text-only
chat answers; a message with two images is one job whose prompt holds both images'
tokens.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from tests.helpers import served_with_a_worker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
IMAGES = sorted((ROOT / "examples" / "images").iterdir())
MODEL = "democap"


def caption_of(path: Path) -> str:
    color, shape, _, background = path.stem.split("-")
    article = lambda word: "an" if word[0] in "aeiou" else "a"  # noqa: E731
    return f"{article(color)} {color} {shape} on {article(background)} {background} background"


def image_part(path: Path) -> dict:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"},
    }


TEXT = {"type": "text", "text": "Describe this image in detail."}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The gateway's URL, one CPU fast-engine worker behind it on one embedded Redis."""
    with served_with_a_worker(tmp_path_factory.mktemp("logs")) as served:
        yield served.url


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served + "/v1", api_key="unused", timeout=120)


def ask(client, content, max_tokens=24, **fields):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **fields)


@pytest.mark.parametrize("layout", ["image-first", "text-first", "image-only"])
def test_every_layout_captions_the_six_examples(client, layout):
    for image in IMAGES:
        part = image_part(image)
        content = {"image-first": [part, TEXT], "text-first": [TEXT, part], "image-only": [part]}[layout]
        reply = ask(client, content)
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (caption_of(image), "stop")


@pytest.mark.parametrize("layout", ["image-first", "text-first"])
def test_a_json_prompt_under_the_schema_names_the_six_examples_fields(client, layout):
    from wicore.bench.guided_bench import JSON_PROMPT, SCHEMA

    text = {"type": "text", "text": JSON_PROMPT}
    response_format = {"type": "json_schema", "json_schema": {"name": "picture", "schema": SCHEMA, "strict": True}}
    for image in IMAGES:
        part = image_part(image)
        content = {"image-first": [part, text], "text-first": [text, part]}[layout]
        reply = ask(client, content, 64, response_format=response_format)  # ~42 tokens
        color, shape, _, background = image.stem.split("-")
        expected = f'{{"shape": "{shape}", "color": "{color}", "background": "{background}"}}'
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (expected, "stop")


def test_a_text_only_chat_with_a_system_turn_answers(client):
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "What shapes exist?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0


def prompt_of(chat: list[dict], images: int) -> list[int]:
    """The demo model's prompt tokens for `chat`, as its processor lays them out."""
    from transformers import AutoConfig, AutoProcessor

    from wicore.engines.fast.prompt_inputs import InputProcessor
    from wicore.models import DEMOCAP_DIR

    config = AutoConfig.from_pretrained(DEMOCAP_DIR)
    inputs = InputProcessor(
        AutoProcessor.from_pretrained(DEMOCAP_DIR), config.image_token_id, config.mm_tokens_per_image
    )
    prompt = inputs.prompt(chat, images)
    assert len(prompt.image_starts) == images
    return prompt.ids


def test_two_images_in_one_message_are_one_job_holding_both(client, served):
    first, second = IMAGES[0], IMAGES[1]
    content = [image_part(first), {"type": "text", "text": "and"}, image_part(second), TEXT]
    reply = ask(client, content)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, TEXT]}]
    assert reply.usage.prompt_tokens == len(prompt_of(chat, 2))
    one = ask(client, [image_part(first), TEXT])
    assert reply.usage.prompt_tokens > one.usage.prompt_tokens + 16  # a second image's soft tokens and more
    job_id = reply.id.removeprefix("chatcmpl-")
    view = httpx.get(f"{served}/v1/jobs/{job_id}").json()
    assert view["status"] == "finished" and view["result"]["prompt_tokens"] == reply.usage.prompt_tokens


def test_native_messages_name_their_images(served):
    first, second = (base64.b64encode(p.read_bytes()).decode() for p in IMAGES[:2])
    user = {"role": "user", "content": [{"type": "image", "image": first}, {"type": "image", "image": second}, TEXT]}
    accepted = httpx.post(f"{served}/v1/jobs", json={"messages": [user], "params": {"max_new_tokens": 8}})
    assert accepted.status_code == 202, accepted.text
    view = httpx.get(f"{served}{accepted.json()['status_url']}", params={"wait": 60}).json()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, TEXT]}]
    assert view["status"] == "finished" and view["result"]["prompt_tokens"] == len(prompt_of(chat, 2))
    text_only = httpx.post(f"{served}/v1/jobs", json={"prompt": "Name a colour.", "params": {"max_new_tokens": 4}})
    view = httpx.get(f"{served}{text_only.json()['status_url']}", params={"wait": 60}).json()
    assert view["status"] == "finished" and view["result"]["output_tokens"] > 0
