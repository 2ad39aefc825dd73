"""Gemma-3's text decoder for serving: packed tokens in, hidden states out.

Tokens of all sequences in a step are packed along one axis ([N, hidden]); attention, the only
place where sequences differ, is delegated to an `Attention` backend object (prefill or paged
decode, see `attention_backends`) that also writes each layer's K/V into the paged cache.
Numerics follow transformers' `Gemma3TextModel`: RoPE cos/sin computed in float32 from the
positions and cast to the model dtype, QK-norm before RoPE, four RMSNorms per layer, embeddings
scaled by sqrt(hidden) in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from wicore.engines.fast.model.layers import GatedMLP, GemmaRMSNorm, gelu_approximation
from wicore.engines.kvcache.kv_layout import FULL, SLIDING
from wicore.errors import ConfigError
from wicore.ops.fp8 import FP8Weight, gated_gelu_linear, linear

DENSE_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")  # a layer's GEMM weights, after fusing


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: in float32, times (1 + w), cast back at the end (see layers.GemmaRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def attention_inputs(x, cos, sin, norm_w, qkv_w, q_norm_w, k_norm_w, heads: int, kv_heads: int, eps: float):
    """x [N, hidden] -> q [N, Hq, D], k, v [N, Hkv, D]: input norm, one fused q/k/v projection
    (`DecoderLayer.fuse_weights`), QK-norm, RoPE. A free function of tensors (a weight may be an
    FP8Weight, a pair of tensors), so one compiled graph serves every layer."""
    n = x.shape[0]
    h = rms_norm(x, norm_w, eps)
    dim = q_norm_w.shape[0]  # head_dim
    q, k, v = linear(h, qkv_w).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = rms_norm(q.reshape(n, heads, dim), q_norm_w, eps)
    k = rms_norm(k.reshape(n, kv_heads, dim), k_norm_w, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(n, kv_heads, dim)


def attention_outputs(x, attn, o_w, post_attn_w, pre_ffn_w, gate_up_w, down_w, post_ffn_w, eps: float, gelu: str):
    """Residual stream after attention [N, Hq, D]: o_proj, post-attention norm, residual,
    pre-FFN norm, gated MLP (one fused gate/up projection), post-FFN norm, residual -> [N, hidden]."""
    n = x.shape[0]
    x = x + rms_norm(linear(attn.reshape(n, -1), o_w), post_attn_w, eps)
    h = rms_norm(x, pre_ffn_w, eps)
    h = gated_gelu_linear(linear(h, gate_up_w), down_w, gelu)
    return x + rms_norm(h, post_ffn_w, eps)


@dataclass
class LayerFunctions:
    """The two dense halves of a decoder layer; `compile` swaps in inductor-compiled versions."""

    inputs: Callable = attention_inputs
    outputs: Callable = attention_outputs

    def compile(self) -> None:
        self.inputs = compile_dynamic(attention_inputs)
        self.outputs = compile_dynamic(attention_outputs)


def compile_dynamic(fn: Callable) -> Callable:
    """Inductor with symbolic sizes (one graph for every token count), rounding intermediates
    to the model dtype as eager does, so outputs stay as close as possible to transformers'."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    if hasattr(inductor, "emulate_precision_casts"):
        inductor.emulate_precision_casts = True
    # Every engine in a process shares these two functions' compiled variants, and each model,
    # dtype and GEMM mode adds its own (a benchmark or test process builds several): dynamo's
    # default of 8 per function would fail a later engine with fullgraph=True.
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 64))
    return torch.compile(fn, dynamic=True, fullgraph=True)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden = config.hidden_size
        if config.attention_bias:
            raise ConfigError("attention biases are not supported (Gemma-3 has none)")
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        self.index = index
        self.layer_type = config.layer_types[index]
        hidden, self.eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(config)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.gelu = gelu_approximation(config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(hidden, self.eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, self.eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, self.eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, self.eps)

    def fuse_weights(self) -> None:
        """Concatenate the materialised q/k/v and gate/up weights so each runs as one GEMM; the
        separate parameters become views of the fused ones (the loader, `model.loader`, writes
        checkpoints straight into fused buffers instead)."""
        a, m = self.self_attn, self.mlp
        self.set_dense(
            _fuse(a.q_proj, a.k_proj, a.v_proj), a.o_proj.weight.detach(),
            _fuse(m.gate_proj, m.up_proj), m.down_proj.weight.detach(),
        )  # fmt: skip

    def set_dense(self, qkv, o, gate_up, down) -> None:
        """The four dense weights the layer functions take (`DENSE_WEIGHTS`): fused q/k/v
        [(Hq + 2 Hkv) D, hidden], o, fused gate/up [2 I, hidden], down; each a plain tensor
        (one GEMM, fewer nodes in decode graphs) or an FP8Weight (`fp8.quantize_decoder`)."""
        self.qkv_weight: torch.Tensor | FP8Weight = qkv
        self.o_weight: torch.Tensor | FP8Weight = o
        self.gate_up_weight: torch.Tensor | FP8Weight = gate_up
        self.down_weight: torch.Tensor | FP8Weight = down

    def forward(self, x, cos, sin, attention: Attention, fns: LayerFunctions) -> torch.Tensor:
        a = self.self_attn
        q, k, v = fns.inputs(
            x, cos, sin, self.input_layernorm.weight, self.qkv_weight,
            a.q_norm.weight, a.k_norm.weight, a.heads, a.kv_heads, self.eps,
        )  # fmt: skip
        out = attention(self.index, q, k, v)
        return fns.outputs(
            x, out, self.o_weight, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
            self.gate_up_weight, self.down_weight, self.post_feedforward_layernorm.weight,
            self.eps, self.gelu,
        )  # fmt: skip


def _fuse(*projections: nn.Linear) -> torch.Tensor:
    """[sum out, in]: the projections' weights stacked; each keeps a view of its rows."""
    fused = torch.cat([proj.weight for proj in projections])
    start = 0
    for proj in projections:
        rows = proj.weight.shape[0]
        proj.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


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
        self.fns = LayerFunctions()

    def fuse_weights(self) -> None:
        for layer in self.layers:
            layer.fuse_weights()

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
            x = layer(x, *ropes[layer.layer_type], attention, self.fns)
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
