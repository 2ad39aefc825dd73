"""Defaults that several layers share, spelled once. The settings (core/config.py) take theirs
from here, and so do the producer's, the worker's, the scheduler's and the image decoder's own
configs, which their tests build without settings. This module imports nothing, so every layer
may import it."""

BATCH_SIZE = 8  # most jobs in one engine batch
MAX_QUEUE_DELAY_S = 0.005  # longest a partial batch waits to fill
MAX_IMAGE_BYTES = 32 * 2**20  # an image's encoded size
MAX_IMAGES_PER_REQUEST = 8  # image parts in one job's conversation
MAX_N = 16  # samples of one request (`n`)
MAX_LOGPROBS = 20  # alternatives per token (`top_logprobs`), as OpenAI's and vLLM's cap
MAX_IMAGE_PIXELS = 50_000_000  # width x height, judged from the header (decompression bombs)
DECODE_BUDGET_BYTES = 512 * 2**20  # full-size pixel memory a worker's concurrent image decodes hold
LIVENESS_TTL_S = 15.0  # a worker silent this long is dead; its jobs are requeued
RESULT_TTL_S = 86_400  # a finished job's result (and its dedup mark) lives this long
RETRIES = 2  # re-runs of a job after a transient failure or a dead worker
NOTIFY_TTL_S = 3_600  # a producer's notification list lives this long after its last push (it may be gone)
WINDOW_JOBS = 2048  # a bulk submitter's unfinished jobs in Redis, at most
WINDOW_BYTES = 512 * 2**20  # a bulk submitter's image bytes in Redis, at most (per worker `wicore caption` starts)
MAX_QUEUED_JOBS = 100_000  # queued jobs per model and lane past which submissions are refused
MAX_QUEUED_HIGH_JOBS = 1_000  # the same for the high lane: interactive work keeps its own headroom
MAX_DECODE_PROCESSES = 8  # a GPU worker's image decode processes by default, at most


def gpu_decode_processes(cores: int, workers: int = 1) -> int:
    """A GPU worker's decode processes by default when `workers` GPU workers share a host of
    `cores` cores: one per two cores of its share, at least 1, at most `MAX_DECODE_PROCESSES`."""
    return max(1, min(MAX_DECODE_PROCESSES, cores // (2 * workers)))
