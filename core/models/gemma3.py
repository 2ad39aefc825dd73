"""Gemma-3 checkpoint directories built here: configs, seeded weights, a local tokenizer.

`make_tiny` writes a complete checkpoint (safetensors + config + processor) of the real
`Gemma3ForConditionalGeneration` architecture at toy size, loadable offline with
`from_pretrained` exactly as a user's own Gemma-3 directory; `make_tiny_text` its text half as
`Gemma3ForCausalLM` (the 1B's architecture: a text config, a tokenizer, no vision tower). `make_seeded` writes the real
config of Gemma-3-4B, 12B or 27B (`SEEDED_PRESETS`) and a processor; their weights are drawn at
load time (`wicore.engines.seeded_weights`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from transformers import (
    Gemma3Config,
    Gemma3Processor,
    Gemma3TextConfig,
    SiglipVisionConfig,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from wicore.engines.checkpoint import SEED_FILE, seeded_model
from wicore.errors import ConfigError
from wicore.models.corpus import tokenizer_corpus
from wicore.models.tokenizer import BOI, EOI, IMAGE_SOFT, train_tokenizer


def tiny_config(tokenizer, *, sliding_window: int = 16, image_size: int = 64) -> Gemma3Config:
    """2 text layers (one sliding, one full), hidden 64, SigLIP 64 px / patch 8 -> 16 image tokens."""
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
        vision_use_head=False,
    )
    return joined_config(text, vision, 16, tokenizer)


def joined_config(text, vision, image_tokens: int, tokenizer) -> Gemma3Config:
    """The multimodal config of `text` + `vision`, its image specials at the trained tokenizer's ids."""
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=image_tokens,
        boi_token_index=tokenizer.convert_tokens_to_ids(BOI),
        eoi_token_index=tokenizer.convert_tokens_to_ids(EOI),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_SOFT),
    )


# The text models' shapes, as transformers' conversion script and the hub configs write them;
# the rest (vocabulary, RoPE, sliding window 1024 in 5 of 6 layers, SigLIP) is the family's.
TEXT_SHAPES = {
    "gemma3-4b": dict(
        hidden_size=2560, intermediate_size=10_240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
    ),
    "gemma3-12b": dict(
        hidden_size=3840, intermediate_size=15_360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    ),
    "gemma3-27b": dict(
        hidden_size=5376, intermediate_size=21_504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
    ),
}  # fmt: skip
SEEDED_PRESETS = tuple(TEXT_SHAPES)
SHARD_BYTES = 5 * 2**30  # safetensors shards of seeded weights, as transformers' save_pretrained


def gemma3_config(preset: str) -> Gemma3Config:
    """A Gemma-3 family member's real config (`SEEDED_PRESETS`)."""
    if preset not in TEXT_SHAPES:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(SEEDED_PRESETS)}")
    text = Gemma3TextConfig(
        vocab_size=262_208,
        sliding_window=1024,
        max_position_embeddings=131_072,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        },
        **TEXT_SHAPES[preset],
    )
    vision = SiglipVisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    )
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256)


def gemma3_4b_config() -> Gemma3Config:
    return gemma3_config("gemma3-4b")


def make_processor(tokenizer, config: Gemma3Config) -> Gemma3Processor:
    size = config.vision_config.image_size
    image_processor = Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=config.mm_tokens_per_image,
    )


def make_tiny(out_dir: str | Path, *, seed: int = 0, sliding_window: int = 16) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=1024)
    config = tiny_config(tokenizer, sliding_window=sliding_window)
    seeded_model(config, seed).save_pretrained(out)
    make_processor(tokenizer, config).save_pretrained(out)
    return out


def make_tiny_text(out_dir: str | Path, *, seed: int = 0, sliding_window: int = 16) -> Path:
    """`make_tiny`'s text config as a `Gemma3ForCausalLM` with seeded weights, and its tokenizer
    (chat template inside) alone."""
    import torch
    from transformers import Gemma3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=1024)
    torch.manual_seed(seed)
    Gemma3ForCausalLM(tiny_config(tokenizer, sliding_window=sliding_window).text_config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_seeded(out_dir: str | Path, preset: str, *, seed: int = 0, weights: bool = False) -> Path:
    """Config + processor of a Gemma-3 family member (`SEEDED_PRESETS`); weights are seeded at
    load time (`wicore.engines.seeded_weights`), or, with `weights`, written now as bf16
    safetensors shards (`write_seeded_weights`: a checkpoint read from disk as a user's is).

    The tokenizer is ours (trained locally) with its special tokens placed at Gemma-3's ids, so
    prompts expand to the real image-token layout (boi 255999, 256 x 262144, eoi 256000).
    """
    config = gemma3_config(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=2048)
    tokenizer = _place_specials_like_gemma3(tokenizer, config)
    config.save_pretrained(out)
    make_processor(tokenizer, config).save_pretrained(out)
    if weights:
        write_seeded_weights(out, config, seed)
    else:
        (out / SEED_FILE).write_text(json.dumps({"seed": seed}))
    return out


def write_seeded_weights(out: Path, config: Gemma3Config, seed: int, shard_bytes: int = SHARD_BYTES) -> None:
    """The seeded weights (drawn on the CPU) as bf16 safetensors shards of at most `shard_bytes`
    under transformers' names, with their index: one shard's tensors in memory at a time."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict = {}
    index = total = 0
    for name, tensor in _seeded_tensors(config, seed):
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > shard_bytes:
            save_file(shard, out / _shard_name(index), metadata={"format": "pt"})
            shard, index = {}, index + 1
        shard[name], weight_map[name] = tensor, _shard_name(index)
        total += tensor.nbytes
    save_file(shard, out / _shard_name(index), metadata={"format": "pt"})
    manifest = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(manifest, indent=2))


def _seeded_tensors(config: Gemma3Config, seed: int) -> Iterator:
    """(transformers' name, bf16 tensor) of every weight but the tied lm_head, one at a time."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    from wicore.engines.seeded_weights import fill_seeded
    from wicore.engines.weight_names import our_name

    with torch.device("meta"):
        shapes = [(n, p.shape) for n, p in Gemma3ForConditionalGeneration(config).named_parameters()]
    for name, shape in shapes:
        if (ours := our_name(name)) is not None:
            tensor = torch.empty(shape, dtype=torch.bfloat16)
            fill_seeded(tensor, ours, seed, config)
            yield name, tensor


def _shard_name(index: int) -> str:
    return f"model-{index + 1:05d}.safetensors"


def make_gemma3_4b(out_dir: str | Path, *, seed: int = 0) -> Path:
    return make_seeded(out_dir, "gemma3-4b", seed=seed)


def _place_specials_like_gemma3(tokenizer, config: Gemma3Config):
    """Re-number a small trained vocab into Gemma-3's 262,208-id space.

    Specials go to Gemma-3's ids, every other trained token keeps its relative order after
    them, and the gaps are filled with `<unused_N>` tokens that never occur in text.
    """
    from tokenizers import Tokenizer

    from wicore.models.tokenizer import SPECIAL_TOKENS, wrap_tokenizer

    fixed = {
        "<pad>": 0,
        "<eos>": 1,
        "<bos>": 2,
        "<unk>": 3,
        "<mask>": 4,
        "<start_of_turn>": 105,
        "<end_of_turn>": 106,
        BOI: config.boi_token_index,
        EOI: config.eoi_token_index,
        IMAGE_SOFT: config.image_token_index,
    }
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    ordinary = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIAL_TOKENS]
    taken = set(fixed.values())
    free_ids = (i for i in range(config.text_config.vocab_size) if i not in taken)
    new_vocab = dict(fixed)
    for token in ordinary:
        new_vocab[token] = next(free_ids)
    for n, i in enumerate(free_ids):
        new_vocab[f"<unused_{n}>"] = i
    state["model"]["vocab"] = new_vocab
    for added in state["added_tokens"]:
        added["id"] = new_vocab[added["content"]]
    return wrap_tokenizer(Tokenizer.from_str(json.dumps(state)))
