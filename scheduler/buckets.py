"""Shape buckets: which jobs may share a batch.

A job's bucket is (model, priority lane, image crops (0 for text only, one per image without
pan-and-scan), prompt-length bucket, max-new-tokens bucket); each bucket is one RQ queue, so a worker's batch never mixes shapes that would pad
badly. The bucket edges are explicit lists (nano-vllm's graph_bs idea): a value goes to the
first edge >= it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from wicore.keys import QUEUE_PREFIX
from wicore.schemas import CaptionJob, Lane

PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NEW_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

_QUEUE_NAME = re.compile(
    rf"^{QUEUE_PREFIX}\.(?P<model>[A-Za-z0-9][A-Za-z0-9_-]*)\.(?P<lane>high|normal|low)"
    r"\.c(?P<crops>\d+)\.p(?P<prompt>\d+)\.n(?P<new>\d+)$"
)


def bucket_up(value: int, edges: tuple[int, ...]) -> int:
    """The first edge >= value; values past the last edge share the last bucket."""
    for edge in edges:
        if value <= edge:
            return edge
    return edges[-1]


@dataclass(frozen=True, order=True)
class BucketKey:
    model: str
    lane: Lane
    crops: int
    prompt: int  # upper edge of the prompt-length bucket, in estimated text tokens
    new_tokens: int  # upper edge of the max_new_tokens bucket

    @property
    def queue_name(self) -> str:
        return f"{QUEUE_PREFIX}.{self.model}.{self.lane.value}.c{self.crops}.p{self.prompt}.n{self.new_tokens}"

    @classmethod
    def parse(cls, queue_name: str) -> BucketKey | None:
        """None for queue names that are not wicore buckets."""
        m = _QUEUE_NAME.match(queue_name)
        if m is None:
            return None
        return cls(m["model"], Lane(m["lane"]), int(m["crops"]), int(m["prompt"]), int(m["new"]))


def queue_prefix(model: str) -> str:
    return f"{QUEUE_PREFIX}.{model}."


@dataclass(frozen=True)
class ShapeRules:
    """Gemma-3's rules. Without pan-and-scan every image is one crop of a fixed token count;
    prompt length is estimated from UTF-8 bytes (no tokenizer on the producer side), which is
    enough to group jobs whose padded prefill costs about the same."""

    bytes_per_token: float = 3.0
    template_tokens: int = 16  # turn markers, <bos>, newlines around the image

    def estimate_prompt_tokens(self, job: CaptionJob) -> int:
        text_bytes = 0
        for message in job.chat():
            content = message["content"]
            parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]
            text_bytes += sum(len(p.encode()) for p in parts)
        return self.template_tokens + math.ceil(text_bytes / self.bytes_per_token)

    def bucket(self, job: CaptionJob) -> BucketKey:
        return BucketKey(
            model=job.model,
            lane=job.priority,
            crops=len(job.images),
            prompt=bucket_up(self.estimate_prompt_tokens(job), PROMPT_BUCKETS),
            new_tokens=bucket_up(job.params.max_new_tokens, NEW_TOKEN_BUCKETS),
        )
