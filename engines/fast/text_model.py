"""Gemma-3's text decoder for serving: packed tokens in, hidden states out.

Tokens of all sequences in a step are packed along one axis ([N, hidden]); attention, the only
place where sequences differ, is delegated to an `Attention` backend object (prefill or paged
decode, see `batches.py`) that also writes each layer's K/V into the paged cache.
Numerics follow transformers' `Gemma3TextModel`: RoPE cos/sin computed in float32 from the
positions and cast to the model dtype, QK-norm before RoPE, four RMSNorms per layer, embeddings
scaled by sqrt(hidden) in the model dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from wicore.engines.fast.layers import GatedMLP, GemmaRMSNorm
from wicore.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] (post-RoPE) -> [N, Hq, D]; stores k/v for `layer`."""
        ...


def rope_inv_freq(config, layer_type: str) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32, CPU) for one layer type: 'default' or 'linear'."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        raise ConfigError(f"config.rope_parameters has no entry for {layer_type} (transformers >= 5 configs do)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial rotary embeddings are not supported")
    dim = config.head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / params["factor"]
    elif params["rope_type"] != "default":
        raise ConfigError(f"unsupported rope_type {params['rope_type']!r}")
    return inv_freq


def rope(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, 1, D] in `dtype` (computed in float32 like transformers)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, attention: Attention) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        out = attention(layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        self.index = index
        self.layer_type = config.layer_types[index]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, cos, sin, attention: Attention) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, self.index, attention)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class TextDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        check_text_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Plain CPU attributes, not buffers: the module is built on the meta device and loaded
        # by assignment; `to_device` places these.
        self.inv_freq = {kind: rope_inv_freq(config, kind) for kind in sorted(set(config.layer_types))}
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device="cpu")

    def to_device(self, device: torch.device) -> None:
        self.inv_freq = {kind: f.to(device) for kind, f in self.inv_freq.items()}
        self.embed_scale = self.embed_scale.to(device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, hidden], scaled by sqrt(hidden) rounded to the model dtype (as HF)."""
        weight = self.embed_tokens.weight
        return nn.functional.embedding(ids, weight) * self.embed_scale.to(weight.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """x: [N, hidden] input embeddings, positions: [N] -> final-normed hidden [N, hidden]."""
        ropes = {kind: rope(positions, f, x.dtype) for kind, f in self.inv_freq.items()}
        for layer in self.layers:
            x = layer(x, *ropes[layer.layer_type], attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied lm_head. No final softcapping: `Gemma3ForConditionalGeneration` (the reference)
        does not apply it either."""
        return nn.functional.linear(hidden, self.embed_tokens.weight)


def check_text_config(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError("bidirectional text attention (embedding models) is not supported")
    unknown = set(config.layer_types) - {SLIDING, FULL}
    if unknown:
        raise ConfigError(f"unsupported layer types {sorted(unknown)}")
    if SLIDING in config.layer_types and not config.sliding_window:
        raise ConfigError("sliding_attention layers need config.sliding_window")
