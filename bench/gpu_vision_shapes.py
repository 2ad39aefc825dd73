"""Host and device time of the eager vision tower (4B shape, bf16) at batch sizes it has not
seen, with SDPA free to pick cuDNN attention (the default) and with flash / memory-efficient
attention forced (tried for short batches and dropped: bench/NOTES.md run 51).

    python bench/gpu_vision_shapes.py     # on the GPU machine
"""

from __future__ import annotations

import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import SiglipVisionModel

from wicore.models.gemma3 import gemma3_4b_config


def timed(tower, batch: int, backends) -> tuple[float, float]:
    """(host ms of the call, device ms until done) for one call at `batch` images."""
    pixels = torch.randn(batch, 3, 896, 896, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with sdpa_kernel(backends) if backends else nullcontext(), torch.inference_mode():
        tower(pixel_values=pixels)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * host, 1e3 * (time.perf_counter() - start)


def main() -> None:
    config = gemma3_4b_config().vision_config
    config._attn_implementation = "sdpa"
    tower = SiglipVisionModel(config).to("cuda", torch.bfloat16).eval()
    timed(tower, 4, None)  # CUDA context, cuBLAS, first plans
    forced = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    rows = []
    for name, backends, sizes in [
        ("default (cuDNN)", None, (11, 11, 13, 13)),
        ("flash/efficient", forced, (17, 17, 19, 19)),
    ]:
        for batch in sizes:
            host, total = timed(tower, batch, backends)
            rows.append({"attention": name, "batch": batch, "host_ms": round(host, 1), "total_ms": round(total, 1)})
            print(rows[-1])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "vision_shapes.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
