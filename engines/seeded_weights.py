"""Seeded random weights for config-only checkpoints (`wicore make-model gemma3-27b`): each
tensor a pure function of (seed, its name, its shape), drawn straight into the buffer that
keeps it, in row blocks of at most `BLOCK_BYTES` of float32. A loader can so make one tensor
at a time on the device (never the whole model twice), and the reference engine's HF model
and the fast engine's fused buffers get the same values.

Values: biases 0, the vision tower's LayerNorm weights 1, Gemma's RMSNorm weights 0 (they
scale by 1 + w), the projector N(0, text_hidden^-1/2), everything else N(0, initializer_range).
"""

from __future__ import annotations

import hashlib

import torch

BLOCK_BYTES = 64 * 2**20  # float32 scratch per draw


def seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, stable across processes and platforms."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def fill_seeded(dst: torch.Tensor, name: str, seed: int, config) -> None:
    """Write the seeded values of weight `name` (our naming, `weight_names.our_name`) into `dst`."""
    std = _std(name, config)
    if std is None:
        dst.fill_(_constant(name))
        return
    generator = torch.Generator(device=dst.device).manual_seed(seed_for(seed, name))
    rows = dst.reshape(dst.shape[0], -1) if dst.dim() > 1 else dst.reshape(1, -1)
    step = max(1, BLOCK_BYTES // (4 * rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        block = torch.empty(rows[start : start + step].shape, dtype=torch.float32, device=dst.device)
        rows[start : start + step].copy_(block.normal_(0.0, std, generator=generator))


def _std(name: str, config) -> float | None:
    """The normal's standard deviation for `name`; None: a constant (`_constant`)."""
    leaf = name.rsplit(".", 2)
    if name.endswith(".bias") or "norm" in leaf[-2]:
        return None
    text = config.get_text_config()
    if name.endswith("mm_input_projection_weight"):
        return text.hidden_size**-0.5
    return text.initializer_range


def _constant(name: str) -> float:
    vision_layer_norm = name.startswith("encoder.vision_tower.") and name.endswith(".weight")
    return 1.0 if vision_layer_norm else 0.0
