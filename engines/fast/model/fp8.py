"""FP8 GEMMs for the fast engine's Gemma-3 (`gemm_dtype = "fp8"`): the dense layers' weights
quantized once, after loading, to e4m3 with a float32 scale per output channel (`wicore.ops.fp8`),
and the originals freed.

Quantized: the vision tower's q/k/v (fused into one GEMM), out projection, fc1 and fc2; the
decoder's fused q/k/v, o, fused gate/up and down projections. Kept in the model dtype: the patch
embedding, the position and token embeddings (so the tied lm_head), every norm, the projector
and attention itself. A weight whose dims are not multiples of 16 (`_scaled_mm`'s alignment)
stays as it is and is named in the report.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch import nn

from wicore.engines.fast.model.text_decoder import DENSE_WEIGHTS, DecoderLayer, TextDecoder
from wicore.engines.fast.model.vision_tower import SiglipLayer, VisionTower
from wicore.engines.fast.model.weights import Gemma3Parts
from wicore.errors import ConfigError
from wicore.ops.fp8 import FP8Weight, fits, fp8_linear, quantize_weight, unsupported_reason

DECODER_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


class FP8Linear(nn.Module):
    """nn.Linear's forward over an e4m3 weight: buffers `weight` [N, K] e4m3, `scale` float32
    [1, N], `bias` [N] in the model dtype (or None)."""

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.data)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, FP8Weight(self.weight, self.scale), self.bias)


@dataclass
class FP8Report:
    """What `quantize` did: GEMM weights now in e4m3, the names of those left in the model
    dtype (dims not multiples of 16), and the bytes of every weight before and after."""

    quantized: int = 0
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def as_dict(self) -> dict:
        return {
            "fp8_linears": self.quantized,
            "fp8_skipped": self.skipped,
            "weight_bytes_before_fp8": self.bytes_before,
            "weight_bytes": self.bytes_after,
        }


def check_device(device: torch.device, dtype: str) -> None:
    """A one-line ConfigError unless `device` runs FP8 GEMMs around `dtype` activations."""
    reason = unsupported_reason(device)
    if reason is not None:
        raise ConfigError(
            f"FP8 GEMMs (--dtype fp8, engine option gemm_dtype=fp8) need an NVIDIA GPU of compute capability "
            f"8.9 or newer (Ada, Hopper) and {reason}: use --dtype bfloat16"
        )
    if dtype != "bfloat16":
        raise ConfigError(f"FP8 GEMMs run beside bfloat16 activations, not {dtype}: use --dtype fp8 (or bfloat16)")


@torch.no_grad()
def quantize(parts: Gemma3Parts) -> FP8Report:
    """Swap the dense layers of the loaded model for FP8 ones, in place, freeing the originals."""
    report = FP8Report(bytes_before=weight_bytes(parts))
    quantize_vision(parts.encoder.vision_tower, report)
    quantize_decoder(parts.decoder, report)
    report.bytes_after = weight_bytes(parts)
    gc.collect()  # a seeded HF model that lent its tensors (config-only checkpoints) may sit in a cycle
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the freed weights back, so the KV budget sees them
    return report


def quantize_vision(tower: VisionTower, report: FP8Report) -> None:
    for index, layer in enumerate(tower.layers):
        quantize_vision_layer(layer, report, f"vision.{index}")


def quantize_vision_layer(layer: SiglipLayer, report: FP8Report, where: str, rowwise: bool = True) -> None:
    """rowwise=False: one scale per weight and per activation tensor (`wicore bench fp8-layers`
    measures both; the engine runs rowwise)."""
    _swap(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", report, where, rowwise)
    _swap(layer.self_attn, ("out_proj",), "out_proj", report, where, rowwise)
    _swap(layer.mlp, ("fc1",), "fc1", report, where, rowwise)
    _swap(layer.mlp, ("fc2",), "fc2", report, where, rowwise)


def _swap(owner: nn.Module, names: tuple[str, ...], into: str, report: FP8Report, where: str, rowwise: bool) -> None:
    """Replace the nn.Linear modules `names` of `owner` with one FP8Linear `into` whose output
    stacks theirs; left alone when the stacked weight does not fit the FP8 GEMM."""
    linears = [getattr(owner, name) for name in names]
    weight = torch.cat([linear.weight for linear in linears])
    if not fits(*weight.shape):
        report.skipped.append(f"{where}.{into}")
        return
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    for name in names:
        delattr(owner, name)
    setattr(owner, into, FP8Linear(quantize_weight(weight, rowwise), bias))
    report.quantized += 1


def quantize_decoder(decoder: TextDecoder, report: FP8Report) -> None:
    """Each layer's fused dense weights (`DecoderLayer.fuse_weights`) become FP8Weights; the
    projection modules, which only held views of them, go (the layer functions read the
    layer's attributes alone)."""
    for layer in decoder.layers:
        quantize_decoder_layer(layer, report)


def quantize_decoder_layer(layer: DecoderLayer, report: FP8Report, rowwise: bool = True) -> None:
    for name in DENSE_WEIGHTS:
        weight = getattr(layer, name)
        if fits(*weight.shape):
            setattr(layer, name, quantize_weight(weight, rowwise))
            report.quantized += 1
        else:
            report.skipped.append(f"decoder.{layer.index}.{name}")
    _drop_projections(layer)


def _drop_projections(layer: DecoderLayer) -> None:
    for child, names in DECODER_PROJECTIONS.items():
        module = getattr(layer, child)
        for name in names:
            delattr(module, name)


def weight_bytes(parts: Gemma3Parts) -> int:
    """Bytes of every weight the model holds, each storage once (fused weights and their views
    share one)."""
    tensors = [*parts.encoder.parameters(), *parts.encoder.buffers(), *parts.decoder.parameters()]
    tensors += list(parts.decoder.buffers())
    for layer in parts.decoder.layers:
        for name in DENSE_WEIGHTS:
            weight = getattr(layer, name)
            tensors += list(weight) if isinstance(weight, FP8Weight) else [weight]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
