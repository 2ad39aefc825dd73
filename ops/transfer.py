"""Host -> device copies that never make the host wait for the device.

A synchronous copy (`.to(device)`) waits for everything queued on the stream, which would undo
an engine's running a step ahead; `non_blocking` from pageable memory depends on driver
staging. So small per-step inputs go through pinned memory (PyTorch's caching host allocator:
cheap after warm-up, and it keeps the buffer alive until the copy has read it).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a tensor, numpy array or list) on `device`, copied asynchronously on CUDA."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
