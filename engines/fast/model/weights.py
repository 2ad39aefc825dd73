"""Build the `fast` engine's Gemma-3 modules on the meta device and load their weights straight
to the target device and dtype: from the checkpoint's safetensors, or, for a config-only
directory (`wicore make-model gemma3-4b`), by taking the tensors of the reference engine's
seeded HF model (shared, not copied) so that both engines run identical weights."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wicore.engines.checkpoint import check_model_dir, has_weights, load_hf_model, torch_dtype
from wicore.engines.fast.model.text_decoder import TextDecoder
from wicore.engines.fast.model.vision_tower import ImageEncoder
from wicore.errors import ConfigError

# Checkpoint / HF module names -> ours. Hub checkpoints, transformers 5 saves and the live HF
# module tree spell the same weights differently; all reduce to "<part>.<rest>".
_RENAMES = [
    (re.compile(r"^(model\.)?language_model\.(model\.)?"), "decoder."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?(embeddings\.|encoder\.)?"), "encoder.vision_tower."),
    (re.compile(r"^(model\.)?multi_modal_projector\."), "encoder.multi_modal_projector."),
]


@dataclass
class Gemma3Parts:
    config: Any  # transformers Gemma3Config
    encoder: ImageEncoder
    decoder: TextDecoder

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return self.config.mm_tokens_per_image


def our_name(name: str) -> str | None:
    """Our parameter name for a checkpoint key; None for the tied lm_head."""
    if name == "lm_head.weight":
        return None
    for pattern, prefix in _RENAMES:
        if pattern.match(name):
            return prefix + pattern.sub("", name, count=1)
    raise ConfigError(f"unexpected weight {name!r} in the checkpoint")


def load_gemma3(model_dir: str | Path, device: torch.device, dtype: str, seed: int = 0) -> Gemma3Parts:
    from transformers import AutoConfig

    path = check_model_dir(model_dir)
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "tie_word_embeddings", True) or not getattr(config.text_config, "tie_word_embeddings", True):
        raise ConfigError("only Gemma-3 checkpoints with a tied lm_head are supported")
    with torch.device("meta"):
        parts = torch.nn.ModuleDict({"encoder": ImageEncoder(config), "decoder": TextDecoder(config.text_config)})
    target = torch_dtype(dtype)
    if has_weights(path):
        tensors = _read_safetensors(path, device, target)
    else:
        hf = load_hf_model(path, device, dtype, seed)
        tensors = {name: t for name, t in hf.state_dict().items()}
    state = {}
    for name, tensor in tensors.items():
        ours = our_name(name)
        if ours is not None:
            state[ours] = tensor if tensor.dtype == target else tensor.to(target)
    _assign(parts, state)
    decoder = parts["decoder"]
    decoder.fuse_weights()  # after loading: the checkpoint names the separate projections
    decoder.to_device(device)
    return Gemma3Parts(config, parts["encoder"].eval(), decoder.eval())


def _read_safetensors(path: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt", device=str(device)) as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = reader.get_tensor(name).to(dtype)  # one tensor at a time on device
    return tensors


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match Gemma-3: missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, strict=True, assign=True)
    for param in module.parameters():
        param.requires_grad_(False)
