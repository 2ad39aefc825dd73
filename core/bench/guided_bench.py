"""Structured outputs on the demo captioner: how often a JSON-schema output (`guided`) names the
true shape, colour and background of a generated image, against the free-text caption's words
(and a regex and a choice output in the captioner's own phrasing).

The images are the demo captioner's own task (`democap.data`, seeded, as examples/make_images.py
draws them). Each image runs five times on one engine, in one batch: free (its caption), guided by
`SCHEMA` (enums of the captioner's words) with a prompt that asks for JSON (`JSON_PROMPT`, as the
model was trained to answer in JSON) and again with the caption prompt (`guided_plain_prompt`),
by `CAPTION_REGEX` and by `CAPTIONS` (a choice of every caption the task has). Every JSON output
must parse and validate; the fields of each are compared with the truth.

python -m wicore.bench.guided_bench --images 200 --out bench/results/guided-democap-2cpu.json
python -m wicore.bench.guided_bench --images 200 --via-gateway --out bench/results/guided-democap-gateway-2cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from wicore.models.corpus import COLORS, SHAPES

FIELDS = ("shape", "color", "background")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"shape": {"enum": SHAPES}, "color": {"enum": COLORS}, "background": {"enum": COLORS}},
    "required": list(FIELDS),
    "additionalProperties": False,
}
_words = lambda words: "(" + "|".join(words) + ")"  # noqa: E731
# The captioner's own phrasing as a grammar: what enforcement costs when it admits the model's form.
CAPTION_REGEX = f"(a|an) {_words(COLORS)} {_words(SHAPES)} on (a|an) {_words(COLORS)} background"


def all_captions() -> tuple[str, ...]:
    from wicore.models.democap.data import caption

    return tuple(caption(c, s, b) for c in COLORS for s in SHAPES for b in COLORS if b != c)


PROMPT = "Describe this image in detail."
JSON_PROMPT = "Describe this image as JSON with the keys shape, color and background."  # democap's JSON_PROMPTS[0]
SEED = 7


def samples(n: int, seed: int = SEED) -> list[tuple[bytes, dict[str, str]]]:
    """n generated images (file bytes) with their true fields."""
    from wicore.models.democap import data

    return [
        (data.image_bytes(s), {"shape": s.shape, "color": s.color, "background": s.background})
        for s in data.sample_specs(n, seed)
    ]


def caption_fields(text: str) -> dict[str, str | None]:
    """The fields a free caption names ("a red star on a purple background")."""
    words = text.split()
    shape = next((w for w in words if w in SHAPES), None)
    colors = [w for w in words if w in COLORS]
    return {
        "shape": shape,
        "color": colors[0] if colors else None,
        "background": colors[1] if len(colors) > 1 else None,
    }


def json_fields(text: str) -> dict[str, Any] | None:
    """The guided output's fields when it parses and validates against SCHEMA, else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != set(FIELDS):
        return None
    enums = {"shape": SHAPES, "color": COLORS, "background": COLORS}
    return value if all(value[f] in enums[f] for f in FIELDS) else None


def score(truths: list[dict[str, str]], outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Per-field and all-three match rates of `outputs` (None: did not parse) against `truths`."""
    n = len(truths)
    per_field = {f: sum(o is not None and o.get(f) == t[f] for t, o in zip(truths, outputs)) / n for f in FIELDS}
    exact = sum(o is not None and all(o.get(f) == t[f] for f in FIELDS) for t, o in zip(truths, outputs)) / n
    return {"per_field": per_field, "all_three": exact}


def run(engine, n: int, max_new_tokens: int = 64, seed: int = SEED) -> dict[str, Any]:
    """Both versions of every image through `engine` (one `generate` call) -> the report."""
    from wicore.engines.base import EngineRequest
    from wicore.models.democap.data import decode
    from wicore.schemas import GenerationParams, GuidedSpec

    drawn = samples(n, seed)
    free = GenerationParams(max_new_tokens=max_new_tokens)
    guided = GenerationParams(max_new_tokens=max_new_tokens, guided=GuidedSpec(json_schema=SCHEMA))
    regex = GenerationParams(max_new_tokens=max_new_tokens, guided=GuidedSpec(regex=CAPTION_REGEX))
    choice = GenerationParams(max_new_tokens=max_new_tokens, guided=GuidedSpec(choice=all_captions()))
    kinds = (
        ("free", PROMPT, free),
        ("guided", JSON_PROMPT, guided),
        ("guided_plain", PROMPT, guided),
        ("regex", PROMPT, regex),
        ("choice", PROMPT, choice),
    )
    requests = [
        EngineRequest(f"{kind}-{i}", image_chat(prompt), [decode(raw)], params)
        for i, (raw, _) in enumerate(drawn)
        for kind, prompt, params in kinds
    ]
    start = time.perf_counter()
    done = {c.id: c for c in engine.generate(requests)}
    seconds = time.perf_counter() - start
    truths = [truth for _, truth in drawn]
    guided_text = [done[f"guided-{i}"].text or "" for i in range(n)]
    parsed = [json_fields(text) for text in guided_text]
    plain = [json_fields(done[f"guided_plain-{i}"].text or "") for i in range(n)]
    return {
        "images": n,
        "seed": seed,
        "engine": engine.name,
        "schema": SCHEMA,
        "json_prompt": JSON_PROMPT,
        "guided_valid": sum(p is not None for p in parsed),
        "guided_finish_reasons": _count(done[f"guided-{i}"].finish_reason for i in range(n)),
        "guided": score(truths, parsed),
        "guided_plain_prompt_valid": sum(p is not None for p in plain),
        "guided_plain_prompt": score(truths, plain),
        "free": score(truths, [caption_fields(done[f"free-{i}"].text or "") for i in range(n)]),
        "regex_caption": score(truths, [caption_fields(done[f"regex-{i}"].text or "") for i in range(n)]),
        "choice_caption": score(truths, [caption_fields(done[f"choice-{i}"].text or "") for i in range(n)]),
        "choice_valid": sum(done[f"choice-{i}"].text in all_captions() for i in range(n)),
        "regex": CAPTION_REGEX,
        "seconds_both": round(seconds, 2),
        "guided_examples": guided_text[:3],
    }


def image_chat(prompt: str) -> list[dict]:
    """One user turn: the image, then `prompt`."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]


def run_via_gateway(n: int, max_new_tokens: int = 64, seed: int = SEED, clients: int = 32) -> dict[str, Any]:
    """The same comparison as `run`, end to end: every image asked free and with OpenAI's
    `response_format` (and `JSON_PROMPT`) through the official `openai` client, against a
    `wicore serve` gateway and one CPU worker (fast engine) on an embedded Redis, `clients`
    requests in flight."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    import openai

    drawn = samples(n, seed)
    response_format = {"type": "json_schema", "json_schema": {"name": "picture", "schema": SCHEMA, "strict": True}}

    def ask(client, raw: bytes, constrained: bool):
        url = "data:image/png;base64," + base64.b64encode(raw).decode()
        prompt = JSON_PROMPT if constrained else PROMPT
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
        extra = {"response_format": response_format} if constrained else {}
        reply = client.chat.completions.create(
            model="democap", messages=[{"role": "user", "content": content}], max_tokens=max_new_tokens, **extra
        )
        return reply.choices[0]

    with served_gateway(clients) as base_url:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=600)
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            free = list(pool.map(lambda item: ask(client, item[0], False), drawn))
            constrained = list(pool.map(lambda item: ask(client, item[0], True), drawn))
        seconds = time.perf_counter() - start
    truths = [truth for _, truth in drawn]
    parsed = [json_fields(choice.message.content) for choice in constrained]
    return {
        "images": n,
        "seed": seed,
        "via": "openai client -> wicore serve -> Redis -> wicore worker (fast engine, CPU)",
        "schema": SCHEMA,
        "json_prompt": JSON_PROMPT,
        "guided_valid": sum(p is not None for p in parsed),
        "guided_finish_reasons": _count(choice.finish_reason for choice in constrained),
        "guided": score(truths, parsed),
        "free": score(truths, [caption_fields(choice.message.content) for choice in free]),
        "seconds_both": round(seconds, 2),
    }


@contextmanager
def served_gateway(batch_size: int) -> Iterator[str]:
    """A gateway URL over an embedded Redis and one CPU worker; both stopped after."""
    import subprocess
    import sys
    import urllib.request

    from wicore.embedded import EmbeddedRedis, free_port

    command = [sys.executable, "-m", "wicore.cli.main"]
    with EmbeddedRedis() as redis_server:
        port = free_port()
        worker_args = ["worker", "--redis-url", redis_server.url, "--engine", "fast", "--batch-size", str(batch_size)]
        processes = [
            subprocess.Popen([*command, *worker_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen(
                [*command, "serve", "--redis-url", redis_server.url, "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        ]
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while not _ready(url + "/health/ready", urllib.request):
                if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                    raise RuntimeError("the gateway or its worker did not start within 180 s")
                time.sleep(0.5)
            yield url
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=60)


def _ready(url: str, request) -> bool:
    try:
        return request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--engine", choices=("fast", "reference"), default="fast")
    parser.add_argument("--via-gateway", action="store_true", help="end to end: openai client, gateway, worker")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.via_gateway:
        _write(run_via_gateway(args.images), args.out)
        return
    from wicore.engines import create_engine
    from wicore.engines.base import EngineConfig
    from wicore.models import DEMOCAP_DIR

    engine = create_engine(args.engine, EngineConfig(model_dir=str(DEMOCAP_DIR), max_batch_size=32))
    _write(run(engine, args.images), args.out)


def _write(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
