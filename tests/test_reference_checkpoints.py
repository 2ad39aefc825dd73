"""Checkpoints the fast engine does not run: the reference engine serves them exactly as the
standard Hugging Face call does (`processor.apply_chat_template(..., tokenize=True)` then greedy
`generate`: equal tokens), or refuses them at start with one line (exit 2). The fast engine
refuses every non-Gemma-3 checkpoint at start (exit 2), never as a bug (exit 70); Gemma-3 text-only
checkpoints run on it (tests/test_fast_text_only.py).

Tiny checkpoints built here from configs: a LLaVA (Llama text, CLIP vision) whose chat template
writes no <bos> and whose tokenizer adds it, a Gemma-3 text-only `Gemma3ForCausalLM`, and a
causal LM without a chat template.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fast_requests import image, one_torch_thread  # noqa: F401 (fixture)
from tests.helpers import wicore
from wicore.engines.base import EngineConfig, EngineRequest
from wicore.engines.fast import FastEngine
from wicore.engines.reference import ReferenceEngine
from wicore.errors import ConfigError
from wicore.schemas import GenerationParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m.role | upper }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>\n{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def special_tokenizer(image_token: str | None = None):
    """The tiny BPE wrapped with <bos> added on encode, and `image_token` as a special token."""
    from transformers import PreTrainedTokenizerFast

    from wicore.models.corpus import tokenizer_corpus
    from wicore.models.tokenizer import train_tokenizer

    base = train_tokenizer(tokenizer_corpus(), vocab_size=600)
    extra = {"extra_special_tokens": {"image_token": image_token}} if image_token else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>", add_bos_token=True, **extra,
    )  # fmt: skip
    if image_token:
        tokenizer.add_special_tokens({"additional_special_tokens": [image_token]})
    return tokenizer


def llama_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = special_tokenizer("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = LlavaConfig(
        text_config=llama_config(tokenizer),
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "llava"
    LlavaForConditionalGeneration(config).eval().save_pretrained(out)
    pictures = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=pictures, tokenizer=tokenizer, chat_template=LLAVA_TEMPLATE, patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma3_text_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Gemma-3's text half as `Gemma3ForCausalLM` (what the 1B checkpoint is), its tokenizer alone."""
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForCausalLM

    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("models") / "gemma3-text"
    Gemma3ForCausalLM(AutoConfig.from_pretrained(tiny_model_dir).text_config).eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    tokenizer = special_tokenizer()
    out = tmp_path_factory.mktemp("models") / "no-template"
    LlamaForCausalLM(llama_config(tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_standard(model_dir: Path, chat: list[dict], pictures: list) -> list[int]:
    """Tokens of the standard HF call: the checkpoint's processor and template, greedy generate."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    multimodal = hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")
    processor = (AutoProcessor if multimodal else AutoTokenizer).from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).eval()
    filled = iter(pictures)
    messages = [
        {**m, "content": [{**p, "image": next(filled)} if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in chat
    ]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def user(*parts) -> list[dict]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def run(engine, chat: list[dict], pictures: list):
    params = GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    [done] = engine.generate([EngineRequest("r", chat, pictures, params)])
    assert done.ok, done.error
    return done


@pytest.mark.parametrize(
    "chat, images",
    [
        (user(None, "What is it?"), 1),
        (user("Compare", None, "with", None), 2),
        (user("Just text."), 0),
        (
            [
                *user("Hi."),
                {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                *user(None, "This?"),
            ],
            1,
        ),
    ],
)
def test_llava_tokens_equal_the_standard_hf_call(llava_dir, chat, images):
    pictures = [image(40 + i, 30 + 7 * i, 26) for i in range(images)]
    done = run(ReferenceEngine(EngineConfig(str(llava_dir))), chat, pictures)
    assert done.token_ids == hf_standard(llava_dir, chat, pictures)


def test_the_bos_the_tokenizer_adds_is_kept(llava_dir):
    engine = ReferenceEngine(EngineConfig(str(llava_dir)))
    text = engine.inputs.text(user("Hi."), 0)
    ids = engine.inputs.encode([text], [[]])["input_ids"][0].tolist()
    assert not text.startswith("<bos>") and ids[0] == engine.tokenizer.bos_token_id and ids.count(ids[0]) == 1


def test_gemma3_text_only_checkpoint_on_the_reference_engine(gemma3_text_dir):
    engine = ReferenceEngine(EngineConfig(str(gemma3_text_dir)))
    chat = [{"role": "system", "content": "Be brief."}, *user("Tell me about red houses.")]
    assert run(engine, chat, []).token_ids == hf_standard(gemma3_text_dir, chat, [])
    [refused] = engine.generate([EngineRequest("i", user(None, "x"), [image(1, 20, 20)], GenerationParams())])
    assert refused.input_error and "reads text only" in refused.error


def test_refusals_at_start(llava_dir, no_template_dir):
    with pytest.raises(ConfigError, match="no chat template"):
        ReferenceEngine(EngineConfig(str(no_template_dir)))
    with pytest.raises(ConfigError, match="the fast engine runs Gemma-3 checkpoints"):
        FastEngine(EngineConfig(str(llava_dir)))


def test_the_worker_exits_2_with_one_line(llava_dir, no_template_dir, redis_url):
    for engine, model_dir, says in (
        ("fast", llava_dir, "LlavaForConditionalGeneration; run it with --engine reference"),
        ("reference", no_template_dir, "no chat template"),
    ):
        args = ("--engine", engine, "--model", str(model_dir), "--redis-url", redis_url, "--burst")
        done = wicore("worker", *args, check=False, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
