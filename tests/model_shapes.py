"""Checkpoint directories of other Gemma-3 shapes at toy size, made from the tiny checkpoint
(its tokenizer, processor and vision tower): the text model reshaped as 12B's or 27B's ratios
(heads to KV heads, head_dim against hidden, query_pre_attn_scalar), or a mid-size one whose
layers outweigh everything else (the load-peak tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig

from wicore.engines.checkpoint import SEED_FILE, seeded_model

SLIDING, FULL = "sliding_attention", "full_attention"
FIVE_TO_ONE = [SLIDING] * 5 + [FULL]  # Gemma-3's pattern: 5 sliding layers, then a full one

# 12B: 16 / 8 heads of 256 (heads x head_dim 4096 > hidden 3840), query_pre_attn_scalar = head_dim.
LIKE_12B = dict(
    hidden_size=96, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, query_pre_attn_scalar=32, layer_types=FIVE_TO_ONE,
)  # fmt: skip
# 27B: 32 / 16 heads of 128 (heads x head_dim 4096 < hidden 5376), query_pre_attn_scalar =
# hidden / heads = 168, not head_dim.
LIKE_27B = dict(
    hidden_size=96, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, query_pre_attn_scalar=24, layer_types=FIVE_TO_ONE,
)  # fmt: skip
MID_SIZE = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
    head_dim=128, query_pre_attn_scalar=128, layer_types=[SLIDING, SLIDING, FULL],
)  # fmt: skip


def reshaped(tiny_dir: Path, out: Path, text: dict, *, weights: bool, dtype=torch.float32, seed: int = 0) -> Path:
    """A copy of the tiny checkpoint with its text config changed by `text`: with seeded
    safetensors (`weights`, saved in `dtype`) or config-only (weights drawn at load)."""
    shutil.copytree(tiny_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = AutoConfig.from_pretrained(tiny_dir)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    if weights:
        seeded_model(config, seed, dtype).save_pretrained(out)
    else:
        config.save_pretrained(out)
        (out / SEED_FILE).write_text(json.dumps({"seed": seed}))
    return out
