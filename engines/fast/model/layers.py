"""Small layers shared by the vision tower and the text decoder, numerically as in transformers'
Gemma-3 (norms in float32, activations by the config's name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wicore.errors import ConfigError


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32 and cast back at the end
    (Gemma multiplies before the cast; Llama casts first)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def gelu_approximation(name: str) -> str:
    """F.gelu's `approximate` argument for an activation name."""
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return "tanh"
    if name == "gelu":
        return "none"
    raise ConfigError(f"unsupported activation {name!r}")


def activation(name: str):
    """The activations Gemma-3 and SigLIP configs name (transformers' ACT2FN semantics)."""
    approximate = gelu_approximation(name)
    return lambda x: F.gelu(x, approximate=approximate)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), no biases (Gemma)."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
