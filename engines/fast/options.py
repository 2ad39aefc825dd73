"""The `fast` engine's options (`EngineConfig.options`), validated: unknown keys and bad values
raise ConfigError instead of being dropped."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from wicore.errors import ConfigError

DEFAULT_MAX_MODEL_LEN = 8192  # caps the per-sequence block table width (the model allows 131k)
DEFAULT_HOST_CACHE_BYTES = 4 * 2**30  # pinned host tier on CUDA
DEFAULT_DISK_CACHE_BYTES = 32 * 2**30
CACHE_POLICIES = ("lru", "a2cr")


@dataclass(frozen=True)
class FastOptions:
    block_size: int = 16  # tokens per KV page (a power of two)
    max_model_len: int | None = None  # prompt + new tokens; default min(model limit, 8192)
    gpu_memory_utilization: float = 0.9  # share of the GPU the engine may fill (weights + KV + work)
    num_kv_blocks: int | None = None  # KV pages in the pool; default: sized from free memory (CUDA)
    cuda_graphs: bool = True  # capture decode and short prefills per size bucket (CUDA only)
    graph_batch_sizes: tuple[int, ...] | None = None  # default [1, 2, 4, 8] + multiples of 16
    # Token-count buckets of the graphs for short prefills (`paged_prefill_tokens`); () captures
    # none. Default: 64, then multiples of 128 up to 2048 (capped by max_prefill_tokens).
    graph_prefill_tokens: tuple[int, ...] | None = None
    # A sequence whose prefill computes at most this many tokens (a follow-up question over a
    # cached image, a short prompt) attends over its pages alone (paged attention, CUDA graphs
    # per token bucket: its launch costs far less host time); longer ones take the dense
    # prefill's larger attention tiles. 0: always dense. Default: 128 on CUDA, 0 on CPU (the CPU
    # paged attention is a per-token reference loop).
    paged_prefill_tokens: int | None = None
    vision_batch_size: int | None = None  # images per vision-tower call; default 32 CUDA, 8 CPU
    compile_vision: bool | None = None  # inductor for the vision tower's full batches; default: on CUDA
    compile_text: bool | None = None  # inductor for the decoder layers' dense parts; default: on CUDA
    # Vision on a side stream beside prefill/decode. The tower's GEMMs slow the decode steps that
    # overlap them (11 -> ~33 ms on an H100), but the device idles less: the cached VQA benchmark
    # ran ~5% faster, uncached and bulk captioning as fast (docs/performance.md). Off: one stream.
    overlap_vision: bool = True
    max_prefill_tokens: int | None = None  # prefill batch x longest prompt; default max(16384, max_model_len)
    vision_cache_bytes: int | None = None  # device memory for cached image embeddings; 0 = off
    preprocess_threads: int | None = None  # threads resizing images; default 8 CUDA, 0 (inline) CPU
    # torch's intra-op (OpenMP) threads in this process. Default on CUDA: 1, as vLLM's GPU workers
    # do: the device does the math, and OpenMP workers spinning after each host copy take cores
    # from the pixel threads and the thread that launches the kernels (the cached VQA benchmark:
    # ~7.0 -> ~6.6 s; docs/performance.md). CPU engines keep torch's default.
    torch_threads: int | None = None
    # Prefix KV cache across requests (engines/kvcache/README.md): full prompt blocks stay in the
    # GPU pool after their sequence ends, move down to a pinned host tier and a disk tier under
    # pressure and come back on a hit.
    prefix_cache: bool = True
    # Pinned host tier; default 4 GiB on CUDA, 0 (off) on CPU. PyTorch's pinned allocator rounds
    # an allocation up to a power of two: 24 GiB pins 32 GiB.
    host_cache_bytes: int | None = None
    disk_cache_dir: str | None = None  # disk tier folder (one engine process per folder); None: off
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES
    cache_policy: str = "a2cr"  # eviction order of every tier: "a2cr" (cost-aware, frequency) or "lru"
    # A cached prefix may end inside an image (the rest of its soft tokens are prefilled from its
    # embeddings: the vision tower or the vision cache). Off: matches are cut back to the image's
    # start, so questions about one image share its blocks only when the image ends
    # on a block boundary shared by their prompts.
    prefix_split_images: bool = False

    @classmethod
    def parse(cls, options: dict[str, Any]) -> FastOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown fast engine option(s) {unknown}; known: {sorted(known)}")
        values = dict(options)
        for name in ("graph_batch_sizes", "graph_prefill_tokens"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        parsed = cls(**values)
        parsed._check()
        return parsed

    def _check(self) -> None:
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.vision_cache_bytes is not None:
            _int_at_least("vision_cache_bytes", self.vision_cache_bytes, 0)
        for name in ("max_model_len", "num_kv_blocks", "vision_batch_size", "max_prefill_tokens"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.paged_prefill_tokens is not None:
            _int_at_least("paged_prefill_tokens", self.paged_prefill_tokens, 0)
        if self.preprocess_threads is not None:
            _int_at_least("preprocess_threads", self.preprocess_threads, 0)
        if self.torch_threads is not None:
            _positive_int("torch_threads", self.torch_threads)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, int | float):
            raise ConfigError("gpu_memory_utilization must be a number")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_cache()
        for name in ("cuda_graphs", "overlap_vision", "prefix_cache", "prefix_split_images"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("compile_vision", "compile_text"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be true, false or null, got {getattr(self, name)!r}")
        if self.graph_batch_sizes is not None:
            if not self.graph_batch_sizes:
                raise ConfigError("graph_batch_sizes must not be empty")
            for size in self.graph_batch_sizes:
                _positive_int("graph_batch_sizes entry", size)
        for size in self.graph_prefill_tokens or ():
            _positive_int("graph_prefill_tokens entry", size)

    def _check_cache(self) -> None:
        if self.host_cache_bytes is not None:
            _int_at_least("host_cache_bytes", self.host_cache_bytes, 0)
        _positive_int("disk_cache_bytes", self.disk_cache_bytes)
        if self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"cache_policy must be one of {list(CACHE_POLICIES)}, got {self.cache_policy!r}")
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir:
                raise ConfigError(f"disk_cache_dir must be a folder path, got {self.disk_cache_dir!r}")
            if self.host_cache_bytes == 0 or not self.prefix_cache:
                raise ConfigError("disk_cache_dir needs prefix_cache and a host tier (host_cache_bytes > 0)")

    def host_bytes(self, cuda: bool) -> int:
        """Bytes of the pinned host tier (0: none); on CPU a disk tier needs it set explicitly."""
        if not self.prefix_cache:
            return 0
        if self.host_cache_bytes is not None:
            return self.host_cache_bytes
        if self.disk_cache_dir is not None and not cuda:
            raise ConfigError("disk_cache_dir on CPU needs host_cache_bytes (the disk tier sits below the host tier)")
        return DEFAULT_HOST_CACHE_BYTES if cuda else 0

    def model_len(self, model_limit: int) -> int:
        length = self.max_model_len if self.max_model_len is not None else min(model_limit, DEFAULT_MAX_MODEL_LEN)
        if length > model_limit:
            raise ConfigError(f"max_model_len {length} exceeds the model's {model_limit} positions")
        return length

    def prefill_tokens(self, model_len: int) -> int:
        tokens = self.max_prefill_tokens if self.max_prefill_tokens is not None else max(16384, model_len)
        if tokens < model_len:
            raise ConfigError(f"max_prefill_tokens {tokens} must be >= max_model_len {model_len}")
        return tokens

    def graph_sizes(self, max_batch_size: int) -> list[int]:
        """Decode batch-size buckets, ascending; a batch is padded up to the next one."""
        if self.graph_batch_sizes is not None:
            return sorted(set(self.graph_batch_sizes))
        sizes = [s for s in [1, 2, 4, 8] if s < max_batch_size] + list(range(16, max_batch_size + 1, 16))
        return sorted(set(sizes) | {max_batch_size})

    def prefill_graph_sizes(self, prefill_tokens: int) -> list[int]:
        """Token-count buckets of the paged-prefill graphs, ascending (empty: none)."""
        if self.graph_prefill_tokens is not None:
            return sorted(set(self.graph_prefill_tokens))
        return [t for t in [64, *range(128, 2049, 128)] if t <= prefill_tokens]  # padding <= 128 tokens

    def paged_suffix(self, cuda: bool) -> int:
        if self.paged_prefill_tokens is not None:
            return self.paged_prefill_tokens
        return 128 if cuda else 0

    def compiles(self, cuda: bool) -> tuple[bool, bool]:
        """(compile the vision tower, compile the decoder layers): by default on CUDA only,
        where the fused kernels pay for the ~1 minute of compiling at start-up."""
        vision = cuda if self.compile_vision is None else self.compile_vision
        text = cuda if self.compile_text is None else self.compile_text
        return vision, text

    def vision_cache(self, cuda: bool, enabled: bool = True) -> int:
        """Bytes of embeddings kept on the device (a 4B image: 256 x 2560 bf16 = 1.3 MB)."""
        if not enabled:
            return 0
        if self.vision_cache_bytes is not None:
            return self.vision_cache_bytes
        return 2 * 2**30 if cuda else 64 * 2**20

    def vision_batch(self, cuda: bool) -> int:
        return self.vision_batch_size if self.vision_batch_size is not None else (32 if cuda else 8)

    def intra_op_threads(self, cuda: bool) -> int | None:
        """torch.set_num_threads for the engine's process; None: leave torch's default."""
        return self.torch_threads if self.torch_threads is not None else (1 if cuda else None)

    def threads(self, cuda: bool) -> int:
        """HF-exact resizing runs in PIL (it releases the GIL): ~25 ms of CPU per 896 px image,
        so a GPU serving ~60 images/s needs several cores of it."""
        return self.preprocess_threads if self.preprocess_threads is not None else (8 if cuda else 0)


def _positive_int(name: str, value: Any) -> None:
    _int_at_least(name, value, 1)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
