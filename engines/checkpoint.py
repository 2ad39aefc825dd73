"""Loading a Gemma-3 checkpoint directory: processor, config, and the HF model (from its
safetensors, or seeded straight on the device for config-only directories).

Light to import (torch is imported where a model is loaded): the CLI checks a model directory
with `check_model_dir` before it starts anything slow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from wicore.errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
SEED_FILE = "wicore_init.json"


def torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def has_weights(model_dir: str | Path) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def check_model_dir(model_dir: str | Path, *, allow_random_weights: bool = True) -> Path:
    """The directory, if a model loads from it. A config-only directory (`wicore make-model
    gemma3-4b`) runs seeded random weights: its text is noise, so the CLI refuses it unless
    asked (`allow_random_weights=False` there; benchmarks pass True)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"--model {path}: no such directory (give a local Gemma-3 checkpoint folder)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path} is not a model directory (no config.json in it)")
    if not has_weights(path) and not (path / SEED_FILE).is_file():
        raise ConfigError(f"--model {path} has no *.safetensors weights")
    if not has_weights(path) and not allow_random_weights:
        raise ConfigError(
            f"--model {path} has a config but no weights (*.safetensors): it would run random weights and write "
            "noise; pass --allow-random-weights to run it anyway (benchmarks)"
        )
    return path


def max_positions(model_dir: str | Path) -> int:
    """The text model's position limit, from the checkpoint's config alone."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).text_config.max_position_embeddings


def load_processor(model_dir: str | Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def load_hf_model(model_dir: str | Path, device: str, dtype: str, seed: int = 0):
    """`Gemma3ForConditionalGeneration` in eval mode on `device`.

    A directory with safetensors loads through `from_pretrained` (offline, straight to the
    device). A config-only directory (`wicore make-model gemma3-4b`) gets seeded random weights
    (`seeded_weights`) drawn on the device: the same seed gives the same weights in every engine.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = check_model_dir(model_dir)
    if has_weights(path):
        # device_map would need accelerate; CPU -> device is one copy of the weights.
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype(dtype))
        return model.to(device).eval()
    config = AutoConfig.from_pretrained(path)
    return reseeded(seeded_model(config, 0, torch_dtype(dtype), device), config, config_seed(path, seed))


def config_seed(model_dir: str | Path, default: int = 0) -> int:
    """The weight seed a config-only directory names (`make-model --seed`)."""
    return json.loads((Path(model_dir) / SEED_FILE).read_text()).get("seed", default)


def reseeded(model, config, seed: int):
    """`model` (HF) with every weight overwritten in place by `seeded_weights`, as the fast
    engine's loader draws them."""
    from wicore.engines.seeded_weights import fill_seeded
    from wicore.engines.weight_names import our_name

    for name, param in model.named_parameters():
        ours = our_name(name)
        if ours is not None:
            fill_seeded(param.data, ours, seed, config)
    return model


def seeded_model(config, seed: int, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """`Gemma3ForConditionalGeneration` of `config` with random weights from `seed` (float32
    unless `dtype`), its projector non-zero (HF's init zeroes it)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma3ForConditionalGeneration._from_config(config, dtype=dtype or torch.float32)
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        projector.normal_(0.0, config.text_config.hidden_size**-0.5)
    return model.eval()
