"""Engine options and their resolution, beneath every engine (only `fast` takes any).

`FastOptions` is what a user sets (the settings' `[engine]` section, core/config.py): typed,
documented, strict (`true`, not `1` or `"yes"`), unknown keys rejected. A default that depends on
the device or the model is `None` here; `resolve_options` fixes every one of them once, from the
checkpoint's config before any weight loads, into a frozen `ResolvedFastConfig` of plain values
that the engine, its parts and the worker read. This module imports neither torch nor Redis: the
settings import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from wicore.engines.checkpoint import max_positions
from wicore.errors import ConfigError

CUBLAS_AUTOTUNE = "max-autotune-cublas"  # vision_compile_mode: max-autotune's fusion tuning, cuBLAS GEMMs
DEFAULT_MAX_MODEL_LEN = 8192  # caps the per-sequence block table width (the model allows 131k)
DEFAULT_MAX_PREFILL_TOKENS = 16384
DEFAULT_HOST_CACHE_BYTES = 4 * 2**30  # pinned host tier on CUDA
DEFAULT_DISK_CACHE_BYTES = 32 * 2**30
DECODE_GRAPH_SIZES = (1, 2, 4, 8)  # then every multiple of 16 up to the batch size
PREFILL_GRAPH_TOKENS = (64, *range(128, 2049, 128))  # a short prefill pads by at most 128 tokens

PositiveInt = Annotated[int, Field(ge=1)]


class FastOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    block_size: int = Field(16, ge=1, description="Tokens per KV page (a power of two). Default 16.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + new tokens of one sequence. Default: min(the model's limit, 8192)."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU the engine may fill: weights + KV + work space. Default 0.9."
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV pages in the pool. Default: as many as fit in the free device memory."
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="Device memory the start-up fit check counts on, in place of the GPU's total x "
        "gpu_memory_utilization - memory in use (on the CPU, the only way to run the check: tests, dry runs). "
        "Default: the GPU's figures; no check on the CPU.",
    )
    cuda_graphs: bool = Field(
        True, description="Capture decode and short prefills as CUDA graphs per size bucket (CUDA only). Default on."
    )
    vision_graph: bool | None = Field(
        None,
        description="Replay the vision tower's full batches (vision_batch_size images) on the side stream as one CUDA "
        "graph, captured at load: launched from Python, the FP8 tower holds the launching thread for much of its "
        "device time. Default: with cuda_graphs.",
    )
    graph_batch_sizes: tuple[PositiveInt, ...] | None = Field(
        None, min_length=1, description="Decode batch-size buckets. Default: 1, 2, 4, 8, then multiples of 16."
    )
    graph_prefill_tokens: tuple[PositiveInt, ...] | None = Field(
        None,
        description="Token-count buckets of the short-prefill graphs; [] captures none. "
        "Default: 64, then multiples of 128 up to 2048 (capped by max_prefill_tokens).",
    )
    dense_prefill_graphs: int = Field(
        4,
        ge=0,
        description="Dense prefills (up to 4,096 tokens) of this many distinct shapes replay a CUDA graph once "
        "their shape repeats, as bulk work's do (one prompt, one image size): their eager launch costs more host "
        "time than device time. The graphs keep their activations outside the KV budget. 0: always eager. CUDA graphs only. Default 4.",
    )
    paged_prefill_tokens: int | None = Field(
        None,
        ge=0,
        description="A prefill that computes at most this many tokens (a follow-up question over a cached image, "
        "a short prompt) attends over its pages alone: paged attention, CUDA graphs per token bucket, far less "
        "host time per launch. Longer ones take the dense prefill's larger tiles. 0: always dense. "
        "Default: 128 on CUDA, 0 on CPU (the CPU paged attention is a per-token reference loop).",
    )
    vision_batch_size: int | None = Field(
        None,
        ge=1,
        description="Images per vision-tower call. Default: 8 (as fast as 32 for bulk work on a large GPU, "
        "and a high-lane job waits behind a quarter of the work).",
    )
    vision_batches_queued: int = Field(
        1,
        ge=1,
        description="Vision batches queued on the side stream at once. 1 leaves a high-lane job's images behind "
        "at most one bulk batch (docs/benchmarks.md, interactive jobs beside bulk). Default: 1.",
    )
    decode_interval_ms: float = Field(
        0,
        ge=0,
        description="Bulk throughput: while a vision batch is on the device, a decode step waits until this long "
        "after the last one, so decode runs fewer, larger batches (a step's weight reads and launches shared by more "
        "sequences) and the tower gets the device time saved; a full batch, or one with a high-lane sequence, goes "
        "at once. Each token of a sequence then takes up to this long. 0: decode every step. Default: 0.",
    )
    compile_vision: bool | None = Field(
        None,
        description="Inductor for the vision tower's full batches. Default: on CUDA only, where the fused kernels "
        "pay for the compiling at start-up.",
    )
    vision_compile_mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune-cublas"] | None = Field(
        None,
        description="torch.compile mode of the vision tower (with compile_vision). max-autotune-no-cudagraphs "
        "tunes the fused norm and GELU kernels and benchmarks Triton templates for the tower's GEMMs at start-up: "
        "faster bulk captioning for minutes more of the first start on a machine (inductor caches the choices for "
        "the next). max-autotune-cublas: the same tuning with the GEMMs left to cuBLAS, which max-autotune picks "
        "for every FP8 GEMM of the tower anyway after minutes of benchmarking templates. "
        "default: the quickest start. Default: max-autotune-cublas with gemm_dtype=fp8, else "
        "max-autotune-no-cudagraphs.",
    )
    compile_text: bool | None = Field(
        None, description="Inductor for the decoder layers' dense parts. Default: on CUDA only (as compile_vision)."
    )
    overlap_vision: bool = Field(
        True,
        description="Run the vision tower on a side stream beside prefill/decode. Its GEMMs slow the decode steps "
        "they overlap, but the device idles less (the cached VQA benchmark runs faster with it). "
        "Off: one stream. Default on.",
    )
    max_prefill_tokens: int | None = Field(
        None, ge=1, description="Prefill batch x longest prompt. Default: max(16384, max_model_len)."
    )
    vision_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="Device memory for cached image embeddings (a 4B image: 256 x 2560 bf16 = 1.3 MB); 0: off. "
        "Default: 2 GiB on CUDA, 64 MiB on CPU.",
    )
    preprocess_threads: int | None = Field(
        None,
        ge=0,
        description="Threads resizing images (PIL releases the GIL; a GPU's bulk rate of 896 px images "
        "needs several cores of resizing). 0: inline. Default: 8 on CUDA, 0 on CPU.",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch's intra-op (OpenMP) threads in the engine's process. Default: 1 on CUDA, as vLLM's GPU "
        "workers do (OpenMP workers spinning after each host copy take cores from the pixel threads and the "
        "launching thread); CPU engines keep torch's default.",
    )
    prefix_cache: bool = Field(
        True,
        description="Prefix KV cache across requests (engines/kvcache/README.md): full prompt blocks stay in the GPU "
        "pool after their sequence ends, move down to the host and disk tiers under pressure and come back on a "
        "hit. Default on.",
    )
    host_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="Pinned host tier of the prefix cache (one allocation, page-locked at start, exactly this "
        "size); 0: none. Default: 4 GiB on CUDA, 0 on CPU.",
    )
    batched_copies: bool | None = Field(
        None,
        description="Move KV blocks between the host tier and the GPU as one cuMemcpyBatchAsync per step (needs "
        "cuda-python and a CUDA >= 12.8 driver; without them, or off, each run of host slots is one copy and "
        "restores go through a staging buffer and a scatter kernel). Default: off: the per-run copies restore closer to the pinned bandwidth.",
    )
    disk_cache_dir: str | None = Field(
        None,
        min_length=1,
        description="Disk tier folder of the prefix cache (one engine process per folder); needs a host tier. "
        "Default: none.",
    )
    disk_cache_bytes: int = Field(DEFAULT_DISK_CACHE_BYTES, ge=1, description="Disk tier size. Default 32 GiB.")
    cache_policy: Literal["lru", "a2cr"] = Field(
        "a2cr", description="Eviction order of every tier: a2cr (cost-aware, frequency) or lru. Default a2cr."
    )
    gemm_dtype: Literal["model", "fp8"] = Field(
        "model",
        description="Precision of the dense layers' GEMMs (the vision tower's projections and MLP, the decoder's "
        "q/k/v, o, gate/up and down). fp8: e4m3 weights (a scale per output channel, quantized once at load; the "
        "bf16 weights freed) and activations (a scale per token), bf16 out; the rest stays bf16. Needs a GPU of "
        "compute capability 8.9+ (Ada, Hopper) and dtype bfloat16; `--dtype fp8` sets both. Tokens differ from "
        "bf16's (docs/benchmarks.md has the agreement and the demo captioner's accuracy). Default model: the "
        "model's dtype.",
    )
    vision_attention_dtype: Literal["model", "fp8"] = Field(
        "model",
        description="Precision of the vision tower's attention under FP8 GEMMs (gemm_dtype=fp8; with the model's "
        "GEMMs it is the model's too). fp8: q, k and v in e4m3 "
        "(one scale each), cuDNN's fused FP8 attention (heads zero-padded to a multiple of 16, 128 for SigLIP's 72), "
        "its output requantized per row for the out projection. Needs compute capability 9.0+ (Hopper) and the "
        "nvidia-cudnn-frontend package (the fp8 extra); its error and token agreement are in docs/benchmarks.md. "
        "Default model: bf16 attention.",
    )
    kv_cache_dtype: Literal["model", "fp8"] = Field(
        "model",
        description="Element type of the paged KV cache. fp8: e4m3 K/V at scale 1 (as vLLM's FP8 KV cache by "
        "default: 3 mantissa bits, values past +-448 saturate), half the bytes a token: twice the pages in the same "
        "memory and half of decode's K/V reads; attention still computes in the model's dtype, and the prefix "
        "cache's tiers keep FP8 blocks apart from the model dtype's. Tokens differ from the model dtype's "
        "(docs/benchmarks.md). On CUDA needs compute capability 8.9+ (Ada, Hopper). Default model.",
    )
    prefix_split_images: bool = Field(
        False,
        description="Let a cached prefix end inside an image (the rest of its soft tokens prefill from its "
        "embeddings). Off: matches are cut back to the image's start, so questions about one image share its "
        "blocks only when the image ends on a block boundary. Default off.",
    )

    @field_validator("graph_batch_sizes", "graph_prefill_tokens", mode="before")
    @classmethod
    def _list_as_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # TOML and JSON give lists

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value

    @model_validator(mode="after")
    def _disk_needs_host_tier(self) -> FastOptions:
        if self.disk_cache_dir is not None and (self.host_cache_bytes == 0 or not self.prefix_cache):
            raise ValueError("disk_cache_dir needs prefix_cache and a host tier (host_cache_bytes > 0)")
        return self

    @property
    def fp8_vision_attention(self) -> bool:
        """The tower's attention runs in FP8: asked for, and inside an FP8 tower (gemm_dtype=fp8)."""
        return self.gemm_dtype == "fp8" and self.vision_attention_dtype == "fp8"

    @property
    def fp8_kv_cache(self) -> bool:
        """The paged KV cache holds e4m3 K/V (kv_cache_dtype=fp8)."""
        return self.kv_cache_dtype == "fp8"

    def numerics_tag(self) -> str | None:
        """What sets this engine's numbers apart from the model dtype's ("fp8", "fp8-attention"), or
        None: cached K/V and image embeddings are kept apart by it."""
        if self.gemm_dtype != "fp8":
            return None
        return "fp8-attention" if self.fp8_vision_attention else "fp8"

    @classmethod
    def parse(cls, options: dict[str, Any]) -> FastOptions:
        """Options from a plain dict; a bad one raises a one-line ConfigError naming its key."""
        try:
            return cls.model_validate(options)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, cls, "fast engine option") from None

    def resolve(self, *, cuda: bool, model_limit: int, max_batch_size: int, cache: bool = True) -> ResolvedFastConfig:
        """Every default fixed for this device and model. `cache=False` (`--no-cache`) turns off
        the prefix and vision caches; `model_limit` is the model's position count."""
        prefix_cache = self.prefix_cache and cache
        model_len = self._model_len(model_limit)
        prefill_tokens = self._prefill_tokens(model_len)
        graphs = cuda and self.cuda_graphs
        return ResolvedFastConfig(
            cuda=cuda,
            block_size=self.block_size,
            max_model_len=model_len,
            max_prefill_tokens=prefill_tokens,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks,
            memory_budget_bytes=self.memory_budget_bytes,
            cuda_graphs=graphs,
            vision_graph=graphs and _default(self.vision_graph, True),
            graph_batch_sizes=self._graph_sizes(max_batch_size) if graphs else (),
            graph_prefill_tokens=self._prefill_graph_sizes(prefill_tokens) if graphs else (),
            dense_prefill_graphs=self.dense_prefill_graphs if graphs else 0,
            paged_prefill_tokens=_default(self.paged_prefill_tokens, 128 if cuda else 0),
            vision_batch_size=_default(self.vision_batch_size, 8),
            vision_batches_queued=self.vision_batches_queued,
            decode_interval_s=self.decode_interval_ms / 1000,
            compile_vision=_default(self.compile_vision, cuda),
            vision_compile_mode=_default(
                self.vision_compile_mode, CUBLAS_AUTOTUNE if self.gemm_dtype == "fp8" else "max-autotune-no-cudagraphs"
            ),
            compile_text=_default(self.compile_text, cuda),
            overlap_vision=self.overlap_vision,
            vision_cache_bytes=self._vision_cache(cuda) if cache else 0,
            preprocess_threads=_default(self.preprocess_threads, 8 if cuda else 0),
            torch_threads=_default(self.torch_threads, 1 if cuda else None),
            prefix_cache=prefix_cache,
            host_cache_bytes=self._host_bytes(cuda) if prefix_cache else 0,
            batched_copies=cuda and _default(self.batched_copies, False),
            disk_cache_dir=self.disk_cache_dir if prefix_cache else None,
            disk_cache_bytes=self.disk_cache_bytes,
            cache_policy=self.cache_policy,
            prefix_split_images=self.prefix_split_images,
            gemm_dtype=self.gemm_dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def _model_len(self, model_limit: int) -> int:
        length = _default(self.max_model_len, min(model_limit, DEFAULT_MAX_MODEL_LEN))
        if length > model_limit:
            raise ConfigError(f"max_model_len {length} exceeds the model's {model_limit} positions")
        return length

    def _prefill_tokens(self, model_len: int) -> int:
        tokens = _default(self.max_prefill_tokens, max(DEFAULT_MAX_PREFILL_TOKENS, model_len))
        if tokens < model_len:
            raise ConfigError(f"max_prefill_tokens {tokens} must be >= max_model_len {model_len}")
        return tokens

    def _graph_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """Decode batch-size buckets, ascending; a batch is padded up to the next one."""
        if self.graph_batch_sizes is not None:
            return tuple(sorted(set(self.graph_batch_sizes)))
        sizes = {s for s in DECODE_GRAPH_SIZES if s < max_batch_size} | set(range(16, max_batch_size + 1, 16))
        return tuple(sorted(sizes | {max_batch_size}))

    def _prefill_graph_sizes(self, prefill_tokens: int) -> tuple[int, ...]:
        """Token-count buckets of the paged-prefill graphs, ascending (empty: none)."""
        if self.graph_prefill_tokens is not None:
            return tuple(sorted(set(self.graph_prefill_tokens)))
        return tuple(t for t in PREFILL_GRAPH_TOKENS if t <= prefill_tokens)

    def _vision_cache(self, cuda: bool) -> int:
        return _default(self.vision_cache_bytes, 2 * 2**30 if cuda else 64 * 2**20)

    def _host_bytes(self, cuda: bool) -> int:
        if self.host_cache_bytes is not None:
            return self.host_cache_bytes
        if self.disk_cache_dir is not None and not cuda:
            raise ConfigError("disk_cache_dir on CPU needs host_cache_bytes (the disk tier sits below the host tier)")
        return DEFAULT_HOST_CACHE_BYTES if cuda else 0


def resolve_options(
    options: FastOptions, model_dir: str, *, device: str, max_batch_size: int, cache: bool = True
) -> ResolvedFastConfig:
    """`options` for one checkpoint on one device (`cpu`, `cuda`, `cuda:N`): its position limit
    read from the checkpoint's config, no weights loaded."""
    cuda = device.split(":")[0] == "cuda"
    limit = max_positions(model_dir)
    return options.resolve(cuda=cuda, model_limit=limit, max_batch_size=max_batch_size, cache=cache)


@dataclass(frozen=True)
class ResolvedFastConfig:
    """`FastOptions` with every default fixed for one device and model (FastOptions documents
    each field). Without CUDA graphs the graph size tuples are empty and dense_prefill_graphs is 0."""

    cuda: bool
    block_size: int
    max_model_len: int
    max_prefill_tokens: int
    gpu_memory_utilization: float
    num_kv_blocks: int | None  # None: sized from the free device memory at start
    memory_budget_bytes: int | None  # None: the GPU's figures (no fit check on the CPU)
    cuda_graphs: bool  # on CUDA only
    vision_graph: bool  # with cuda_graphs only
    graph_batch_sizes: tuple[int, ...]
    graph_prefill_tokens: tuple[int, ...]
    dense_prefill_graphs: int
    paged_prefill_tokens: int
    vision_batch_size: int
    vision_batches_queued: int
    decode_interval_s: float
    compile_vision: bool
    vision_compile_mode: str
    compile_text: bool
    overlap_vision: bool
    vision_cache_bytes: int
    preprocess_threads: int
    torch_threads: int | None  # None: torch's default
    prefix_cache: bool
    host_cache_bytes: int
    batched_copies: bool  # asked for (CUDA only); the tiers fall back where the driver has none
    disk_cache_dir: str | None
    disk_cache_bytes: int
    cache_policy: str
    prefix_split_images: bool
    gemm_dtype: str
    kv_cache_dtype: str


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
