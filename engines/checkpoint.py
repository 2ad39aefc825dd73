"""Loading a checkpoint directory (Gemma-3, or any HF image-text-to-text / causal LM): processor,
config, and the HF model (from its safetensors, or seeded straight on the device for config-only
directories).

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

    return AutoConfig.from_pretrained(model_dir).get_text_config().max_position_embeddings


GEMMA3_TYPES = ("gemma3", "gemma3_text")  # Gemma3ForConditionalGeneration; Gemma3ForCausalLM (the 1B: text only)


def require_gemma3(model_dir: str | Path) -> None:
    """The fast engine runs Gemma-3 checkpoints, image-text (`Gemma3ForConditionalGeneration`)
    or text only (`Gemma3ForCausalLM`); any other is refused at start, pointing at the
    reference engine."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in GEMMA3_TYPES:
        names = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ConfigError(
            f"--model {model_dir}: the fast engine runs Gemma-3 checkpoints (Gemma3ForConditionalGeneration, "
            f"Gemma3ForCausalLM), not {names}; run it with --engine reference"
        )


def load_processor(model_dir: str | Path):
    """The checkpoint's processor for an image-text checkpoint, its tokenizer alone for a causal LM
    (whose tokenizer files may still name a multimodal processor class)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    if hasattr(AutoConfig.from_pretrained(model_dir), "vision_config"):
        return AutoProcessor.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def model_class(config):
    """The auto class a checkpoint of `config` loads through: image-text-to-text, else causal LM;
    a ConfigError naming the architecture when it is neither."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        if type(config) in auto._model_mapping:
            return auto
    names = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
    raise ConfigError(f"--model: {names} is neither an image-text-to-text nor a causal-LM checkpoint")


def load_hf_model(model_dir: str | Path, device: str, dtype: str, seed: int = 0):
    """The checkpoint's Hugging Face model (image-text-to-text or causal LM) in eval mode on `device`.

    A directory with safetensors loads through `from_pretrained` (offline, straight to the
    device). A config-only directory (`wicore make-model gemma3-4b`) gets seeded random weights
    (`seeded_weights`) drawn on the device: the same seed gives the same weights in every engine.
    """
    from transformers import AutoConfig

    path = check_model_dir(model_dir)
    config = AutoConfig.from_pretrained(path)
    if has_weights(path):
        # device_map would need accelerate; CPU -> device is one copy of the weights.
        model = model_class(config).from_pretrained(path, dtype=torch_dtype(dtype))
        return model.to(device).eval()
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
