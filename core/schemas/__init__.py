"""What crosses a process or Redis boundary: caption jobs and their results (pydantic, JSON).

Nothing here imports Redis, RQ or torch, so the producer, the scheduler, the worker and the
engines all share these definitions. One module per concept: `base` (the strict base model,
shared field types), `images` (an image by path, blob or URL), `chat` (conversation turns),
`guided` (a guided output's grammar), `generation` (sampling parameters and their caps), `job`
(the caption job and its id), `results` (a job's result and its output line), `manifest` (a
manifest line of `wicore caption` / `wicore enqueue`).
"""

from wicore.schemas.base import MAX_METADATA_DEPTH, Strict, Text, nesting_depth, shallow, unicode_text
from wicore.schemas.chat import ChatMessage, ImagePart, TextPart, check_conversation
from wicore.schemas.generation import GENERATION_KEYS, GenerationParams, SamplingLimits, sample_seed
from wicore.schemas.guided import MAX_GUIDED_CHOICES, MAX_GUIDED_JSON_BYTES, GuidedSpec
from wicore.schemas.images import URL_SCHEMES, ImageRef, image_url
from wicore.schemas.job import DEFAULT_PROMPT, MODEL_ID_PATTERN, CaptionJob, Lane, job_id_for
from wicore.schemas.manifest import ManifestEntry, ManifestImagePart, ManifestMessage
from wicore.schemas.results import (
    CaptionResult,
    Choice,
    FinishReason,
    ResultLine,
    ResultStatus,
    Timings,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "DEFAULT_PROMPT",
    "GENERATION_KEYS",
    "MAX_GUIDED_CHOICES",
    "MAX_GUIDED_JSON_BYTES",
    "MAX_METADATA_DEPTH",
    "MODEL_ID_PATTERN",
    "URL_SCHEMES",
    "CaptionJob",
    "CaptionResult",
    "ChatMessage",
    "Choice",
    "FinishReason",
    "GenerationParams",
    "GuidedSpec",
    "ImagePart",
    "ImageRef",
    "Lane",
    "ManifestEntry",
    "ManifestImagePart",
    "ManifestMessage",
    "ResultLine",
    "ResultStatus",
    "SamplingLimits",
    "Strict",
    "Text",
    "TextPart",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "check_conversation",
    "image_url",
    "job_id_for",
    "nesting_depth",
    "sample_seed",
    "shallow",
    "unicode_text",
]
