"""Checkpoint / HF module names -> the fast engine's parameter names.

Hub checkpoints, transformers 5 saves and the live HF module tree spell the same weights
differently; all reduce to "<part>.<rest>" with part `decoder` or `encoder` (none in a text-only
checkpoint). Seeded weights
(`seeded_weights`) are keyed by these names, so both engines draw the same tensor for a name.
"""

from __future__ import annotations

import re

from wicore.errors import ConfigError

_RENAMES = [
    (re.compile(r"^(model\.)?language_model\.(model\.)?"), "decoder."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?(embeddings\.|encoder\.)?"), "encoder.vision_tower."),
    (re.compile(r"^(model\.)?multi_modal_projector\."), "encoder.multi_modal_projector."),
    # a text-only checkpoint (Gemma3ForCausalLM): the decoder's parts straight under `model.`
    (re.compile(r"^model\.(?=(layers|embed_tokens|norm)\.)"), "decoder."),
]


def our_name(name: str) -> str | None:
    """Our parameter name for a checkpoint key; None for the tied lm_head."""
    if name == "lm_head.weight":
        return None
    for pattern, prefix in _RENAMES:
        if pattern.match(name):
            return prefix + pattern.sub("", name, count=1)
    raise ConfigError(f"unexpected weight {name!r} in the checkpoint")
