"""The `fast` engine: Gemma-3 served with a paged KV cache, continuous batching, CUDA graphs."""

from wicore.engines.fast.engine import FastEngine

__all__ = ["FastEngine"]
