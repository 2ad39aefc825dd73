"""FP8 GEMMs for the fast engine's Gemma-3 (`gemm_dtype = "fp8"`): the dense layers' weights
quantized once, after loading, to e4m3 with a float32 scale per output channel (`wicore.ops.fp8`),
and the originals freed.

Quantized: the vision tower's q/k/v (fused into one GEMM), out projection, fc1 and fc2; the
decoder's fused q/k/v, o, fused gate/up and down projections. The GELU before fc2 and before
the decoder's down projection is computed in the pass that quantizes that GEMM's input
(ops/fp8_triton.py on CUDA), and so are the tower's LayerNorms, each with the residual add
before it (FP8SiglipLayer). Kept in the model dtype: the patch
embedding, the position and token embeddings (so the tied lm_head), every norm, the projector
and attention itself, except the tower's with `vision_attention_dtype = "fp8"` (cuDNN's FP8
attention, ops/fp8_attention.py). A weight whose dims are not multiples of 16 (`_scaled_mm`'s
alignment) stays as it is and is named in the report.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from wicore.engines.fast.model.text_decoder import DENSE_WEIGHTS, DecoderLayer, TextDecoder
from wicore.engines.fast.model.vision_tower import SiglipLayer, VisionTower
from wicore.engines.fast.model.weights import Gemma3Parts
from wicore.errors import ConfigError
from wicore.ops.fp8 import (
    FP8Weight,
    add_layer_norm_quantize,
    bias_gelu_quantize,
    fits,
    fp8_linear,
    load_cuda_kernels,
    quantize_weight,
    scaled_mm,
    unsupported_reason,
)
from wicore.ops.fp8 import quantize as quantize_rows
from wicore.ops.fp8_attention import fp8_attention as attend_fp8
from wicore.ops.fp8_attention import load_cuda_kernels as load_attention_kernels
from wicore.ops.fp8_attention import new_seen
from wicore.ops.fp8_attention import prepare as prepare_fp8_attention
from wicore.ops.fp8_attention import unsupported_reason as attention_unsupported_reason
from wicore.ops.fp8_format import E4M3

log = logging.getLogger(__name__)
BLOCK_BYTES = 64 * 2**20  # float32 scratch of a rowwise quantization (`quantize_in_blocks`)
BLOCKS_PER_WEIGHT = 32  # at least: the scratch stays a small share of the weight itself

DECODER_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


class FP8Linear(nn.Module):
    """nn.Linear's forward over an e4m3 weight: buffers `weight` [N, K] e4m3, `scale` float32
    [1, N], `bias` [N] in the model dtype (or None), added in the scaled matmul's epilogue (the
    vision tower's row counts, multiples of an image's patches, have such kernels)."""

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight.data)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("bias", bias)

    @property
    def fp8(self) -> FP8Weight:
        return FP8Weight(self.weight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8, self.bias, bias_in_epilogue=True)


class FP8GeluMLP(nn.Module):
    """SigLIP's MLP, fc2(GELU-tanh(fc1(x))), over two rowwise FP8Linears, with fc1's bias and the
    GELU done in the pass that quantizes fc2's input (`bias_gelu_quantize`): the [tokens,
    intermediate] activations are read once, as the GEMM wrote them, and written once in e4m3."""

    def __init__(self, fc1: FP8Linear, fc2: FP8Linear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2
        if fc1.weight.is_cuda:
            load_cuda_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_quantized(*quantize_rows(x.reshape(-1, x.shape[-1])), x.shape, x.dtype)

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, shape: torch.Size, dtype) -> torch.Tensor:
        """The MLP of an input already quantized per row (e4m3 [M, hidden], scale [M, 1]) whose
        shape was `shape` [..., hidden]: [..., hidden] out, in `dtype`."""
        fc1, fc2 = self.fc1, self.fc2
        h = scaled_mm(x_q, x_scale, fc1.fp8, None, dtype, True)  # its bias goes to the GELU
        a_q, a_scale = bias_gelu_quantize(h, fc1.bias)
        out = scaled_mm(a_q, a_scale, fc2.fp8, fc2.bias, dtype, True, bias_in_epilogue=True)
        return out.reshape(*shape[:-1], out.shape[-1])


class FP8SiglipLayer(nn.Module):
    """A SigLIP layer over rowwise FP8 GEMMs (fused q/k/v, an FP8GeluMLP) whose LayerNorms are
    computed in the pass that quantizes the next GEMM's input, with the residual add before
    each (`add_layer_norm_quantize`): the attention output is added in the second norm's pass,
    and the MLP's output is left pending for the next layer's first norm (`forward_residual`).
    The same arithmetic as the SigLIP layer over the same FP8 modules. `fp8_attention`: the
    attention itself in e4m3 too (ops/fp8_attention.py), its output already quantized per row
    for the out projection, scaled by the largest q, k and v of the layer's earlier calls (buffer
    `attention_seen`; `forget_attention_scales` after a warm-up on made-up images)."""

    def __init__(self, layer: SiglipLayer, fp8_attention: bool = False):
        super().__init__()
        self.layer_norm1, self.self_attn = layer.layer_norm1, layer.self_attn
        self.layer_norm2, self.mlp = layer.layer_norm2, layer.mlp
        self.fp8_attention = fp8_attention
        if fp8_attention:
            with torch.inference_mode(False):  # updated in place under inference mode and outside it
                self.register_buffer("attention_seen", new_seen(layer.layer_norm1.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, pending = self.forward_residual(x, None)
        return x + pending

    def forward_residual(self, x: torch.Tensor, pending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        attention, qkv_proj = self.self_attn, self.self_attn.qkv_proj
        x, x_q, x_scale = add_layer_norm_quantize(x, pending, self.layer_norm1)
        qkv = scaled_mm(x_q, x_scale, qkv_proj.fp8, qkv_proj.bias, x.dtype, True, bias_in_epilogue=True)
        if self.fp8_attention:
            o_q, o_scale = attend_fp8(qkv, x.shape[0], attention.heads, attention.head_dim, self.attention_seen)
            out_proj = attention.out_proj
            h = scaled_mm(o_q, o_scale, out_proj.fp8, out_proj.bias, x.dtype, True, bias_in_epilogue=True).view(x.shape)
        else:
            h = attention.attend(*qkv.view(*x.shape[:-1], qkv.shape[-1]).chunk(3, dim=-1))
        x, h_q, h_scale = add_layer_norm_quantize(x, h, self.layer_norm2)
        return x, self.mlp.forward_quantized(h_q, h_scale, x.shape, x.dtype)


@dataclass
class FP8Report:
    """What `quantize` did: GEMM weights now in e4m3, vision layers whose attention runs in e4m3,
    the names of weights left in the model dtype (dims not multiples of 16), and the bytes of
    every weight before and after."""

    quantized: int = 0
    attention_layers: int = 0  # vision layers whose attention runs in FP8
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def as_dict(self) -> dict:
        return {
            "fp8_linears": self.quantized,
            "fp8_attention_layers": self.attention_layers,
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


def check_kv_device(device: torch.device) -> None:
    """A one-line ConfigError unless `device` reads an FP8 KV cache: any CPU (the reference
    attention casts), a GPU whose Triton converts e4m3 (compute capability 8.9+)."""
    reason = unsupported_reason(device) if device.type == "cuda" else None
    if reason is not None:
        raise ConfigError(
            f"an FP8 KV cache (engine option kv_cache_dtype=fp8) needs an NVIDIA GPU of compute capability 8.9 or "
            f"newer (Ada, Hopper) and {reason}: use kv_cache_dtype=model"
        )


def check_attention_device(device: torch.device) -> None:
    """A one-line ConfigError unless `device` runs the tower's attention in FP8."""
    reason = attention_unsupported_reason(device)
    if reason is not None:
        raise ConfigError(
            f"FP8 vision attention (engine option vision_attention_dtype=fp8) cannot run: {reason}; "
            "use vision_attention_dtype=model"
        )


@torch.no_grad()
def quantize(parts: Gemma3Parts, fp8_attention: bool = False) -> FP8Report:
    """Swap the dense layers of the loaded model for FP8 ones, in place, freeing the originals.
    `fp8_attention`: the vision tower's attention in e4m3 too."""
    report = FP8Report(bytes_before=weight_bytes(parts))
    quantize_vision(parts.encoder.vision_tower, report, fp8_attention)
    quantize_decoder(parts.decoder, report)
    report.bytes_after = weight_bytes(parts)
    gc.collect()  # a seeded HF model that lent its tensors (config-only checkpoints) may sit in a cycle
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the freed weights back, so the KV budget sees them
    return report


def prepare_attention(tower: VisionTower, max_batch: int) -> None:
    """Build the FP8 attention's cuDNN plans for vision batches of 1 to `max_batch` images now
    (CUDA, layers with `fp8_attention`), not inside the first batch of each size."""
    layer = tower.layers[0]
    if not getattr(layer, "fp8_attention", False) or not layer.layer_norm1.weight.is_cuda:
        return
    attention = layer.self_attn
    device = layer.layer_norm1.weight.device
    seconds = prepare_fp8_attention(
        device, list(range(1, max_batch + 1)), attention.heads, tower.num_patches, attention.head_dim
    )
    log.info("FP8 vision attention: cuDNN plans for batches of 1-%d images built in %.2f s", max_batch, seconds)


def forget_attention_scales(tower: VisionTower) -> None:
    """Drop what the FP8 attention layers have seen (warm-up and graph capture run the tower on
    made-up images), so the first real batch scales by its own amax. In place: captured graphs
    keep reading the same buffers."""
    with torch.inference_mode():
        for layer in tower.layers:
            if getattr(layer, "fp8_attention", False):
                layer.attention_seen.zero_()


def quantize_vision(tower: VisionTower, report: FP8Report, fp8_attention: bool = False) -> None:
    tower.patch_embedding.as_gemm = True  # bf16 still, a GEMM rather than cuDNN's slow conv
    for index, layer in enumerate(tower.layers):
        tower.layers[index] = quantize_vision_layer(layer, report, f"vision.{index}", fp8_attention=fp8_attention)


def quantize_vision_layer(
    layer: SiglipLayer,
    report: FP8Report,
    where: str,
    rowwise: bool = True,
    fuse_norms: bool = True,
    fp8_attention: bool = False,
) -> nn.Module:
    """The layer to use in place of `layer`, whose dense modules are swapped in place.
    rowwise=False: one scale per weight and per activation tensor (`wicore bench fp8-layers`
    measures both; the engine runs rowwise). Rowwise, with a tanh GELU, the MLP becomes an
    FP8GeluMLP (otherwise fc1 and fc2 become FP8Linears around the plain GELU), and with fused
    q/k/v too the layer becomes an FP8SiglipLayer (`fuse_norms`; the bench measures without),
    with its attention in e4m3 when `fp8_attention` (a layer that does not become one raises)."""
    _swap(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", report, where, rowwise)
    _swap(layer.self_attn, ("out_proj",), "out_proj", report, where, rowwise)
    mlp = layer.mlp
    _swap(mlp, ("fc1",), "fc1", report, where, rowwise)
    _swap(mlp, ("fc2",), "fc2", report, where, rowwise)
    if rowwise and mlp.approximate == "tanh" and isinstance(mlp.fc1, FP8Linear) and isinstance(mlp.fc2, FP8Linear):
        layer.mlp = FP8GeluMLP(mlp.fc1, mlp.fc2)
        attention = layer.self_attn
        if fuse_norms and isinstance(attention.qkv_proj, FP8Linear):
            if not fp8_attention:
                return FP8SiglipLayer(layer)
            if isinstance(attention.out_proj, FP8Linear):
                if attention.out_proj.weight.is_cuda:
                    load_attention_kernels()
                report.attention_layers += 1
                return FP8SiglipLayer(layer, fp8_attention=True)
    if fp8_attention:
        raise ConfigError(
            f"{where}: FP8 vision attention needs the layer's q/k/v, out projection and tanh-GELU MLP in FP8"
        )
    return layer


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
    setattr(owner, into, FP8Linear(quantize_any(weight, rowwise), bias))
    report.quantized += 1


def quantize_decoder(decoder: TextDecoder, report: FP8Report) -> None:
    """Each layer's fused dense weights (`DecoderLayer.fuse_weights`) become FP8Weights; the
    projection modules, which only held views of them, go (the layer functions read the
    layer's attributes alone)."""
    for layer in decoder.layers:
        quantize_decoder_layer(layer, report)


def quantize_decoder_layer(layer: DecoderLayer, report: FP8Report, rowwise: bool = True) -> None:
    if layer.down_weight.is_cuda:
        load_cuda_kernels()  # the MLP quantizes GELU(gate) * up in one pass (ops.fp8.gated_gelu_linear)
    for name in DENSE_WEIGHTS:
        weight = getattr(layer, name)
        if fits(*weight.shape):
            setattr(layer, name, quantize_any(weight, rowwise))
            report.quantized += 1
        else:
            report.skipped.append(f"decoder.{layer.index}.{name}")
    drop_projections(layer)


def quantize_any(weight: torch.Tensor, rowwise: bool) -> FP8Weight:
    return quantize_in_blocks(weight) if rowwise else quantize_weight(weight, rowwise=False)


@torch.no_grad()
def quantize_in_blocks(weight: torch.Tensor) -> FP8Weight:
    """`quantize_weight(weight)` (rowwise), the same bytes, a block of rows at a time: the
    float32 scratch stays under `BLOCK_BYTES` and 1/`BLOCKS_PER_WEIGHT` of the rows, so a
    loader's peak is the weight plus its e4m3 copy."""
    rows, cols = weight.shape
    data = torch.empty(rows, cols, dtype=E4M3, device=weight.device)
    scale = torch.empty(1, rows, dtype=torch.float32, device=weight.device)
    step = max(1, min(BLOCK_BYTES // (4 * cols), rows // BLOCKS_PER_WEIGHT))
    for start in range(0, rows, step):
        block_data, block_scale = quantize_rows(weight[start : start + step])
        data[start : start + step] = block_data
        scale[0, start : start + step] = block_scale.reshape(-1)
    return FP8Weight(data, scale)


def drop_projections(layer: DecoderLayer) -> None:
    for child, names in DECODER_PROJECTIONS.items():
        module = getattr(layer, child)
        for name in names:
            delattr(module, name)


def weight_bytes(parts: Gemma3Parts) -> int:
    """Bytes of every weight the model holds, each storage once (fused weights and their views
    share one)."""
    modules = [m for m in (parts.encoder, parts.decoder) if m is not None]
    tensors = [t for module in modules for t in (*module.parameters(), *module.buffers())]
    for layer in parts.decoder.layers:
        for name in DENSE_WEIGHTS:
            weight = getattr(layer, name)
            tensors += list(weight) if isinstance(weight, FP8Weight) else [weight]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
