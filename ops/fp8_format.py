"""What the FP8 ops and their CUDA kernels agree on: the e4m3 type and its range, the floor of a
scale, and the FP8 attention's head padding and scale headroom (ops/fp8_attention.py says why).
The kernel modules (fp8_triton, fp8_attention_cuda, attention/paged_triton) are imported lazily
by the modules that dispatch to them and import only this beneath them."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-12  # an all-zero row (graph padding) gets a tiny scale, not a division by zero
KV_FP8 = E4M3  # the paged KV cache's FP8 element type, at scale 1 (ops/attention/paged.py)

FP8_MULTIPLE = 16  # cuDNN's FP8 forward: head dims that are multiples of 16, up to 256
PAD_TO = 128  # a head dim that is not padded to 128 when it is shorter (the kernels' tile width)
MARGIN = 2.0  # headroom over the amax an FP8 attention call scales by (ops/fp8_attention.py)
# `seen` holds each part's maxima in this many slots (its value: their max), so the thousands of
# programs of the CUDA pass that raises it spread their atomics over as many addresses.
SEEN_SLOTS = 256


def padded_head_dim(head_dim: int) -> int:
    """The head dim cuDNN runs: head_dim when it is a multiple of 16, else 128 (or the next
    multiple of 16 past 128)."""
    if head_dim % FP8_MULTIPLE == 0:
        return head_dim
    return max(PAD_TO, -(-head_dim // FP8_MULTIPLE) * FP8_MULTIPLE)
