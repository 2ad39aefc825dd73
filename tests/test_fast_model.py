"""The fast engine's own Gemma-3 modules against transformers' on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fast_requests import image, one_torch_thread  # noqa: F401 (fixture)
from wicore.engines.checkpoint import load_hf_model, load_processor
from wicore.engines.fast.model.loader import load_gemma3
from wicore.engines.fast.model.weights import our_name
from wicore.engines.fast.model_runner import ModelRunner
from wicore.engines.fast.prompt_inputs import InputProcessor
from wicore.engines.fast.sampler import Sampler
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.errors import ConfigError, JobInputError
from wicore.ops.attention import pack_layout
from wicore.ops.image_preprocess import apply_lut


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, "cpu", "float32")


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return load_gemma3(tiny_model_dir, torch.device("cpu"), "float32")


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return load_processor(tiny_model_dir)


def chat(images, text="Describe this image in detail.", system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@torch.inference_mode()
def test_image_encoder_equals_transformers(hf, parts):
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    want = hf.model.get_image_features(pixels).pooler_output
    assert torch.equal(parts.encoder(pixels), want)


@pytest.mark.parametrize("images, system", [(0, None), (1, None), (2, "Be brief.")])
def test_prompt_ids_equal_the_processor(processor, parts, images, system):
    inputs = InputProcessor(processor, parts.image_token_id, parts.tokens_per_image)
    pictures = [image(i, 30 + 11 * i, 40) for i in range(images)]
    messages = chat(images, system=system)
    prompt = inputs.prompt(messages, images)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    want = processor(text=[text], images=[pictures] if images else None, add_special_tokens=False)
    assert prompt.ids == list(want["input_ids"][0])
    types = np.asarray(want["token_type_ids"][0]) if images else np.zeros(len(prompt.ids))
    assert sorted(prompt.image_starts) == [
        i for i in range(len(types)) if types[i] == 1 and (i == 0 or types[i - 1] != 1)
    ]
    if images:
        pixels = apply_lut(torch.from_numpy(inputs.resized(pictures)), torch.from_numpy(inputs.pixel_spec.lut))
        np.testing.assert_array_equal(pixels.numpy(), np.asarray(want["pixel_values"]))
    with pytest.raises(JobInputError):
        inputs.prompt(messages, images + 1)


@torch.inference_mode()
def test_prefill_logits_match_transformers_at_every_position(hf, parts, processor):
    messages = chat(2, "What is in these pictures?")
    pictures = [image(3, 50, 20), image(4, 20, 60)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    want = hf(**inputs).logits[0]  # [L, V]

    layout = KVLayout.build(parts.config.text_config, block_size=16, max_model_len=256)
    runner = ModelRunner(
        parts, layout, max_rows=1, sampler=Sampler(916, frozenset(), "cpu"), device="cpu", dtype=torch.float32
    )
    runner.allocate_cache(2)
    ids = inputs["input_ids"][0]
    n = ids.shape[0]
    groups = torch.full((1, n), -1)
    starts = InputProcessor(processor, parts.image_token_id, parts.tokens_per_image)._image_starts(ids.tolist(), 2)
    for i, start in enumerate(starts):
        groups[0, start : start + parts.tokens_per_image] = i
    image_rows = torch.cat([start + torch.arange(parts.tokens_per_image) for start in starts])
    got = runner.prefill_logits(
        ids=ids,
        positions=torch.arange(n),
        slots=torch.zeros(len(layout.groups), n, dtype=torch.long),
        image_rows=image_rows,
        image_groups=groups,
        last=torch.arange(n),
        layout=pack_layout([n], "cpu"),
        image_embeds=parts.encoder(inputs["pixel_values"]).flatten(0, 1),
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_checkpoint_names():
    assert our_name("language_model.model.layers.3.mlp.up_proj.weight") == "decoder.layers.3.mlp.up_proj.weight"
    assert our_name("model.language_model.norm.weight") == "decoder.norm.weight"
    assert our_name("vision_tower.vision_model.encoder.layers.0.layer_norm1.bias") == (
        "encoder.vision_tower.layers.0.layer_norm1.bias"
    )
    assert our_name("model.vision_tower.embeddings.patch_embedding.weight") == (
        "encoder.vision_tower.patch_embedding.weight"
    )
    assert our_name("multi_modal_projector.mm_input_projection_weight") == (
        "encoder.multi_modal_projector.mm_input_projection_weight"
    )
    assert our_name("lm_head.weight") is None
    with pytest.raises(ConfigError):
        our_name("something.else")
