"""Guided outputs (`guided` / `response_format`): the spec's rules and its place in the job id,
the grammar cache, both engines on the demo captioner (every JSON output parses and validates;
a grammar that cannot end in time ends at max_new_tokens; a bad grammar fails its request
alone), then end to end: the official `openai` client's `response_format` and native `guided`
jobs through a real gateway and CPU worker, and a manifest through `wicore caption`."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from tests.helpers import served_with_a_worker, wicore
from wicore.bench import guided_bench
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.models import DEMOCAP_DIR
from wicore.schemas import CaptionJob, GenerationParams, GuidedSpec, ImageRef

ROOT = Path(__file__).resolve().parents[1]
IMAGES = sorted((ROOT / "examples" / "images").iterdir())
CHOICES = ["a red star on a purple background", "a blue square on a white background"]


def test_a_spec_is_exactly_one_of_schema_regex_and_choice():
    assert GuidedSpec(regex="a+").kind == "regex"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": [""]}, {"regex": ""}, {"grammar": "x"}):
        with pytest.raises(ValidationError):
            GuidedSpec.model_validate(bad)
    with pytest.raises(ValidationError, match="ignore_eos"):
        GenerationParams(guided=GuidedSpec(regex="a"), ignore_eos=True)


def test_the_spec_is_part_of_the_job_id():
    image = ImageRef(sha256="0" * 64)
    ids = {
        CaptionJob(image=image, model="m", params=GenerationParams(guided=spec)).job_id
        for spec in (None, GuidedSpec(regex="a+"), GuidedSpec(regex="b+"), GuidedSpec(choice=("a", "b")))
    }
    assert len(ids) == 4
    same = GuidedSpec(json_schema={"b": 1, "a": 2}).canonical() == GuidedSpec(json_schema={"a": 2, "b": 1}).canonical()
    assert same


def test_the_captioners_json_answer_is_the_token_sequence_the_schema_admits():
    """The JSON form democap trains on, in its own tokens, walks the schema's grammar to its end;
    the same fields spaced otherwise do not."""
    from transformers import AutoTokenizer

    from wicore.engines.guided import Grammars
    from wicore.models.democap.model import answer_text

    tok = AutoTokenizer.from_pretrained(DEMOCAP_DIR)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    grammars = Grammars(tok, 1024, frozenset({tok.eos_token_id, end_of_turn}))
    trained = answer_text("a red star on a purple background", "json")
    loose = '{"shape":"star","color":"red","background":"purple"}<end_of_turn>'
    walked = {}
    for text in (trained, loose):
        state = grammars.state(GuidedSpec(json_schema=guided_bench.SCHEMA))
        assert state is not None
        for token in tok(text, add_special_tokens=False).input_ids:
            state.accept(token)
        walked[text] = not state.broken and state.matcher.is_terminated()
    assert walked == {trained: True, loose: False}


def test_a_grammar_compiles_once_and_the_cache_is_bounded():
    from transformers import AutoTokenizer

    from wicore.engines.guided import Grammars
    from wicore.errors import BadGrammar

    grammars = Grammars(AutoTokenizer.from_pretrained(DEMOCAP_DIR), 1024, frozenset({1}), capacity=2)
    for _ in range(3):
        grammars.state(GuidedSpec(json_schema=guided_bench.SCHEMA))
    assert grammars.compiles == 1
    grammars.state(GuidedSpec(regex="a+"))
    grammars.state(GuidedSpec(regex="b+"))
    grammars.state(GuidedSpec(json_schema=guided_bench.SCHEMA))
    assert grammars.compiles == 4  # evicted by the two regexes
    with pytest.raises(BadGrammar, match="regex"):
        grammars.state(GuidedSpec(regex="(a|b"))
    with pytest.raises(BadGrammar, match="json_schema"):
        grammars.state(GuidedSpec(json_schema={"type": "strng"}))


def engine(name: str):
    from wicore.engines import create_engine

    return create_engine(name, EngineConfig(model_dir=str(DEMOCAP_DIR), max_batch_size=16))


@pytest.mark.slow
def test_fast_engine_json_outputs_all_validate_on_20_images():
    report = guided_bench.run(engine("fast"), 20)
    assert report["guided_valid"] == 20 and report["guided_finish_reasons"] == {"stop": 20}
    assert report["choice_valid"] == 20
    for own_phrasing in ("regex_caption", "choice_caption"):
        assert report[own_phrasing]["all_three"] >= report["free"]["all_three"] - 0.05
    assert report["guided"]["all_three"] >= report["free"]["all_three"] - 0.1  # asked for JSON, it answers in JSON


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fast", "reference"])
def test_each_request_keeps_its_grammar_in_a_shared_batch(name):
    from wicore.models.democap.data import decode

    image = decode(IMAGES[2].read_bytes())  # red-star-on-purple
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": guided_bench.PROMPT}]}]
    specs = {
        "free": None,
        "json": GuidedSpec(json_schema=guided_bench.SCHEMA),
        "choice": GuidedSpec(choice=tuple(CHOICES)),
        "regex": GuidedSpec(regex=guided_bench.CAPTION_REGEX),
        "endless": GuidedSpec(regex="[a-z]{500}"),  # cannot end within 8 tokens
        "bad": GuidedSpec(regex="(a|b"),
    }
    requests = [
        EngineRequest(key, chat, [image], GenerationParams(max_new_tokens=8 if key == "endless" else 64, guided=spec))
        for key, spec in specs.items()
    ]
    running = engine(name)
    done = {c.id: c for c in running.generate(requests)}
    assert done["free"].text == "a red star on a purple background"
    valid_json(json.loads(done["json"].text))
    assert done["choice"].text == CHOICES[0] and done["choice"].finish_reason == "stop"
    assert done["regex"].text == "a red star on a purple background"
    assert done["endless"].finish_reason == "length" and len(done["endless"].token_ids) == 8
    assert done["bad"].input_error and "BadGrammar: regex" in done["bad"].error
    if name == "fast":  # the host's share of guided steps, for benchmarks to report
        stats = running.stats()
        assert stats["guided_steps"] > 0 and stats["guided_wait_s"] >= 0 and stats["guided_mask_s"] > 0


@pytest.mark.slow
def test_both_engines_give_the_same_guided_tokens():
    """Greedy and guided, the fast engine (continuous batching, masks in its sampler) and the
    reference (HF generate's logits processor) agree token for token on the six examples."""
    from wicore.models.democap.data import decode

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": guided_bench.PROMPT}]}]
    specs = (GuidedSpec(json_schema=guided_bench.SCHEMA), GuidedSpec(regex=guided_bench.CAPTION_REGEX), None)
    requests = [
        EngineRequest(f"{i}-{j}", chat, [decode(path.read_bytes())], GenerationParams(max_new_tokens=64, guided=spec))
        for i, path in enumerate(IMAGES)
        for j, spec in enumerate(specs)
    ]
    fast, reference = (engine(name).generate(requests) for name in ("fast", "reference"))
    assert [c.token_ids for c in fast] == [c.token_ids for c in reference]
    assert all(c.finish_reason == "stop" for c in fast)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fast", "reference"])
def test_sampled_guided_outputs_validate_under_top_k_and_top_p(name):
    """The grammar's mask comes before top-k / top-p: they choose among its tokens only."""
    from wicore.models.democap.data import decode

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": guided_bench.PROMPT}]}]
    spec = GuidedSpec(json_schema=guided_bench.SCHEMA)
    requests = [
        EngineRequest(str(seed), chat, [decode(IMAGES[0].read_bytes())], GenerationParams(
            max_new_tokens=64, temperature=1.5, top_k=3, top_p=0.9, seed=seed, guided=spec
        ))
        for seed in range(4)
    ]  # fmt: skip
    for completion in engine(name).generate(requests):
        assert completion.ok, completion.error
        valid_json(json.loads(completion.text))


@pytest.mark.gpu
def test_masks_on_the_gpu_equal_the_cpus():
    """The pinned buffer, its asynchronous copy and xgrammar's Triton kernel against its CPU path."""
    import torch
    from transformers import AutoTokenizer

    from wicore.engines.guided import Grammars, MaskRows, mask_logits

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tokenizer = AutoTokenizer.from_pretrained(DEMOCAP_DIR)
    grammars = Grammars(tokenizer, 1024, frozenset({tokenizer.eos_token_id}))
    gpu_masks = MaskRows("cuda")
    for step in range(3):  # the buffer reused
        states = [
            grammars.state(GuidedSpec(json_schema=guided_bench.SCHEMA)),
            None,
            grammars.state(GuidedSpec(choice=tuple(CHOICES))),
        ]
        logits = torch.randn(3, 1024, generator=torch.Generator().manual_seed(step))
        on_gpu = mask_logits(logits.cuda(), states, gpu_masks).cpu()
        assert torch.equal(on_gpu, mask_logits(logits.clone(), states, MaskRows("cpu")))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gateway URL, Redis URL): one embedded Redis, a gateway and a CPU worker (fast engine)."""
    with served_with_a_worker(tmp_path_factory.mktemp("logs"), batch_size=8) as served:
        yield served.url, served.redis_url


def data_uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat_body(raw: bytes, **fields) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_uri(raw)}},
        {"type": "text", "text": guided_bench.PROMPT},
    ]
    return {"model": "democap", "messages": [{"role": "user", "content": content}], "max_tokens": 64, **fields}


RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "shape", "schema": guided_bench.SCHEMA, "strict": True},
}


@pytest.mark.slow
def test_openai_response_format_outputs_validate_on_20_images(served):
    import openai

    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", timeout=120)
    for raw, _ in guided_bench.samples(20):
        reply = client.chat.completions.create(**chat_body(raw, response_format=RESPONSE_FORMAT))
        assert reply.choices[0].finish_reason == "stop"
        valid_json(json.loads(reply.choices[0].message.content))
    any_object = client.chat.completions.create(
        **chat_body(IMAGES[0].read_bytes(), response_format={"type": "json_object"})
    )
    choice = any_object.choices[0]  # any object: its keys are free text, which this model may not end
    assert choice.message.content.startswith("{")
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


@pytest.mark.slow
def test_native_jobs_take_regex_and_choice(served):
    raw = IMAGES[2].read_bytes()  # red-star-on-purple
    for guided, expected in (({"regex": guided_bench.CAPTION_REGEX}, CHOICES[0]), ({"choice": CHOICES}, CHOICES[0])):
        body = {"image": base64.b64encode(raw).decode(), "guided": guided, "params": {"max_new_tokens": 64}}
        accepted = httpx.post(f"{served[0]}/v1/jobs", json=body)
        assert accepted.status_code == 202, accepted.text
        view = httpx.get(f"{served[0]}{accepted.json()['status_url']}", params={"wait": 60}).json()
        assert view["result"]["text"] == expected


BAD_CHAT = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
        "response_format.json_schema.schema",
    ),
    ({"guided": {"regex": "(a|b"}}, "guided"),
    ({"guided": {"choice": []}}, "guided"),
    ({"guided": {"regex": "a"}, "response_format": {"type": "json_object"}}, "guided"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("fields", "param"), BAD_CHAT)
def test_a_bad_grammar_is_a_400_naming_its_field(served, fields, param):
    reply = httpx.post(f"{served[0]}/v1/chat/completions", json=chat_body(IMAGES[0].read_bytes(), **fields))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    for guided in ({"regex": "(a|b"}, {"choice": []}, {"json_schema": {"type": "strng"}}):
        native = httpx.post(f"{served[0]}/v1/jobs", json={"prompt": "x", "guided": guided})
        assert native.status_code == 400 and native.json()["error"]["param"].startswith("guided"), native.text
    under_params = httpx.post(f"{served[0]}/v1/jobs", json={"prompt": "x", "params": {"guided": {"regex": "(a|b"}}})
    assert under_params.status_code == 400 and under_params.json()["error"]["param"] == "params", under_params.text


@pytest.mark.slow
def test_a_grammar_that_cannot_compile_fails_its_job_alone_in_the_worker(served):
    """The producer checks a spec's form, not whether it compiles (it imports no grammar
    library): the worker fails that job with the reason; its batch mates finish."""
    from wicore.producer import Producer, Submission

    image = IMAGES[2]  # red-star-on-purple
    params = GenerationParams(max_new_tokens=64)
    producer = Producer(served[1], model="democap")
    ids = producer.submit_many(
        [
            Submission(image, guided=GuidedSpec(regex="(a|b")),
            Submission(image, guided=GuidedSpec(choice=tuple(CHOICES)), params=params),
            Submission(image, guided=GuidedSpec(json_schema={"type": "strng"})),
            Submission(image, params=params),
        ]
    )
    outcomes = {o.job_id: o for o in producer.wait(ids, timeout=120)}
    bad_regex, choice, bad_schema, free = (outcomes[i] for i in ids)
    assert bad_regex.error.startswith("BadGrammar: regex") and bad_schema.error.startswith("BadGrammar: json_schema")
    assert choice.result.text == CHOICES[0] and free.result.text == CHOICES[0]


@pytest.mark.slow
def test_caption_manifest_lines_take_guided(tmp_path):
    image = IMAGES[2]
    (tmp_path / image.name).write_bytes(image.read_bytes())
    lines = [
        {"image": image.name, "guided": {"choice": CHOICES}, "input": "choice"},
        {"image": image.name, "guided": {"regex": guided_bench.CAPTION_REGEX}, "input": "regex"},
        {"image": image.name, "guided": {"json_schema": guided_bench.SCHEMA}, "input": "json"},
        {"image": image.name, "guided": {"regex": "(a|b"}, "input": "bad"},
    ]
    manifest = tmp_path / "guided.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = wicore("caption", str(manifest), "-o", str(out), "--max-new-tokens", "64", env=env, check=False)
    assert done.returncode == 1, done.stderr  # the bad line failed, alone
    by_input = {line["input"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert by_input["choice"]["text"] == CHOICES[0]
    assert by_input["regex"]["text"] == CHOICES[0]
    valid_json(json.loads(by_input["json"]["text"]))
    assert "guided: regex" in by_input["bad"]["error"]


def test_masks_reach_the_constrained_rows_only():
    """A free row keeps its logits; a constrained row keeps exactly its grammar's tokens, whether
    it is alone or one of several, and the host buffer is reused between steps."""
    import torch
    from transformers import AutoTokenizer

    from wicore.engines.guided import Grammars, MaskRows, mask_logits

    tokenizer = AutoTokenizer.from_pretrained(DEMOCAP_DIR)
    grammars = Grammars(tokenizer, 1024, frozenset({tokenizer.eos_token_id}))
    allowed = set(tokenizer.encode("yes", add_special_tokens=False)[:1]) | set(
        tokenizer.encode("no", add_special_tokens=False)[:1]
    )
    masks = MaskRows("cpu")
    for states in (
        [None, grammars.state(GuidedSpec(choice=("yes", "no"))), None],
        [grammars.state(GuidedSpec(choice=("yes", "no")))] * 2,
    ):
        logits = torch.randn(len(states), 1024)
        before = logits.clone()
        mask_logits(logits, states, masks)
        for row, state in enumerate(states):
            kept = set(torch.nonzero(logits[row] > float("-inf")).flatten().tolist())
            if state is None:
                assert torch.equal(logits[row], before[row])
            else:
                assert allowed <= kept and len(kept) < 20, kept


def valid_json(value) -> None:
    """Validated against the bench's schema (jsonschema: the test extra, imported where used so
    the GPU tests of this module run on an image without it)."""
    import jsonschema

    jsonschema.validate(value, guided_bench.SCHEMA)
