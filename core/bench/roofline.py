"""The roofline of image captioning, computed from a Gemma-3 config, and the device ceilings it
is measured against (matmul rate, copy bandwidth, pinned host->device bandwidth).

Per image of `wicore bench caption`'s workload: FLOPs F = vision tower + prefill + decode, bytes
B = the decode weight reads (shared by the batch) + KV reads. images/s <= 1 / max(F / peak,
B / bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Ceilings:
    matmul_flops: float  # bf16, FLOP/s
    copy_bytes_per_s: float  # device-to-device, bytes read + written
    h2d_bytes_per_s: float  # pinned host -> device

    def as_dict(self) -> dict:
        return {k: round(v / 1e12, 3) for k, v in asdict(self).items()} | {"unit": "T(FLOP|B)/s"}


def measure_ceilings(device: str = "cuda") -> Ceilings:
    import torch

    def timed(fn, repeat: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    def matmul_rate(n: int = 8192) -> float:
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        return 2 * n**3 / timed(lambda: a @ b, 10)

    def copy_rates(size: int = 2**30) -> tuple[float, float]:
        src = torch.empty(size, device=device, dtype=torch.uint8).random_(1, 255)
        dst = torch.empty_like(src)
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        return 2 * size / timed(lambda: dst.copy_(src), 10), size / timed(lambda: dst.copy_(host, non_blocking=True), 5)

    matmul = matmul_rate()
    copy, h2d = copy_rates()
    torch.cuda.empty_cache()
    return Ceilings(matmul, copy, h2d)


@dataclass(frozen=True)
class ImageWork:
    vision_flops: float
    prefill_flops: float
    decode_flops: float
    weight_bytes_per_step: float  # read once per decode step, whatever the batch
    kv_bytes_per_token: float  # read per cached token per decode step

    @property
    def flops(self) -> float:
        return self.vision_flops + self.prefill_flops + self.decode_flops


def image_work(config, prompt_tokens: int, new_tokens: int, bytes_per_param: int = 2) -> ImageWork:
    """Counts for one image from a Gemma3Config (HF object or its dict form)."""
    v, t = config.vision_config, config.text_config
    patches = (v.image_size // v.patch_size) ** 2
    h, inter = v.hidden_size, v.intermediate_size
    vision_matmul = v.num_hidden_layers * (4 * h * h + 2 * h * inter)
    vision = 2 * patches * vision_matmul + v.num_hidden_layers * 4 * patches * patches * h
    th, hd = t.hidden_size, t.head_dim
    attn = th * hd * (2 * t.num_attention_heads + 2 * t.num_key_value_heads)
    text_params = t.num_hidden_layers * (attn + 3 * th * t.intermediate_size)
    lm_head = th * t.vocab_size
    kv_per_token = t.num_hidden_layers * 2 * t.num_key_value_heads * hd * bytes_per_param
    return ImageWork(
        vision_flops=vision,
        prefill_flops=2 * prompt_tokens * text_params,
        decode_flops=new_tokens * (2 * text_params + 2 * lm_head),
        weight_bytes_per_step=(text_params + lm_head) * bytes_per_param,
        kv_bytes_per_token=kv_per_token,
    )


def roofline_images_per_s(work: ImageWork, ceilings: Ceilings, batch: int, prompt_tokens: int, new_tokens: int):
    """(images/s, which bound binds). Decode reads the weights once per step for the whole
    batch and each sequence's KV (prompt + tokens so far) every step."""
    mean_context = prompt_tokens + new_tokens / 2
    bytes_per_image = new_tokens * (work.weight_bytes_per_step / batch + mean_context * work.kv_bytes_per_token)
    compute_s = work.flops / ceilings.matmul_flops
    memory_s = bytes_per_image / ceilings.copy_bytes_per_s
    return 1.0 / max(compute_s, memory_s), ("compute" if compute_s >= memory_s else "memory")
