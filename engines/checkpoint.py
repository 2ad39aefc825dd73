"""Loading a Gemma-3 checkpoint directory: processor, config, and the HF model (from its
safetensors, or seeded straight on the device for config-only directories)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from wicore.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEED_FILE = "wicore_init.json"


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def has_weights(model_dir: str | Path) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a model directory (no config.json)")
    if not has_weights(path) and not (path / SEED_FILE).is_file():
        raise ConfigError(f"{path} has no *.safetensors weights")
    return path


def load_processor(model_dir: str | Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def load_hf_model(model_dir: str | Path, device: str, dtype: str, seed: int = 0):
    """`Gemma3ForConditionalGeneration` in eval mode on `device`.

    A directory with safetensors loads through `from_pretrained` (offline, straight to the
    device). A config-only directory (`wicore make-model gemma3-4b`) gets seeded random weights
    created on the device: the same seed gives the same weights in every engine.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = check_model_dir(model_dir)
    if has_weights(path):
        # device_map would need accelerate; CPU -> device is one copy of the weights.
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype(dtype))
        return model.to(device).eval()
    from wicore.models.gemma3 import seeded_model

    seed = json.loads((path / SEED_FILE).read_text()).get("seed", seed)
    return seeded_model(AutoConfig.from_pretrained(path), seed, torch_dtype(dtype), device)
