"""Gemma-3's image path: the SigLIP vision tower and the multimodal projector.

pixels [N, 3, S, S] -> patches [N, (S/p)^2, Dv] -> 2D average pool to mm_tokens_per_image
-> Gemma RMSNorm -> x @ W [Dv, Dt] -> image embeddings [N, mm_tokens, Dt].
Attention over all patches of an image is unmasked, so SDPA can pick cuDNN / flash kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wicore.engines.fast.model.layers import GemmaRMSNorm, activation, gelu_approximation


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        # One module for all three ([3 * hidden, hidden]) once `fp8.quantize_vision` fuses them:
        # one activation quantization and one GEMM. The bf16 tower keeps three GEMMs, whose
        # outputs equal transformers' bit for bit.
        self.qkv_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self._project(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Projected q, k, v [N, L, hidden] -> the block's output [N, L, hidden]."""
        batch, length, hidden = q.shape
        shape = (batch, length, self.heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # [N, H, L, Dh]
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, L, hidden] -> q, k, v [N, L, hidden] (views of one output when fused)."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x).chunk(3, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)
        self.approximate = gelu_approximation(act)  # F.gelu's: "tanh" lets FP8 fuse it (model/fp8.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(hidden, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SiglipMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))

    def forward_residual(
        self, x: torch.Tensor, pending: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over a residual stream x whose last addend, `pending`, is not yet added
        (None: none): the new stream and its own pending addend. Here nothing is deferred; the
        FP8 layer (model/fp8.py) adds `pending` in the pass of its first norm."""
        return self(x if pending is None else x + pending), None


class PatchEmbedding(nn.Conv2d):
    """pixels [N, C, S, S] -> patch embeddings [N, (S/p)^2, Dv]: a conv whose stride is its kernel.

    `as_gemm`: the same map as one GEMM, the patches being a reshape of the pixels ([N * P, C * p * p]
    rows against the weight as [Dv, C * p * p]), several times faster than cuDNN's conv
    (`implicit_convolve_sgemm`, `cudnn.benchmark` finds nothing faster); most of its outputs equal
    the conv's, the rest differ by one bf16 unit. The FP8 tower
    takes it; the bf16 tower keeps the conv, as transformers runs it, so its outputs stay
    transformers' bit for bit."""

    as_gemm: bool = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.weight.dtype)
        if not self.as_gemm:
            return super().forward(x).flatten(2).transpose(1, 2)
        n, channels, side, _ = x.shape
        patch = self.kernel_size[0]
        grid = side // patch
        rows = x.reshape(n, channels, grid, patch, grid, patch).permute(0, 2, 4, 1, 3, 5)
        rows = rows.reshape(n * grid * grid, channels * patch * patch)
        return F.linear(rows, self.weight.reshape(self.out_channels, -1), self.bias).view(n, grid * grid, -1)


class VisionTower(nn.Module):
    """SigLIP without its pooling head (Gemma-3 sets vision_use_head=False)."""

    def __init__(self, config):
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = PatchEmbedding(config.num_channels, hidden, kernel_size=patch, stride=patch)
        self.num_patches = (config.image_size // patch) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, hidden)
        self.layers = nn.ModuleList(SiglipLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels) + self.position_embedding.weight  # [N, P, Dv]
        pending = None
        for layer in self.layers:
            x, pending = layer.forward_residual(x, pending)
        return self.post_layernorm(x if pending is None else x + pending)


class Projector(nn.Module):
    """Pool the patch grid to mm_tokens_per_image, normalise, project to the text width."""

    def __init__(self, config):
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.kernel = self.patches_per_side // int(config.mm_tokens_per_image**0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(batch, hidden, side, side).contiguous()
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class ImageEncoder(nn.Module):
    """pixels [N, 3, S, S] -> image embeddings [N, mm_tokens_per_image, text hidden]."""

    def __init__(self, config):
        super().__init__()
        self.vision_tower = VisionTower(config.vision_config)
        self.multi_modal_projector = Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))
