"""A Gemma-3 text-only checkpoint (`Gemma3ForCausalLM`, the 1B's architecture: a text config, a
tokenizer, no vision tower) on the fast engine: greedy tokens equal the reference engine's (HF
`generate`) alone and batched, through the prefix cache; a request with images fails alone with
a clear error; the checkpoint is what `wicore make-model tiny-text` writes (seeded weights, saved with
`save_pretrained`), here with a 128-token sliding window so that prompts are cached block by block
(as test_chat_parity.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fast_requests import image, mismatches, one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import wicore
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.engines.options import FastOptions
from wicore.engines.reference import ReferenceEngine
from wicore.schemas import GenerationParams

pytestmark = pytest.mark.slow


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(words: str) -> dict:
    return {"type": "text", "text": words}


def requests() -> list[EngineRequest]:
    chats = {
        "plain": [{"role": "user", "content": "Tell me about red houses."}],
        "parts": user(text("Two"), text("parts.")),
        "system": [{"role": "system", "content": "Be brief."}, *user(text("What shapes exist?"))],
        "multi-turn": [
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Name a colour."},
        ],
    }
    return [EngineRequest(rid, chat, [], GenerationParams(max_new_tokens=12)) for rid, chat in chats.items()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from wicore.models.gemma3 import make_tiny_text

    return make_tiny_text(tmp_path_factory.mktemp("models") / "tiny-text-w128", sliding_window=128)


@pytest.fixture(scope="module")
def expected(model_dir):
    """Each request alone on the reference engine (HF `generate`, no padding)."""
    reference = ReferenceEngine(EngineConfig(str(model_dir)))
    done = {r.id: reference.generate([r])[0] for r in requests()}
    reference.close()
    return done


def test_make_model_writes_a_gemma3_text_only_checkpoint(tmp_path):
    wicore("make-model", "tiny-text", str(tmp_path / "tiny-text"))
    config = json.loads((tmp_path / "tiny-text" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "vision_config" not in config
    assert not (tmp_path / "tiny-text" / "processor_config.json").exists()
    assert (tmp_path / "tiny-text" / "model.safetensors").is_file()


def test_fast_matches_the_reference_alone_batched_and_cached(model_dir, expected):
    assert all(c.ok and c.token_ids for c in expected.values())
    options = FastOptions(block_size=4, paged_prefill_tokens=128, torch_threads=1)
    fast = FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=options))
    assert fast.pixel_spec() is None  # the worker decodes nothing for it
    for request in requests():
        assert mismatches(fast.generate([request]), [expected[request.id]]) == []
    again = fast.generate(requests())  # batched, the prompts' blocks cached by the first pass
    assert mismatches(again, list(expected.values())) == []
    stats = fast.stats()
    assert stats["images"] == 0 and stats["cached_prompt_tokens"] > 0
    fast.close()


def test_a_request_with_images_fails_alone(model_dir, expected):
    fast = FastEngine(EngineConfig(str(model_dir), max_batch_size=4, options=FastOptions(torch_threads=1)))
    pictured = EngineRequest("pictured", user({"type": "image"}, text("What?")), [image(1, 20, 20)], GenerationParams())
    done = {c.id: c for c in fast.generate([pictured, *requests()])}
    assert done["pictured"].input_error and "reads text only; the request has 1 images" in done["pictured"].error
    assert mismatches([done[r.id] for r in requests()], list(expected.values())) == []
    fast.close()


def test_wicore_caption_serves_it_and_fails_an_image_job_alone(model_dir, tmp_path):
    picture = sorted((Path(__file__).resolve().parents[1] / "examples" / "images").iterdir())[0]
    shutil.copy(picture, tmp_path / picture.name)
    lines = [
        {"prompt": "Name a colour.", "input": "text"},
        {"image": picture.name, "input": "picture"},
        {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                      {"role": "user", "content": "Again."}], "input": "turns"},
    ]  # fmt: skip
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    args = ("caption", str(manifest), "-o", str(out), "--model", str(model_dir), "--engine", "fast")
    done = wicore(*args, "--max-new-tokens", "6", env=env, check=False)
    assert done.returncode == 1, done.stderr  # one input failed
    by_input = {line["input"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert by_input["text"]["status"] == by_input["turns"]["status"] == "finished"
    assert by_input["text"]["output_tokens"] == 6 and by_input["text"]["engine"] == "fast"
    assert "this model reads text only; the request has 1 images" in by_input["picture"]["error"]
