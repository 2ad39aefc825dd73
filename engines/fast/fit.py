"""Whether the model fits the device, checked from its config before anything loads.

Needed: the weights in the chosen precision (FP8 GEMMs: one byte a dense weight plus a float32
scale a row), the smallest KV pool the engine starts with (one `max_model_len` sequence, as
`kv_budget.plan_pages` requires; `num_kv_blocks` when set), the activation headroom of a
full vision batch beside the larger of a full prefill and a max-batch decode, and the vision
cache's reserve. Available: the GPU's total x `gpu_memory_utilization` less what is in use
(the rule `plan_pages` sizes the pool by), or `memory_budget_bytes`. A model that does not
fit is refused in one line (`ModelDoesNotFit`, a ConfigError: exit 2) naming both figures
and what to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from wicore.engines.base import EngineConfig
from wicore.engines.checkpoint import torch_dtype
from wicore.engines.fast.model.loader import has_vision
from wicore.engines.fast.model.text_decoder import TextDecoder
from wicore.engines.fast.model.vision_tower import ImageEncoder
from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.options import ResolvedFastConfig
from wicore.errors import ConfigError
from wicore.ops.attention import KV_FP8
from wicore.ops.fp8 import fits

GIB = 2**30
FP8_SCALE_BYTES = 4  # a float32 scale per output row


class ModelDoesNotFit(ConfigError):
    """The model, its minimum KV pool and its work space need more device memory than there is."""


@dataclass(frozen=True)
class Needs:
    weights: int
    kv: int
    activations: int
    reserve: int  # the vision cache

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.reserve

    def describe(self) -> str:
        parts = (("weights", self.weights), ("KV", self.kv), ("activations", self.activations),
                 ("vision cache", self.reserve))  # fmt: skip
        return " + ".join(f"{name} {gib(size)}" for name, size in parts if size)


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def check_fit(config: EngineConfig, options: ResolvedFastConfig) -> None:
    """Raise ModelDoesNotFit unless the model fits (nothing checked on the CPU unless
    `memory_budget_bytes` is set)."""
    available = available_bytes(config.device, options)
    if available is None:
        return
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(config.model_dir)
    fp8 = config.options.gemm_dtype == "fp8"
    needs = model_needs(model_config, config, options, fp8)
    if needs.total > available.size:
        raise ModelDoesNotFit(refusal(model_config, config, options, needs, available, fp8))


@dataclass(frozen=True)
class Available:
    size: int
    how: str  # how `size` was reckoned, for the refusal


def available_bytes(device: str, options: ResolvedFastConfig) -> Available | None:
    if options.memory_budget_bytes is not None:
        return Available(options.memory_budget_bytes, "memory_budget_bytes")
    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    utilization = options.gpu_memory_utilization
    size = int(total * utilization - (total - free))
    return Available(size, f"{gib(total)} x gpu_memory_utilization {utilization} - {gib(total - free)} in use")


def model_needs(model_config, config: EngineConfig, options: ResolvedFastConfig, fp8: bool) -> Needs:
    itemsize = torch_dtype(config.dtype).itemsize
    return Needs(
        weights=weight_bytes(model_config, itemsize, fp8),
        kv=kv_bytes(model_config.get_text_config(), options, itemsize),
        activations=activation_bytes(model_config, options, config.max_batch_size, itemsize),
        reserve=options.vision_cache_bytes,
    )


def weight_bytes(model_config, itemsize: int, fp8: bool) -> int:
    """The loaded weights' bytes, from the modules' shapes on the meta device."""
    with torch.device("meta"):
        model = nn.ModuleDict({"d": TextDecoder(model_config.get_text_config())})
        if has_vision(model_config):
            model["e"] = ImageEncoder(model_config)
    total = sum(p.numel() for p in model.parameters()) * itemsize
    if not fp8:
        return total
    for rows, cols in dense_shapes(model_config):
        if fits(rows, cols):
            total -= rows * cols * (itemsize - 1) - rows * FP8_SCALE_BYTES
    return total


def dense_shapes(model_config) -> Iterator[tuple[int, int]]:
    """[out, in] of every GEMM weight FP8 quantizes (fused as the engine runs them)."""
    v, t = getattr(model_config, "vision_config", None), model_config.get_text_config()
    if v is not None:
        for _ in range(v.num_hidden_layers):
            h, inter = v.hidden_size, v.intermediate_size
            yield from ((3 * h, h), (h, h), (inter, h), (h, inter))
    for _ in range(t.num_hidden_layers):
        h, d, inter = t.hidden_size, t.head_dim, t.intermediate_size
        q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
        yield from ((q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter))


def kv_bytes(text_config, options: ResolvedFastConfig, itemsize: int) -> int:
    """The smallest pool the engine starts with: `num_kv_blocks` pages when set, else one
    `max_model_len` sequence (sliding layers keep their window's ring), plus the null page."""
    layout = KVLayout.build(text_config, options.block_size, options.max_model_len)
    dtype = KV_FP8 if options.kv_cache_dtype == "fp8" else {4: torch.float32, 2: torch.bfloat16}[itemsize]
    pages = options.num_kv_blocks or layout.pages_for(options.max_model_len)
    return (pages + 1) * layout.page_bytes(text_config.num_key_value_heads, text_config.head_dim, dtype)


def activation_bytes(model_config, options: ResolvedFastConfig, max_batch: int, itemsize: int) -> int:
    """Work space: a full vision batch (its widest tensors, twice, for a layer's in and out)
    beside the larger of a full packed prefill (q/k/v, gate/up and the residual stream per
    token) and a max-batch decode's float32 logits and sampling copies."""
    v, t = getattr(model_config, "vision_config", None), model_config.get_text_config()
    vision = 0 if v is None else vision_activation_bytes(v, options.vision_batch_size, itemsize)
    qkv = (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    prefill = options.max_prefill_tokens * (qkv + 3 * t.intermediate_size + 2 * t.hidden_size) * itemsize
    decode = 3 * max_batch * t.vocab_size * 4
    return vision + max(prefill, decode)


def vision_activation_bytes(v, batch: int, itemsize: int) -> int:
    patches = (v.image_size // v.patch_size) ** 2
    return 2 * batch * patches * (3 * v.hidden_size + v.intermediate_size) * itemsize


def refusal(model_config, config: EngineConfig, options, needs: Needs, available: Available, fp8: bool) -> str:
    """One line: what is needed, what there is, and what to change."""
    fixes = [] if fp8 else [f"--dtype fp8 (weights {gib(weight_bytes(model_config, 2, True))})"]
    fixes += [
        f"a lower max_model_len (now {options.max_model_len})",
        f"a lower --batch-size (now {config.max_batch_size})",
    ]
    fixes += ["a GPU with more memory"]
    return (
        f"the model does not fit: it needs {gib(needs.total)} ({needs.describe()}) but {gib(max(available.size, 0))} "
        f"is available ({available.how}); try {', '.join(fixes)}"
    )
