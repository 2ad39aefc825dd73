"""Loading Gemma-3 into the fast engine's own buffers, one tensor at a time.

The modules are built on the meta device; then, layer by layer, each weight gets its final
buffer on the device, in the model dtype, and the source (`weight_sources`: a checkpoint's
safetensors or seeded weights) writes into it: q/k/v and gate/up straight into slices of
their fused buffers, nothing concatenated afterwards. With FP8 GEMMs each dense weight is
quantized as soon as it is complete (`fp8.quantize_in_blocks`) and its bf16 buffer freed, so
the model never exists in bf16 on the device. Peak memory during a load is so the loaded
model plus about one layer in the model dtype; `LoadMeter` measures it (CUDA's allocator) and
the load's seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from wicore.engines.checkpoint import check_model_dir, torch_dtype
from wicore.engines.fast.model import fp8
from wicore.engines.fast.model.text_decoder import DecoderLayer, TextDecoder
from wicore.engines.fast.model.vision_tower import ImageEncoder, SiglipLayer
from wicore.engines.fast.model.weight_sources import WeightSource, open_source
from wicore.engines.fast.model.weights import Gemma3Parts
from wicore.errors import ConfigError
from wicore.ops.fp8 import FP8Weight, fits, load_cuda_kernels

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class FP8Plan:
    """FP8 GEMMs (`gemm_dtype = "fp8"`): the dense weights quantized as they load;
    `vision_attention`: the tower's attention in e4m3 too."""

    vision_attention: bool = False


@dataclass
class LoadMeter:
    """Seconds of a load and, on CUDA, the allocator's peak above what was allocated before it
    (None on the CPU)."""

    device: torch.device
    seconds: float = 0.0
    peak_bytes: int | None = None

    def __enter__(self) -> LoadMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        self.seconds = time.perf_counter() - self._start


@torch.no_grad()
def load_gemma3(
    model_dir: str | Path, device: torch.device, dtype: str, seed: int = 0, fp8_plan: FP8Plan | None = None
) -> Gemma3Parts:
    """The model of `model_dir` on `device` in `dtype` (FP8 GEMMs with `fp8_plan`); its
    `report` holds what `stats` shows of the weights and their load."""
    from transformers import AutoConfig

    path = check_model_dir(model_dir)
    config = AutoConfig.from_pretrained(path)
    check_tied(config)
    with torch.device("meta"):
        encoder = ImageEncoder(config) if has_vision(config) else None
        decoder = TextDecoder(config.get_text_config())
    root = nn.ModuleDict({"decoder": decoder} if encoder is None else {"encoder": encoder, "decoder": decoder})
    expected = set(root.state_dict())
    bytes_in_dtype = meta_bytes(root, torch_dtype(dtype))
    source = open_source(path, config, expected, seed)
    try:
        check_names(expected, source.names())
        with LoadMeter(device) as meter:
            streamer = Streamer(source, device, torch_dtype(dtype), fp8_plan)
            streamer.load(encoder, decoder, root)
    finally:
        source.close()
    parts = Gemma3Parts(config, None if encoder is None else encoder.eval(), decoder.eval())
    parts.decoder.to_device(device)
    parts.report = load_report(parts, meter, streamer, bytes_in_dtype)
    return parts


def has_vision(config) -> bool:
    """Whether the checkpoint has a vision tower (`Gemma3ForConditionalGeneration`), not text only."""
    return getattr(config, "vision_config", None) is not None


def check_tied(config) -> None:
    text = config.get_text_config()
    if not getattr(config, "tie_word_embeddings", True) or not getattr(text, "tie_word_embeddings", True):
        raise ConfigError("only Gemma-3 checkpoints with a tied lm_head are supported")


def check_names(expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match Gemma-3: missing {missing[:5]}, unexpected {unexpected[:5]}")


def meta_bytes(root: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype`, from the meta modules' shapes (before load)."""
    return sum(p.numel() for p in root.parameters()) * dtype.itemsize


class Streamer:
    """Writes the source's tensors into the model's final buffers, layer by layer."""

    def __init__(self, source: WeightSource, device: torch.device, dtype: torch.dtype, plan: FP8Plan | None):
        self.source, self.device, self.dtype, self.plan = source, device, dtype, plan
        self.fp8 = fp8.FP8Report() if plan is not None else None
        if plan is not None and device.type == "cuda":
            load_cuda_kernels()  # the MLP quantizes GELU(gate) * up in one pass (ops.fp8.gated_gelu_linear)

    def load(self, encoder: ImageEncoder | None, decoder: TextDecoder, root: nn.Module) -> None:
        if encoder is not None:
            self.vision_tower(encoder.vision_tower)
        for index, layer in enumerate(decoder.layers):
            self.decoder_layer(layer, f"decoder.layers.{index}.")
        self.materialize(root, "")  # embeddings, final norms, the projector

    def vision_tower(self, tower) -> None:
        for index, layer in enumerate(tower.layers):
            tower.layers[index] = self.vision_layer(layer, index)
        if self.plan is not None:
            tower.patch_embedding.as_gemm = True  # bf16 still, a GEMM rather than cuDNN's slow conv

    def tensor(self, name: str, shape: torch.Size) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.source.copy_into(name, buffer)
        return buffer

    def materialize(self, module: nn.Module, prefix: str) -> None:
        """Every parameter of `module` still on the meta device, loaded."""
        for name, param in list(module.named_parameters()):
            if param.is_meta:
                owner, _, leaf = name.rpartition(".")
                weight = nn.Parameter(self.tensor(prefix + name, param.shape), requires_grad=False)
                setattr(module.get_submodule(owner), leaf, weight)

    def vision_layer(self, layer: SiglipLayer, index: int) -> nn.Module:
        self.materialize(layer, f"encoder.vision_tower.layers.{index}.")
        if self.fp8 is None or self.plan is None:
            return layer
        return fp8.quantize_vision_layer(layer, self.fp8, f"vision.{index}", fp8_attention=self.plan.vision_attention)

    def decoder_layer(self, layer: DecoderLayer, prefix: str) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = self.dense(self.fused(attention, ("q_proj", "k_proj", "v_proj"), prefix + "self_attn."), layer, "qkv")
        o = self.dense(self.fused(attention, ("o_proj",), prefix + "self_attn."), layer, "o")
        gate_up = self.dense(self.fused(mlp, ("gate_proj", "up_proj"), prefix + "mlp."), layer, "gate_up")
        down = self.dense(self.fused(mlp, ("down_proj",), prefix + "mlp."), layer, "down")
        layer.set_dense(qkv, o, gate_up, down)
        if self.fp8 is not None:
            fp8.drop_projections(layer)  # their weights live on only as FP8Weights
        self.materialize(layer, prefix)  # the norms

    def fused(self, owner: nn.Module, names: tuple[str, ...], prefix: str) -> torch.Tensor:
        """[sum of out, in]: the projections' weights written into one buffer's row slices; in
        the model dtype each projection keeps its slice as its weight (a view)."""
        linears = [getattr(owner, name) for name in names]
        rows = [linear.weight.shape[0] for linear in linears]
        fused = torch.empty(sum(rows), linears[0].weight.shape[1], dtype=self.dtype, device=self.device)
        for name, linear, part in zip(names, linears, fused.split(rows)):
            self.source.copy_into(f"{prefix}{name}.weight", part)
            if self.fp8 is None:
                linear.weight = nn.Parameter(part, requires_grad=False)
        return fused

    def dense(self, weight: torch.Tensor, layer: DecoderLayer, name: str) -> torch.Tensor | FP8Weight:
        """`weight` as the layer function takes it: in FP8 when asked and its dims allow."""
        if self.fp8 is None:
            return weight
        if not fits(*weight.shape):
            self.fp8.skipped.append(f"decoder.{layer.index}.{name}_weight")
            return weight
        self.fp8.quantized += 1
        return fp8.quantize_in_blocks(weight)


def load_report(parts: Gemma3Parts, meter: LoadMeter, streamer: Streamer, bytes_in_dtype: int) -> dict:
    """What `stats` reports of the weights: their bytes (FP8: the quantization's figures), the
    load's seconds and (CUDA) its peak; logged at INFO."""
    weight_bytes = fp8.weight_bytes(parts)
    report: dict = {
        "weight_bytes": weight_bytes,
        "load_s": round(meter.seconds, 3),
        "load_peak_bytes": meter.peak_bytes,
    }
    if streamer.fp8 is not None:
        streamer.fp8.bytes_before, streamer.fp8.bytes_after = bytes_in_dtype, weight_bytes
        report |= streamer.fp8.as_dict()
    peak = "not measured on the CPU" if meter.peak_bytes is None else f"{meter.peak_bytes / GIB:.2f} GiB"
    log.info("weights loaded: %.2f GiB in %.1f s; peak during load %s", weight_bytes / GIB, meter.seconds, peak)
    return report
