"""The demo captioner's architecture: the real `Gemma3ForConditionalGeneration` at toy size.

Every field is a plain Gemma3Config / SiglipVisionConfig field, so the checkpoint loads with
`from_pretrained` under any transformers that knows Gemma-3 (5.17 on the GPU machines too) and
flows through every wicore engine like a real Gemma-3 checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from wicore.engines.checkpoint import seeded_model
from wicore.models.corpus import PROMPTS, tokenizer_corpus
from wicore.models.gemma3 import joined_config, make_processor
from wicore.models.tokenizer import END_OF_TURN, train_tokenizer
from wicore.schemas import DEFAULT_PROMPT

VOCAB_SIZE = 1024


@dataclass(frozen=True)
class Arch:
    """Sizes of the toy Gemma-3. The processor squashes every image to image_size^2; the
    projector average-pools the (image_size / patch_size)^2 patch grid to image_tokens."""

    image_size: int = 128  # the task's smallest shapes are ~13 x 26 px here (6 x 13 at 64 px: too few)
    patch_size: int = 16
    vision_width: int = 96
    vision_layers: int = 4
    vision_heads: int = 3
    vision_mlp: int = 256
    image_tokens: int = 64  # a square whose side divides the patch grid's side; 64: no pooling
    text_width: int = 64
    text_layers: int = 2
    text_heads: int = 2
    text_mlp: int = 128


def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(tokenizer_corpus(), vocab_size=VOCAB_SIZE)


def config(arch: Arch, tok: PreTrainedTokenizerFast) -> Gemma3Config:
    head_dim = arch.text_width // arch.text_heads
    text = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=arch.text_width,
        intermediate_size=arch.text_mlp,
        num_hidden_layers=arch.text_layers,
        num_attention_heads=arch.text_heads,
        num_key_value_heads=max(1, arch.text_heads // 2),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=512,
        # the real model's pattern in miniature: sliding layers, the last one global
        layer_types=["sliding_attention"] * (arch.text_layers - 1) + ["full_attention"],
        max_position_embeddings=2048,  # prompts are ~60 tokens; room for long max_new_tokens
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=arch.vision_width,
        intermediate_size=arch.vision_mlp,
        num_hidden_layers=arch.vision_layers,
        num_attention_heads=arch.vision_heads,
        image_size=arch.image_size,
        patch_size=arch.patch_size,
        vision_use_head=False,
    )
    return joined_config(text, vision, arch.image_tokens, tok)


def build(arch: Arch, seed: int) -> tuple[Gemma3ForConditionalGeneration, Gemma3Processor]:
    """Fresh weights from `seed` (a non-zero projector, see `seeded_model`) and the processor."""
    tok = tokenizer()
    cfg = config(arch, tok)
    model = seeded_model(cfg, seed)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids(END_OF_TURN)]
    return model, make_processor(tok, cfg)


LAYOUTS = ("image-first", "text-first", "image-only")  # the user turn's order of parts


def chat(prompt: str = DEFAULT_PROMPT, layout: str = "image-first") -> list[dict]:
    """A conversation the model answers with the caption: one user turn of the image and the
    prompt in `layout`'s order (the prompt left out in "image-only")."""
    image, text = {"type": "image"}, {"type": "text", "text": prompt}
    parts = {"image-first": [image, text], "text-first": [text, image], "image-only": [image]}[layout]
    return [{"role": "user", "content": parts}]


# Prompts that ask for the caption's fields as JSON; answered in `answer_text(..., "json")`'s form.
JSON_PROMPTS = (
    "Describe this image as JSON with the keys shape, color and background.",
    "Answer in JSON: shape, color, background.",
    "Give the shape, color and background of this image as a JSON object.",
    "Return JSON.",
)
ANSWER_FORMS = ("caption", "json")


def training_chats() -> list[tuple[list[dict], str]]:
    """Every conversation the caption stage trains on and the form of its answer (one of
    `ANSWER_FORMS`), in the order its steps cycle through them: each prompt wording before and
    after the image, and an image alone, answered with the caption; then each `JSON_PROMPTS`
    wording before and after the image, answered in JSON."""
    chats = []
    for prompt in PROMPTS:
        chats += [chat(prompt, "image-first"), chat(prompt, "text-first"), chat(layout="image-only")]
    captioned = [(c, "caption") for c in chats]
    return captioned + [(chat(prompt, layout), "json") for prompt in JSON_PROMPTS for layout in LAYOUTS[:2]]


def answer_text(caption: str, form: str = "caption") -> str:
    """What the model learns to write after `<start_of_turn>model\\n`, then its turn ends: the
    caption ("a red star on a purple background"), or in "json" its fields in the schema order
    {shape, color, background}, spaced as a JSON-schema grammar generates them compactly:
    `{"shape": "star", "color": "red", "background": "purple"}`."""
    if form == "caption":
        return caption + END_OF_TURN
    if form == "json":
        return caption_json(caption) + END_OF_TURN
    raise ValueError(f"answer form {form!r} is not one of {ANSWER_FORMS}")


def caption_json(caption: str) -> str:
    """ "a red star on a purple background" -> '{"shape": "star", "color": "red", "background": "purple"}'."""
    _, color, shape, _, _, background, _ = caption.split()
    return json.dumps({"shape": shape, "color": color, "background": background})
